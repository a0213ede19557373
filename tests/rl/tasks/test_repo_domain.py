"""Multi-turn agent RL (rl.env = "tool"): the persistent sandboxed session, the workspace
environment on the repo_fix domain (scripted policies), the batched episode rollout's loss mask
and behaviour log-probs against the learner's, and the loop training on the domain end to end."""

from __future__ import annotations

import concurrent.futures
import json
import re

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain.config import OptimConfig, base_config
from posttrain.core.optim import make_optimizer
from posttrain.core.state import create_train_state
from posttrain.models.decoder import Decoder
from posttrain.parallel import make_mesh, parse_rules, use_sharding
from posttrain.rl.algo.learner import learner_logprobs, rl_batch
from posttrain.rl.envs import run_episode
from posttrain.rl.envs.base import Task
from posttrain.rl.envs.workspace import WorkspaceEnv
from posttrain.rl.reward import RewardConfig, RewardFunction
from posttrain.rl.rollout.episodes import rollout_episodes
from posttrain.rl.rollout.worker import RolloutWorker
from posttrain.rl.tasks import repo_domain
from posttrain.rl.tasks.domains import Domain
from posttrain.rl.verifiers import MathTask
from posttrain.rl.verifiers.math import MathVerifier
from posttrain.sampling.rules import SamplingParams
from posttrain.sandbox import Limits, Sandbox, Status
from posttrain.sandbox.session import Session, _parse_report
from posttrain.stages import rlvr as loop
from posttrain.stages import rlvr_parts
from tests.support.episodes import TOK, CountingEnv, runs
from tests.support.paths import ROOT
from tests.support.typed_configs import TINY_DENSE, model, typed

LIMITS = Limits(
    cpu_s=2,
    wall_s=2.0,
    memory_bytes=512 << 20,
    processes=16,
    file_bytes=1 << 20,
    output_bytes=16 << 10,
    disk_bytes=1 << 20,
)


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(LIMITS, max_workers=2) as sb:
        yield sb


def turn(text: str) -> list[int]:
    return TOK.encode(text) + [TOK.eos_id]


def scripted(*turns):
    it = iter(turns)
    return lambda context: turn(next(it))


def test_session_keeps_its_directory_across_calls_and_restores_snapshots(sandbox):
    s = Session(sandbox, {"a.txt": "one\n"}, max_calls=7, max_bytes=4096)
    r = s.run("sh", "echo two >> a.txt; mkdir -p d; printf '#!/bin/sh\\necho run\\n' > d/x.sh; chmod +x d/x.sh")
    assert r.status is Status.PASS, r
    after_first = s.snapshot()
    r = s.run("sh", "cat a.txt; ./d/x.sh")
    assert r.ok and r.output == b"one\ntwo\nrun\n"  # files and their modes persist
    assert s.run("python", "import os; os.remove('a.txt')").ok and "a.txt" not in s.snapshot().as_dict()
    s.restore(after_first)  # replay from after the first call
    assert s.run("sh", "cat a.txt; exit 3").output == b"one\ntwo\n"
    r = s.run("sh", "head -c 5000 /dev/zero > big; echo written")
    assert r.status is Status.LIMIT_EXCEEDED and r.limit == "bytes" and "big" not in s.snapshot().as_dict()
    r = s.run("sh", "echo partial > p; sleep 5")  # the call's own time limit (2 s)
    assert r.status is Status.TIMEOUT and s.snapshot().as_dict()["p"] == b"partial\n"
    r = s.run("sh", "echo a\0b")  # a command no shell can take is the call's failure
    assert r.status is Status.FAIL and r.exit_code == 126 and b"null byte" in r.output
    r = s.run("sh", "true")
    assert r.status is Status.LIMIT_EXCEEDED and r.limit == "calls"  # max_calls=7 per session


@pytest.fixture(scope="module")
def repo_env(sandbox):
    reward_fn = RewardFunction({}, RewardConfig(invalid_tool_call_penalty=0.1, redundant_tool_call_penalty=0.05))
    return lambda **kw: WorkspaceEnv(TOK, reward_fn, sandbox, limits=LIMITS, **{"max_turns": 4, **kw})


TASK = repo_domain.repo_task("config", "SIZE", 12, 37)


