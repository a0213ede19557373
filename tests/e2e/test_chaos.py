"""Chaos (issue 45 item 6, slow): a 20-update disaggregated `rlvr_tiny` run with two sampler
processes that are killed (SIGKILL) and started again at random points, the learner once. The run
completes; every update trained the uninterrupted colocated run's rollouts (task ids and responses,
`rl.rollouts_every=1`), so no batch was lost or trained twice; and its final weights are that run's
(on-policy, `rl.max_staleness=0`). The kills' schedule comes from a seeded generator; the test
prints the figures BENCHMARKS quotes (kills, seconds to the next trained step after each, wall time).
"""

import json
import random
import re
import sys
import time

import jax
import numpy as np
import pytest

from posttrain.config import RLConfig
from tests.support.rl_processes import command, spawn, start, wait

STEPS = 20
NO_EVAL = {"rl.eval_every": 0, **{f"rl.{k}": getattr(RLConfig(), k) for k in ("eval_size", "eval_samples")}}
RUN = {
    "train.steps": STEPS,
    "checkpoint.every": 2,
    "rl.rollouts_every": 1,
    "rl.rollouts_fraction": 1.0,
    "rl.lease_timeout_s": 3.0,
    **NO_EVAL,
}


def colocated(workdir, log) -> None:
    """The uninterrupted reference: the same run in one process (rl.placement=colocated)."""
    argv = [a for a in command(workdir, "learner", **RUN) if not a.startswith(("--config.rl.role", "--config.rl.pl"))]
    wait(start(argv, log), log, timeout=600)


def steps_logged(workdir) -> int:
    """The newest training step in metrics.jsonl (-1: none yet)."""
    path = workdir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return max((r["step"] for r in rows if "loss" in r), default=-1)


def rollouts(workdir) -> list[list[tuple[str, str]]]:
    """Per update, the (task id, response) of every sample it trained on."""
    out = []
    for step in range(STEPS):
        lines = (workdir / "rollouts" / f"{step:07d}.jsonl").read_text().splitlines()
        out.append(sorted((r["task_id"], r["response"]) for r in map(json.loads, lines)))
    return out


def final_params(workdir) -> list[np.ndarray]:
    import orbax.checkpoint as ocp

    tree = ocp.PyTreeCheckpointer().restore(str(workdir / "checkpoints" / str(STEPS) / "params"))
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_kills_of_samplers_and_the_learner_lose_no_batch_and_change_no_weight(tmp_path):
    reference, run = tmp_path / "colocated", tmp_path / "chaos"
    colocated(reference, tmp_path / "colocated.log")
    rng, logs = random.Random(45), iter(range(100))
    log = lambda role: tmp_path / f"{role}{next(logs)}.log"  # noqa: E731
    # the schedule by training step, so that the kills happen however fast this machine runs:
    # four sampler kills and one of the learner after a checkpoint (every 2 steps)
    plan = sorted([(s, f"sampler{rng.randrange(2)}") for s in rng.sample(range(1, STEPS - 2), 4)])
    plan = sorted([*plan, (rng.randrange(6, 12), "learner")])
    learner = spawn(run, "learner", log("learner"), **RUN)
    samplers = [spawn(run, "sampler", log("sampler"), **RUN) for _ in range(2)]
    kills, recovered, start, deadline = [], [], time.time(), time.time() + 1500
    while learner.poll() is None:
        assert time.time() < deadline, "the chaos run did not finish"
        time.sleep(0.2)
        step = steps_logged(run)
        if not plan or step < plan[0][0]:
            continue
        _, who = plan.pop(0)
        if who == "learner":
            learner.kill()
            learner.wait()
            learner = spawn(run, "learner", log("learner"), **RUN)
        else:
            i = int(who[-1])
            samplers[i].kill()
            samplers[i].wait()
            samplers[i] = spawn(run, "sampler", log("sampler"), **RUN)
        kills.append((who, step))
        t0 = time.time()
        while steps_logged(run) <= step and learner.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        recovered.append(time.time() - t0)
    assert learner.wait() == 0, f"learner exit {learner.returncode}"
    for s in samplers:
        assert s.wait(60) == 0
    pulls = [
        tuple(map(float, m.groups()))
        for path in tmp_path.glob("sampler*.log")
        for m in re.finditer(r"pulled ([\d.]+) MiB in ([\d.]+) s", path.read_text())
    ]  # (the samplers that lived to the end)
    mib, pull_s = sum(m for m, _ in pulls), sum(t for _, t in pulls)
    figures = dict(kills=kills, seconds=round(time.time() - start), recover_s=[round(r, 1) for r in recovered])
    figures.update(pulled_mib=round(mib, 2), pull_s=round(pull_s, 2), mib_per_s=round(mib / pull_s, 1) if pull_s else 0)
    print(json.dumps(figures), file=sys.stderr)
    assert len(kills) >= 4 and any(who == "learner" for who, _ in kills), figures
    assert rollouts(run) == rollouts(reference)  # every update: the same tasks and responses, once each
    for ours, theirs in zip(final_params(run), final_params(reference), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
