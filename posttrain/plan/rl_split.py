"""How to split TPU chips between the RL learner and the sampler (`rl.placement=split`, or a
sampler slice beside a learner slice over DCN), from the analytic cost model alone (no compile):
`tools/pod_plan.py --rl-split` (with `--compile`, `rl_split_compile` compiles one split's programs).

Each candidate gives the sampler N chips (a multiple of the model-parallel group G = fsdp × expert,
which the sampler mesh keeps, `rl.rollout.placement`) and the learner the rest, and estimates per
RL step (all floors from `cost_model.program_cost`, the roofline):
* generation: the sampler program of ONE sampler replica (G chips, its share of the prompts:
  replicas on `data` sample independently), `rl.group_size` samples × `rl.max_new_tokens` each;
  the share is bucketed to a power of two as the sampler buckets prompts, so a replica count
  that does not divide the prompts gains nothing over the power of two below it;
* learning: the `rl_learner` program on the learner's chips, × minibatches × updates per batch,
  its rows padded to a multiple of the learner's chips (as `rl.algo.learner.batch_rows` pads);
* publish: the weights moved learner → sampler once per step: each sampler chip takes its shard
  over ICI; with two slices, when a slice holds only sampler chips, a whole copy of the model
  crosses DCN first (at the per-chip DCN bandwidth of `aot.Chip.dcn_bytes_per_s`, over the chips
  on the narrower side); a learner spanning both slices reduces its gradients over DCN instead.
With `rl.max_staleness >= 1` generation and learning overlap: step = max(gen, learn) + publish
(the publish is charged in full, not hidden). A candidate whose learner state (params, gradients,
optimizer moments, reference) or sampler state (two copies of the weights while one is
published, KV cache) exceeds a chip's HBM is listed with the reason and never recommended.
"""

from __future__ import annotations

import dataclasses
import math

from jax.sharding import AbstractMesh

from posttrain.parallel import parse_rules
from posttrain.plan import aot, cost_model

AXES = ("data", "fsdp", "expert", "tensor", "sequence")


@dataclasses.dataclass(frozen=True)
class Split:
    """One candidate split and its per-step estimate (seconds; bytes per chip)."""

    sampler_chips: int
    learner_chips: int
    gen_s: float
    learn_s: float
    publish_s: float
    publish_bytes: float  # the whole model, moved once per step (bytes)
    link: str  # "ICI" or "DCN": what the publish crosses
    learner_gb: float  # per-chip state floors, GB
    sampler_gb: float
    problem: str = ""  # why the split cannot run ("" when it can)

    @property
    def step_s(self) -> float:
        """Per RL step with generation and learning overlapped (max_staleness >= 1)."""
        return max(self.gen_s, self.learn_s) + self.publish_s


