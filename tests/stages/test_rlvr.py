"""The RLVR loop end to end on a tiny model: determinism on-policy, bounded staleness when
overlapped, and the learner batch's alignment of tokens, masks and behaviour log-probs."""

import shutil
import threading
import time
import traceback

import ml_collections
import numpy as np
import pytest

from posttrain.rl.envs import SingleTurnEnv
from posttrain.rl.envs.base import Trajectory
from posttrain.rl.rollout.buffer import Rollout
from posttrain.rl.tasks.scheduler import Group
from posttrain.stages import rlvr as loop
from tests.support.rl_runs import TIMING, rows, tiny
from tests.support.typed_configs import typed


def test_on_policy_runs_repeat_exactly_and_async_respects_staleness(tmp_path):
    a = loop.run(typed(tiny(tmp_path / "a")))
    b = loop.run(typed(tiny(tmp_path / "b")))
    ra, rb = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert len(ra) == len(rb) == 3
    for x, y in zip(ra, rb):
        for k in x:
            if k not in TIMING:
                np.testing.assert_allclose(y[k], x[k], rtol=1e-6, err_msg=k)
    assert ra[0]["rl/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)  # sampler and learner agree
    assert a.eval == b.eval

    overlapped = tiny(tmp_path / "c", max_staleness=1, steps=6)
    overlapped.checkpoint.every = 4
    loop.run(typed(overlapped))
    rc = rows(tmp_path / "c")
    assert [r["step"] for r in rc] == list(range(6))
    assert all(r["rl/staleness_max"] <= 1 for r in rc)

    # Resume of an overlapped run from a checkpoint taken while the producer ran ahead: it used to
    # restore the producer's counter (ahead of the learner), and producer and learner then waited
    # on each other forever.
    shutil.rmtree(tmp_path / "c" / "checkpoints" / "6")
    _, error = run_with_deadline(overlapped, 300)
    assert error is None, error
    assert [r["step"] for r in rows(tmp_path / "c")] == list(range(6))
    assert (tmp_path / "c" / "checkpoints" / "6").is_dir()


def run_with_deadline(cfg, seconds):
    """loop.run(typed(cfg)) on a thread: (seconds taken, the exception it raised or None); fails on a hang."""
    out = {}

    def target():
        try:
            loop.run(typed(cfg))
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t0 = time.perf_counter()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"loop.run still running after {seconds} s (hung)"
    return time.perf_counter() - t0, out.get("error")


class VerifierCrashed(Exception):
    pass


def test_a_verifier_exception_ends_an_overlapped_run_with_that_exception(tmp_path, monkeypatch):
    raised = []

    def crash(self, action):
        raised.append(time.perf_counter())
        raise VerifierCrashed("the verifier crashed")

    monkeypatch.setattr(SingleTurnEnv, "step", crash)
    _, error = run_with_deadline(tiny(tmp_path, max_staleness=1), 300)
    assert isinstance(error, VerifierCrashed), error
    assert "in crash" in "".join(traceback.format_tb(error.__traceback__))
    assert time.perf_counter() - raised[0] < 30


def test_rl_batch_aligns_targets_masks_and_behaviour_logprobs():
    # prompt of 3 tokens, then 2 generated tokens; a second sample with 1 generated token
    t1 = Trajectory("t", [5, 6, 7, 8, 9], [False, False, False, True, True], 3)
    t2 = Trajectory("t", [5, 6, 7, 4], [False, False, False, True], 3)
    b1 = np.array([0, 0, 0, -0.5, -1.5], np.float32)
    b2 = np.array([0, 0, 0, -2.0], np.float32)
    ro = Rollout(Group("arithmetic", None, [1.0, 0.0], [t1, t2]), 0, [b1, b2])
    batch = loop.rl_batch([ro], pad_id=0)
    batch["advantages"] = loop.compute_advantages(
        batch, ml_collections.ConfigDict(dict(group_size=2, advantage="drgrpo"))
    )
    np.testing.assert_array_equal(batch["inputs"][0, :4], [5, 6, 7, 8])
    np.testing.assert_array_equal(batch["targets"][0, :4], [6, 7, 8, 9])
    np.testing.assert_array_equal(batch["loss_mask"][0, :5], [0, 0, 1, 1, 0])  # targets 8 and 9 are the model's
    np.testing.assert_allclose(batch["behav_logp"][0, 2:4], [-0.5, -1.5])
    np.testing.assert_array_equal(batch["loss_mask"][1, :4], [0, 0, 1, 0])
    np.testing.assert_array_equal(batch["segment_ids"][1, :4], [1, 1, 1, 0])
    np.testing.assert_allclose(batch["advantages"], [0.5, -0.5])
    assert batch["inputs"].shape[1] % 8 == 0


def test_resume_continues_exactly(tmp_path):
    """Lose the last checkpoint, run again: the step, scheduler position, RNG stream and policy
    version carry on from the one before, so the metrics equal the uninterrupted run's; the held-out
    evaluation logged just before the checkpoint resumed from is logged again (it was missing)."""
    cfg = tiny(tmp_path, steps=4, kl_coef=0.05, eval_every=2, eval_size=4)  # the KL reference must come back too
    cfg.checkpoint.every = 2
    loop.run(typed(cfg))
    before = rows(tmp_path)
    shutil.rmtree(tmp_path / "checkpoints" / "4")
    resumed = loop.run(typed(cfg))  # resumes from step 2
    after = rows(tmp_path)
    assert [(r["step"], "eval/accuracy" in r) for r in after] == [
        (0, True),
        (0, False),
        (1, False),
        (2, True),
        (2, False),
        (3, False),
        (4, True),
    ]  # evaluations at the number of updates they measure, each before its checkpoint
    assert [r["step"] for r in before] == [r["step"] for r in after] and resumed.eval.keys() >= {"eval/accuracy"}
    for x, y in zip(before, after):
        assert x.keys() == y.keys()
        for k in x.keys() - set(TIMING):
            np.testing.assert_allclose(y[k], x[k], rtol=1e-5, err_msg=f"step {x['step']} {k}")


def test_dynamic_sampling_without_an_informative_group_skips_the_update(tmp_path):
    """The untrained tiny policy never answers right: every group's rewards are equal, dynamic
    sampling keeps none, and each step is skipped and counted (it used to crash), with every
    sampled group recorded once in the scheduler (it used to be twice)."""
    loop.run(typed(tiny(tmp_path, filter_groups=True, steps=2)))
    rs = rows(tmp_path)
    assert [r["rl/skipped_updates"] for r in rs] == [1, 2]
    assert [r["rl/kept_groups"] for r in rs] == [0, 0]
    assert rs[-1]["tasks/arithmetic/groups"] == 2 * 2 * 2  # steps × max_resample_rounds × prompts
    assert rs[-1]["tasks/arithmetic/dropped_groups"] == 8
    # the numbers describe every sampled group and round, not only the (here: no) kept groups
    assert all(r["rl/reward_mean"] == 0.0 and r["rl/responses"] == 16 for r in rs)
    assert "rl/kept_reward_mean" not in rs[0]  # nothing kept, nothing trained on


def test_rollout_info_of_several_rounds_describes_every_round():
    """Dynamic sampling's rounds: lengths, truncation and times over all of them (they used to be
    the last round's), and the reward of every sampled group apart from the kept ones."""
    from posttrain.rl.rollout.hosts import combine_rounds, sampled_reward_stats
    from posttrain.rl.rollout.worker import SUMMED_INFO

    infos = [
        dict(gen_s=1.0, model_s=1.0, env_s=3.0, env_frac=0.75, response_len_mean=10.0, response_len_max=12),
        dict(gen_s=2.0, model_s=3.0, env_s=1.0, env_frac=0.25, response_len_mean=20.0, response_len_max=30),
    ]
    for info, extra in zip(
        infos,
        [
            dict(truncated_frac=0.5, responses=8, verifier_errors=1),
            dict(truncated_frac=0.0, responses=24, verifier_errors=0),
        ],
    ):
        info.update(extra)
    out = combine_rounds(infos, SUMMED_INFO)
    assert out == pytest.approx(
        dict(
            gen_s=3.0,
            model_s=4.0,
            env_s=4.0,
            env_frac=0.5,
            response_len_mean=17.5,
            response_len_max=30,
            truncated_frac=0.125,
            responses=32,
            verifier_errors=1,
        )
    )
    info = {"sampled_judged": 4.0, "sampled_reward_sum": 3.0, "sampled_reward_sq_sum": 3.0, "responses": 4}
    stats = sampled_reward_stats(info, 2.0)
    assert stats == pytest.approx({"rl/reward_mean": 1.5, "rl/reward_std": 2.0 * np.sqrt(0.75 - 0.5625)})
    assert info == {"responses": 4}  # the counts are not logged themselves


def test_lora_with_a_kl_reference_trains_on_policy(tmp_path):
    """`--config.lora.rank=2 --config.rl.kl_coef=0.1` (max_staleness=0): the reference is the frozen
    base inside the donated train state; passing it beside the state handed XLA one buffer twice
    ("Attempt to use a buffer that was previously donated", then a segfault)."""
    cfg = tiny(tmp_path, kl_coef=0.1, steps=2)
    cfg.lora.rank = 2
    # no warmup: the first update's learning rate is not 0, so the adapters move (with warmup, the
    # KL after it was 0 but for float rounding, which the optimised CPU build made 3e-14 at both steps)
    cfg.optim.warmup_steps = 0
    loop.run(typed(cfg))
    rs = rows(tmp_path)
    assert [r["step"] for r in rs] == [0, 1]
    assert all(np.isfinite(r["rl/kl"]) and np.isfinite(r["loss"]) for r in rs)
    assert rs[0]["rl/kl"] < 1e-9  # the policy is its reference before any update
    assert rs[1]["rl/kl"] > 1e-6  # one update moved the adapters away from it (measured: 4.5e-4)