def test_repo_fix_demonstration_solves_it_and_masks_exactly_the_model_turns(repo_env):
    env = repo_env()
    demo = repo_domain.demonstration(TASK)
    traj = run_episode(env, TASK, scripted(*demo))
    assert traj.reward.score == 1.0 and traj.turns == 3 and traj.info["tool_calls"] == 2
    assert traj.info["tool_ok"] == 2 and traj.info["invalid_tool_calls"] == 0
    assert runs(traj.tokens, traj.loss_mask) == [turn(t) for t in demo]
    # Everything else is prompt or tool output, exactly as the chat template lays the episode out.
    test_src = dict(TASK.target.files)["test_config.py"]
    messages = [
        {"role": "system", "content": env.system_prompt},
        *TASK.prompt,
        {"role": "assistant", "content": demo[0]},
        {"role": "tool", "content": f"<output>\n{test_src}</output>"},
        {"role": "assistant", "content": demo[1]},
        {"role": "tool", "content": "<output>\n</output>"},
        {"role": "assistant", "content": demo[2]},
    ]
    ids, trainable = TOK.encode_chat(messages)
    assert traj.tokens == ids and traj.loss_mask == trainable
    # The working directory after each call can be replayed from.
    assert env.replay(0).snapshot().as_dict()["config.py"] == b"SIZE = 12\n"
    assert env.replay(1).run("sh", "cat config.py").output == b"SIZE = 37\n"
    # The other scripted fix lets sed take the value out of the test: no value in the model's tokens.
    demo = repo_domain.demonstration(TASK, extract=True)
    traj = run_episode(repo_env(), TASK, scripted(*demo))
    assert traj.reward.score == 1.0 and "37" not in demo[1] and demo[1] != repo_domain.demonstration(TASK)[1]
    with pytest.raises(ValueError, match="extract_frac must be in"):
        repo_domain.demonstration_records([TASK], repo_env, extract_frac=1.5)


def test_demonstrations_are_kept_by_correctness_not_by_the_weighted_reward(sandbox):
    # correct_weight 0.5: a solved episode's correct part is 0.5, its verdict still correct
    reward_fn = RewardFunction({}, RewardConfig(correct_weight=0.5))
    make = lambda: WorkspaceEnv(TOK, reward_fn, sandbox, limits=LIMITS, max_turns=4)
    assert [r["task_id"] for r in repo_domain.demonstration_records([TASK], make)] == [TASK.id]


def test_repo_fix_final_check_uses_the_pristine_tests_and_penalties_apply(repo_env):
    cheat = ["<tool>sh\necho 'pass' > test_config.py\n</tool>", "Done."]
    traj = run_episode(repo_env(), TASK, scripted(*cheat))
    assert traj.reward.parts["correct"] == 0.0  # editing the test does not pass it
    look = "<tool>sh\ncat test_config.py\n</tool>"
    messy = [look, look, "<tool>sh\nexit 2\n</tool>", "Done."]  # one redundant call, one failing call
    traj = run_episode(repo_env(), TASK, scripted(*messy))
    assert traj.info["redundant_tool_calls"] == 1 and traj.info["invalid_tool_calls"] == 1
    assert traj.reward.parts["tool_calls"] == pytest.approx(-0.15) and traj.reward.parts["correct"] == 0.0
    fixed = [look, "<tool>sh\nsed -i s/12/37/ config.py\n</tool>", "<tool>sh\ncat config.py\n</tool>"]
    traj = run_episode(repo_env(max_turns=3), TASK, scripted(*fixed))
    assert traj.info["truncated"] == "max_turns" and traj.reward.score == 0.0  # never said it was done


def test_repo_fix_held_out_tasks_are_disjoint_from_training_by_construction():
    train, test = repo_domain.repo_tasks("train", 500, seed=1), repo_domain.repo_tasks("test", 100, seed=2)
    fix = lambda t: repo_domain.task_fields(t)[:2] + repo_domain.task_fields(t)[3:]
    assert len({t.id for t in train}) == 500 and len({t.id for t in test}) == 100
    assert not {fix(t) for t in train} & {fix(t) for t in test}
    demo_lines = {line for t in train for ext in (False, True) for line in repo_domain.demonstration(t, extract=ext)}
    assert not demo_lines & {repo_domain.demonstration(t)[1] for t in test}
    assert all(repo_domain.repo_split(*fix(t)) == "test" for t in test)
    drills = repo_domain.copy_drills(2000, seed=3)  # SFT copy drills: no task's module or constant
    drill_lines = {m["content"] for r in drills for m in r["messages"] if m["role"] == "assistant"}
    assert len(drill_lines) > 3000 and not drill_lines & (demo_lines | {repo_domain.demonstration(t)[1] for t in test})
    for r in drills:
        fixed = r["messages"][-1]["content"]
        assert (
            fixed.split("'")[1].split(" = ")[0].islower()
            and fixed.split("> ")[1].split(".py")[0] not in repo_domain.MODULES
        )