def mesh(chips: int, group: int, expert: int) -> AbstractMesh:
    """An abstract mesh of `chips` chips: the model-parallel group (fsdp × expert = `group`), the
    rest on data (as the split's sampler mesh is laid out)."""
    return AbstractMesh((chips // group, group // expert, expert, 1, 1), AXES)


def with_dispatch(cfg, generation: str):
    """cfg with `model.moe.dispatch='auto'` resolved as it resolves on `generation`'s chips
    (`moe.dispatch.auto_dispatch`; an abstract mesh has no devices to read it from)."""
    if cfg.model.moe.dispatch != "auto":
        return cfg
    return cfg.replace({"model.moe.dispatch": "padded" if generation == "v5e" else "ragged"})


def state_bytes(cfg, w: cost_model.WeightBytes) -> float:
    """A floor on the learner's bytes per chip: params, gradients and AdamW's two moments of the
    trained weights (all in the params' dtype), and the frozen reference when rl.kl_coef > 0."""
    moments = 2 if cfg.optim.name == "adamw" else 0
    return w.local + (1 + moments) * w.local_trained + (w.local if cfg.rl.kl_coef else 0.0)


def default_group(cfg, chip: aot.Chip, chips: int, headroom: float = 0.8) -> int:
    """The smallest model-parallel group (a power-of-two multiple of mesh.expert, at most
    `chips`) whose learner state floor fits in `headroom` × a chip's HBM (activations need the rest)."""
    rules = parse_rules(cfg.sharding.rules)
    expert = max(1, min(cfg.mesh.expert, chips))
    group = expert
    while group < chips:
        w = cost_model.weight_bytes(cfg, mesh(group, group, expert), rules)
        if state_bytes(cfg, w) <= headroom * chip.hbm_bytes:
            break
        group *= 2
    return group


def _learn_seconds(cfg, chips: int, group: int, expert: int, rules, prompt_len: int, chip: aot.Chip) -> float:
    """The learner's time per RL step on `chips` chips: its rows per minibatch padded up to a
    multiple of lcm(chips, group size), × minibatches × updates per batch."""
    r = cfg.rl
    rows = r.prompts_per_step * r.group_size // r.minibatches
    unit = math.lcm(chips, r.group_size)
    padded = -(-rows // unit) * unit
    c = cfg.replace({"rl.prompts_per_step": padded // r.group_size, "rl.minibatches": 1})
    step = cost_model.program_cost(c, mesh(chips, group, expert), rules, "rl_learner", prompt_len, chip)["step_s"]
    return step * r.minibatches * r.updates_per_batch


def _gen_seconds(cfg, replicas: int, group: int, expert: int, rules, prompt_len: int, chip: aot.Chip) -> tuple:
    """(seconds, KV bytes per chip) of one sampler replica on its share of the prompts."""
    c = cfg.replace({"rl.prompts_per_step": -(-cfg.rl.prompts_per_step // replicas)})
    m = mesh(group, group, expert)
    cost = cost_model.program_cost(c, m, rules, "sampler", prompt_len, chip)
    work = cost_model.program_work(c, "sampler", prompt_len)
    rows = cost_model.tokens_per_chip(work["prompts"] * work["samples"], 1, m, rules)
    kv = rows * (work["prompt_len"] + work["new_tokens"]) * cost_model.kv_bytes_per_position(cfg.model)
    return cost["step_s"], kv


def plan_split(cfg, generation: str, slice_chips: int, slices: int = 1, group: int = 0, prompt_len: int = 1024):
    """Every candidate split of `slices` slices of `slice_chips` chips of `generation`
    (a list of `Split`, fewest sampler chips first) for cfg's model and RL batch (rl.*)."""
    chip = aot.CHIPS[generation]
    if slices not in (1, 2):
        raise ValueError(f"slices={slices}: expected 1 or 2")
    if slices == 2 and not chip.dcn_bytes_per_s:
        raise ValueError(f"{generation}: no published DCN bandwidth in aot.CHIPS; plan one slice")
    cfg = with_dispatch(cfg, generation)
    rules = parse_rules(cfg.sharding.rules)
    total = slices * slice_chips
    expert = max(1, min(cfg.mesh.expert, slice_chips))
    group = group or default_group(cfg, chip, slice_chips)
    if group % expert or slice_chips % group:
        raise ValueError(f"group={group}: must be a multiple of mesh.expert={expert} dividing {slice_chips} chips")
    w = cost_model.weight_bytes(cfg, mesh(group, group, expert), rules)
    model_bytes = w.local * group  # every weight once (data=1: sharded over the group, no replicas)
    out = []
    for n in range(group, total, group):
        learners = total - n
        learn = _learn_seconds(cfg, learners, group, expert, rules, prompt_len, chip)
        gen, kv = _gen_seconds(cfg, n // group, group, expert, rules, prompt_len, chip)
        publish, link = w.local / chip.ici_bytes_per_s, "ICI"
        if slices == 2 and n >= slice_chips:  # slice 2 holds no learner: one copy crosses DCN
            senders = min(learners, slice_chips)
            publish += model_bytes / (senders * chip.dcn_bytes_per_s)
            link = "DCN"
        elif slices == 2:  # the learner spans both slices: its gradient shards are reduced over DCN
            r = cfg.rl
            learn += r.minibatches * r.updates_per_batch * w.local_trained / chip.dcn_bytes_per_s
        learner_state, sampler_state = state_bytes(cfg, w), 2 * w.local + kv
        problem = ""
        if learner_state > chip.hbm_bytes:
            problem = f"learner state {learner_state / 1e9:.0f} GB > HBM"
        elif sampler_state > chip.hbm_bytes:
            problem = f"sampler weights ×2 + KV {sampler_state / 1e9:.0f} GB > HBM"
        out.append(
            Split(
                n, learners, gen, learn, publish, model_bytes, link, learner_state / 1e9, sampler_state / 1e9, problem
            )
        )
    return out


def colocated(cfg, generation: str, chips: int, group: int, prompt_len: int = 1024) -> tuple[float, float]:
    """(generation, learning) seconds per step with both on every chip, one after the other
    (rl.placement=colocated, max_staleness = 0): the baseline a split must beat."""
    chip, cfg = aot.CHIPS[generation], with_dispatch(cfg, generation)
    rules = parse_rules(cfg.sharding.rules)
    expert = max(1, min(cfg.mesh.expert, chips))
    gen, _ = _gen_seconds(cfg, chips // group, group, expert, rules, prompt_len, chip)
    return gen, _learn_seconds(cfg, chips, group, expert, rules, prompt_len, chip)


def recommend(splits: list[Split]) -> Split | None:
    """The runnable split with the least time per step (ties: the better balanced); None if none runs."""
    ok = [s for s in splits if not s.problem]
    return min(ok, key=lambda s: (s.step_s, abs(s.gen_s - s.learn_s))) if ok else None
