"""Pod planning: what a run's programs cost on a TPU slice, before one is rented.

`aot.py` (abstract TPU devices and chip facts), `roofline.py` (a program's time floor per chip),
`cost_model.py` (analytic per-chip cost of each program, `PROGRAMS`), `compile_plan.py` (the
programs compiled for a topology without a TPU), `rl_split.py` (how to split chips between the RL
learner and sampler) and `rl_split_compile.py` (one split compiled). The tools that print the plans
are `tools/compile_plan.py`, `tools/pod_plan.py` and `tools/roofline.py`.
"""