def test_episode_rollout_masks_model_tokens_and_its_behaviour_logprobs_equal_the_learners():
    m = model(vocab_size=264, embed_dim=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
    mesh, rules = make_mesh(dict(data=1), devices=jax.devices()[:1]), parse_rules({})
    with use_sharding(mesh, rules):
        tx = make_optimizer(OptimConfig(), 10)
        graphdef, state, _ = create_train_state(lambda: Decoder(m, rngs=nnx.Rngs(0)), tx, mesh, rules)
        sampling = SamplingParams(
            temperature=0.7, top_k=12, top_p=0.9, max_new_tokens=6, stop_ids=(TOK.eos_id,), num_samples=4
        )
        reward_fn = RewardFunction({MathTask: MathVerifier()})
        envs = []
        make_env = lambda: envs.append(CountingEnv(TOK, reward_fn, max_turn_tokens=6)) or envs[-1]
        tasks = [Task(f"t{i}", ({"role": "user", "content": f"say {i}"},), MathTask(str(i))) for i in range(2)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            worker = RolloutWorker(
                graphdef,
                {"count": Domain("count", tasks, make_env)},
                sampling,
                TOK.pad_id,
                pool,
                episodes=rollout_episodes,
            )
            batch = worker.rollout(state.params, state.rest, [("count", t) for t in tasks], jax.random.key(3))
        trajs = [t for g in batch.groups for t in g.trajectories]
        assert len(trajs) == 8 and {t.turns for t in trajs} >= {1, 3}, "episodes should end at different turns"
        for env, traj in zip(envs, trajs):
            assert runs(traj.tokens, traj.loss_mask) == env.actions  # exactly the sampled turns are masked in
            rebuilt = traj.tokens[: traj.prompt_len]
            for k, action in enumerate(env.actions):
                rebuilt = rebuilt + action + (env.observations[k] if k < len(env.observations) else [])
            assert rebuilt == traj.tokens
        assert batch.info["turns_per_episode"] == np.mean([t.turns for t in trajs])
        learner_batch = rl_batch(batch.rollouts(0), pad_id=TOK.pad_id)
        logp, _, _ = learner_logprobs(
            nnx.merge(graphdef, state.params, state.rest), learner_batch, sampling, update_bias=False
        )
    mask = learner_batch["loss_mask"].astype(bool)
    assert mask.sum() == sum(t.num_generated for t in trajs)
    np.testing.assert_allclose(np.asarray(logp)[mask], learner_batch["behav_logp"][mask], atol=1e-5)
    assert not learner_batch["behav_logp"][~mask].any()


def tool_cfg(workdir, **rl):
    cfg = base_config()
    cfg.stage, cfg.workdir = "rlvr", str(workdir)
    m = cfg.model
    m.update(TINY_DENSE)
    m.moe.num_experts, m.moe.expert_mlp_dim = 2, 32
    cfg.mesh.data, cfg.mesh.expert, cfg.mesh.tensor = 2, 2, 2
    cfg.train.steps, cfg.train.log_every, cfg.train.progress = 2, 1, False
    cfg.checkpoint.every = 0
    r = cfg.rl
    r.env, r.domains, r.max_turns, r.tool_timeout_s = "tool", "repo_fix", 2, 2.0
    r.prompts_per_step, r.group_size, r.max_new_tokens, r.eval_every, r.eval_size, r.eval_samples = 2, 2, 16, 2, 2, 2
    r.invalid_tool_call_penalty, r.verifier_workers = 0.1, 2
    r.update(rl)
    return typed(cfg)


def test_loop_trains_on_the_repo_fix_domain_end_to_end(tmp_path, monkeypatch):
    cohorts = []  # rl.episode_cohorts reaches the episodes of training and of the held-out eval
    monkeypatch.setattr(
        rlvr_parts, "rollout_episodes", lambda *a, **kw: cohorts.append(kw["cohorts"]) or rollout_episodes(*a, **kw)
    )
    result = loop.run(tool_cfg(tmp_path, episode_cohorts=2))
    assert cohorts and set(cohorts) == {2}
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "rl/reward_mean" in r]
    assert len(train) == 2 and all(np.isfinite(r["loss"]) for r in train)
    for key in (
        "rl/tool_success_rate",
        "rl/turns_per_episode",
        "rl/calls_per_turn",
        "rl/env_s",
        "rl/model_s",
        "rl/env_frac",
        "rl/tool_call_ok_rate",
        "rl/episodes_s",
    ):
        assert key in train[0], key
    assert 1 <= train[0]["rl/turns_per_episode"] <= 2
    assert {"eval/tool_success_rate", "eval/turns_per_episode"} <= result.eval.keys()


SINGLE = dict(env="single", max_turns=4, tool_timeout_s=5.0, invalid_tool_call_penalty=0.0)  # the defaults


@pytest.mark.parametrize(
    "rl, match",
    [
        (dict(env="shell"), "rl.env='shell'"),
        ({**SINGLE, "domains": "arithmetic", "max_turns": 3}, "rl.max_turns=3 cannot take effect"),
        ({**SINGLE, "domains": "arithmetic", "redundant_tool_call_penalty": 0.5}, "rl.redundant_tool_call_penalty=0.5"),
        (SINGLE, "repo_fix is an agent domain"),
        (dict(max_turns=0), "rl.max_turns=0"),
    ],
)
def test_tool_env_keys_take_effect_or_raise(tmp_path, rl, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        loop.run(tool_cfg(tmp_path, **rl))


def test_tool_keys_reach_the_environment_and_the_reward(tmp_path, sandbox):
    from posttrain.rl.tasks.registry import make_env_factory, make_reward_fn

    cfg = tool_cfg(tmp_path, max_turns=3, tool_timeout_s=1.5, redundant_tool_call_penalty=0.2, overlong_buffer=8)
    reward_fn = make_reward_fn(cfg.rl)
    env = make_env_factory(cfg.rl, TOK, reward_fn)()
    assert (env.max_turns, env.limits.wall_s, env.max_turn_tokens) == (3, 1.5, 16)
    c = reward_fn.config
    assert (c.invalid_tool_call_penalty, c.redundant_tool_call_penalty, c.max_tokens) == (0.1, 0.2, 3 * 16)
    # The same env answers non-repository tasks too: a math answer after a Python call.
    env = WorkspaceEnv(TOK, RewardFunction({MathTask: MathVerifier()}), sandbox, limits=LIMITS)
    task = Task("m", ({"role": "user", "content": "6*7?"},), MathTask("42"))
    traj = run_episode(env, task, scripted("<tool>python\nprint(6*7)\n</tool>", "\\boxed{42}"))
    assert traj.reward.score == 1.0 and "<output>\n42\n</output>" in TOK.decode(traj.tokens)


def test_session_does_not_trust_a_report_forged_by_the_command(sandbox):
    s = Session(sandbox, {"a.txt": "keep\n"})
    forged = '{"exit": 0, "output": "", "dropped": 0, "skipped": [], "files": [["../../etc/x", "aGk=", 420]]}'
    # Into the driver's own report: denied where /proc/PID/fd of the parent is closed to the program,
    # refused by the host's check where it is not; either way the state stays.
    r = s.run("sh", f"printf '%s' '{forged}' > /proc/$PPID/fd/1")
    assert r.status in (Status.FAIL, Status.CRASH) and s.snapshot().as_dict() == {"a.txt": b"keep\n"}
    assert s.run("sh", "cat a.txt").output == b"keep\n"  # the session goes on
    assert _parse_report(forged.encode()) is None  # a path outside the directory is refused
    assert _parse_report(b"[" * 5000 + forged.encode()) is None  # so is JSON nested past the recursion limit
    for name in ("b\\u0000x", "b/" + "x" * 256):  # and names no file has (they would crash the next call's staging)
        assert _parse_report(forged.replace("../../etc/x", name).encode()) is None
    assert _parse_report(forged.replace("../../etc/x", "b/x").encode())[1].as_dict() == {"b/x": b"hi"}


def test_agent_demos_tool_writes_to_a_store_url(monkeypatch, capsys):
    """tools/agent_demos.py --out takes gs:// (here memory://) paths, through posttrain.storage."""
    import runpy
    import sys

    from posttrain import storage

    tool = ROOT / "tools" / "agent_demos.py"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "agent_demos.py",
            "--out",
            "memory:///demos/sft.jsonl",
            "--n",
            "1",
            "--workers",
            "1",
            "--copy_drills",
            "2",
            "--extract_frac",
            "1",
        ],
    )
    runpy.run_path(str(tool), run_name="__main__")
    records = [json.loads(line) for line in storage.read_text("memory:///demos/sft.jsonl").splitlines()]
    assert len(records) == 3 and records[0]["messages"][-1]["content"] == "Done."
    assert records[0]["fix"] == "extract" and records[0]["messages"][4]["content"].startswith("<tool>sh\nsed ")
    assert records[1:] == repo_domain.copy_drills(2, seed=1)
    assert "1/1 demonstrations passed their final check (1 fix with sed), 2 copy drills" in capsys.readouterr().out
