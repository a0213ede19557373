"""The user's own RL tasks (issue 16 item 1): JSONL task files with a user-written verifier train end to
end; bad records give `file:line` errors or counted skips; held-out files never overlap training;
a verifier that raises or hangs is contained and counted."""

from __future__ import annotations

import json
import sys
import textwrap
import time

import pytest

from posttrain.config import RLConfig
from posttrain.data.sources import DataError
from posttrain.data.tokenizer import ByteTokenizer
from posttrain.rl.checks import check_rlvr_stage
from posttrain.rl.envs.base import Task
from posttrain.rl.tasks.registry import make_domains, make_reward_fn
from posttrain.rl.verifiers.code import CodeTask
from posttrain.rl.verifiers.math import MathTask
from posttrain.rl.verifiers.user import UserTask, UserVerifier
from posttrain.stages import rlvr as loop
from tests.support.rl_runs import rows, tiny
from tests.support.typed_configs import rl, run_cfg, typed

VERIFIER_MODULE = '''
import threading, time, zlib

calls = []
_lock = threading.Lock()

def fate(prompt, response):
    """1: the call raises, 2: it hangs, else it scores. Keyed by the sample, not by the call's arrival
    order: episodes are verified on a thread pool, so arrival order is a race."""
    return zlib.crc32((prompt + response).encode()) % 6

def score(prompt, response, record):
    """A sixth of the samples make it raise, another sixth hang; the others pay for the keyword."""
    with _lock:
        calls.append((prompt, response, dict(record)))
    if fate(prompt, response) == 1:
        raise RuntimeError("the user's verifier crashed")
    if fate(prompt, response) == 2:
        time.sleep(3)
    return float(record["keyword"] in response), {"length": float(len(response))}

def shout(prompt, response, record):
    return 1.0
'''


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user package on sys.path, as a user's own code would be (a fresh name per test)."""
    name = f"myrewards_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(VERIFIER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def user_records(n, **extra):
    return [
        {
            "prompt": f"Say a word with the letter {c}.",
            "keyword": c,
            "verifier": "score",
            "difficulty": "easy" if i % 2 else "hard",
            **extra,
        }
        for i, c in enumerate("abcdefghij"[:n])
    ]


def test_user_task_file_with_user_verifier_trains_end_to_end(tmp_path, user_module, caplog):
    train = write_jsonl(
        tmp_path / "train.jsonl",
        user_records(6)
        + [
            "{not json",  # bad: skipped, counted
            {"prompt": "no way to verify this"},  # bad: skipped, counted
        ],
    )
    cfg = tiny(
        tmp_path / "run",
        train_files=train,
        verifiers=f"{user_module}:score",
        verifier_timeout_s=0.5,
        max_new_tokens=96,  # an untrained policy ends a turn (byte 2) rarely: room for it to
        rollouts_every=2,
        rollouts_fraction=0.5,
    )
    cfg.data.on_error, cfg.rl.arithmetic_size = "skip", RLConfig().arithmetic_size
    cfg.rl.curriculum.retire_above, cfg.rl.curriculum.retire_after = 0.0, 4  # every task retires after one group
    cfg.model.moe.num_experts, cfg.mesh.data, cfg.mesh.expert, cfg.mesh.tensor = 0, -1, 1, 1  # dense: compiles faster
    t0 = time.perf_counter()
    loop.run(typed(cfg))
    all_rows = rows(tmp_path / "run")
    rs = [r for r in all_rows if "event" not in r]
    calls = sys.modules[user_module].calls
    assert [r["step"] for r in rs] == [0, 1, 2]
    # the contained verifier failures are an alert (rl.verifier_errors over alerts.verifier_error_rate)
    assert any(r.get("rule") == "verifier_error_rate" for r in all_rows if "event" in r)
    # The untrained policy rarely ends a turn (a truncated turn scores 0 without a verifier call), but the
    # run is deterministic for its seed: it calls the verifier, which raised on some samples and hung on others.
    fates = [sys.modules[user_module].fate(p, r) for p, r, _ in calls]
    assert 1 in fates and 2 in fates
    prompt, _, record = calls[0]
    assert prompt.startswith("Say a word with the letter") and record["verifier"] == "score"
    assert sum(r["rl/verifier_errors"] for r in rs) == sum(f in (1, 2) for f in fates)
    assert time.perf_counter() - t0 < 120  # hung calls did not block the run
    # samples without a verdict (the verifier raised or hung) leave the scheduler's counts alone
    samples = 3 * 2 * 4 - sum(r["rl/verifier_errors"] for r in rs)  # steps × prompts × group size
    assert rs[-1]["tasks/user/samples"] == samples
    assert rs[-1]["tasks/user/difficulty/easy/samples"] + rs[-1]["tasks/user/difficulty/hard/samples"] == samples
    # The curriculum from the config reaches the loop's scheduler: each task drawn retired after its group
    # (one whose group lost samples to verifier errors has too few verdicts to retire: another band).
    bands = {b: rs[-1][f"tasks/user/band_{b}"] for b in ("new", "hard", "medium", "easy", "retired")}
    assert sum(bands.values()) == 6 and bands["retired"] >= 1, bands
    assert rs[0]["tasks/user/band_retired"] >= 1 and rs[-1]["tasks/user/exhausted_draws"] == 0
    # Trajectories kept: steps 0 and 2, half of each step's 8 samples, strict JSON with every field.
    files = sorted((tmp_path / "run" / "rollouts").glob("*.jsonl"))
    assert [f.name for f in files] == ["0000000.jsonl", "0000002.jsonl"]
    kept = [json.loads(line, parse_constant=pytest.fail) for f in files for line in f.read_text().splitlines()]
    assert len(kept) == 2 * 4
    assert set(kept[0]) == {
        "step",
        "policy_version",
        "domain",
        "task_id",
        "difficulty",
        "sample",
        "prompt",
        "response",
        "reward",
        "parts",
        "verifier_parts",
        "error",
        "truncated",
        "turns",
        "num_tokens",
    }
    assert [k["step"] for k in kept] == [0] * 4 + [2] * 4 and [k["policy_version"] for k in kept] == [0] * 4 + [2] * 4
    assert all("Say a word with the letter" in k["prompt"] and k["domain"] == "user" for k in kept)
    assert all(k["reward"] == pytest.approx(sum(k["parts"].values())) for k in kept)
    assert "skipped 2 bad task records" in caplog.text
    assert "train.jsonl:7" in caplog.text and "train.jsonl:8" in caplog.text


def test_user_verifier_contract_raising_hanging_and_bad_values_are_errors(user_module):
    import importlib

    mod = importlib.import_module(user_module)
    returns = iter([0.5, (1.0, {"x": 2}), 1.5, float("nan"), "yes", (0.2, {"x": "y"})])
    v = UserVerifier({"score": mod.score, "fixed": lambda p, r, rec: next(returns)}, timeout_s=0.2)
    task = lambda name: UserTask(name, "p", {"keyword": "a"})
    assert [mod.fate("p", r) for r in ("a", "ca", "aa")] == [1, 2, 0]  # the responses pick each fate
    crashed, hung, ok = v.verify(task("score"), "a"), v.verify(task("score"), "ca"), v.verify(task("score"), "aa")
    assert crashed.error == "verifier 'score' raised RuntimeError: the user's verifier crashed"
    assert hung.error == "verifier 'score' timed out after 0.2s" and v.abandoned == 1
    assert (ok.correct, ok.parts, ok.error) == (1.0, {"length": 2.0}, None)
    got = [v.verify(task("fixed"), "") for _ in range(6)]
    assert [g.correct for g in got[:2]] == [0.5, 1.0] and got[1].parts == {"x": 2.0}
    for g, why in zip(got[2:], ("outside [0, 1]", "finite number", "finite number", "parts")):
        assert g.correct == 0.0 and why in g.error, g.error
    assert "no verifier 'other'" in v.verify(task("other"), "").error


def test_records_of_each_kind_domains_and_bad_records(tmp_path, user_module):
    train_files = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"prompt": "What is 2+2?", "answer": 4, "domain": "math", "id": "m1", "difficulty": 1},
            {
                "prompt": [{"role": "user", "content": "Write add."}],
                "tests": ["assert add(1, 2) == 3"],
                "entry_point": "add",
                "domain": "code",
            },
            {"prompt": "Shout.", "verifier": "shout"},
        ],
    )
    cfg = run_cfg({"rl.train_files": train_files, "rl.verifiers": f"{user_module}:shout", "rl.eval_every": 0})
    domains, held_out = make_domains(cfg, ByteTokenizer(), make_reward_fn(cfg.rl))
    assert sorted(domains) == ["code", "math", "user"] and held_out == []
    (math,) = domains["math"].tasks
    assert (math.id, math.target, math.difficulty) == ("m1", MathTask("4"), "1")
    (code,) = domains["code"].tasks
    assert code.target == CodeTask(test="assert add(1, 2) == 3", entry_point="add") and code.id.endswith("t.jsonl:2")
    assert isinstance(domains["user"].tasks[0].target, UserTask)

    for bad, message in [
        ({"prompt": "x", "verifier": "nope"}, "bad.jsonl:1: field 'verifier': no verifier 'nope'"),
        ({"prompt": "x", "tests": "assert f()"}, "bad.jsonl:1: missing field 'entry_point'"),
        ({"answer": 3}, "bad.jsonl:1: missing field 'prompt'"),
        ({"prompt": "x", "answer": [3]}, "bad.jsonl:1: field 'answer': expected a string or a number"),
        ({"prompt": "x", "answer": 3, "domain": {"a": 1}}, "bad.jsonl:1: field 'domain'"),
    ]:
        cfg = cfg.replace({"rl.train_files": write_jsonl(tmp_path / "bad.jsonl", [bad])})
        with pytest.raises(DataError, match=message):
            make_domains(cfg, ByteTokenizer(), None)
    dup = write_jsonl(
        tmp_path / "dup.jsonl", [{"prompt": "a", "answer": 1, "id": "x"}, {"prompt": "b", "answer": 2, "id": "x"}]
    )
    cfg = cfg.replace({"rl.train_files": dup})
    with pytest.raises(DataError, match="dup.jsonl:2: task id 'x' of domain 'user' is also at .*dup.jsonl:1"):
        make_domains(cfg, ByteTokenizer(), None)
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "a", "answer": 1}])
    cfg = cfg.replace({"rl.train_files": ok, "rl.verifiers": f"{user_module}:score"})  # named but used by no record
    with pytest.raises(ValueError, match=r"rl.verifiers: \['score'\] verify no record"):
        make_domains(cfg, ByteTokenizer(), None)


def test_eval_files_equivalent_to_training_prompts_are_dropped_and_counted(tmp_path, caplog):
    """Held out by meaning (issue 25 item 4): an evaluation record whose prompt is a training prompt
    in another spelling (case, spaces, unicode, commuted operands) is dropped and counted, whatever
    data.on_error says; the rest stay, in order."""
    train_files = write_jsonl(
        tmp_path / "train.jsonl", [{"prompt": f"What is {i}+1?", "answer": i + 1} for i in range(4)]
    )
    evals = [
        {"prompt": "what is 2+1?  ", "answer": 3},  # case and spaces
        {"prompt": "What is 1 + 3 ?", "answer": 4},  # commuted, spaced
        {"prompt": "WHAT IS ０＋１?", "answer": 1},  # full-width
        {"prompt": "What is 9+1?", "answer": 10},
        {"prompt": "What is 1-2?", "answer": -1},  # 2-1 is not 1-2
    ]
    cfg = run_cfg({"rl.train_files": train_files, "rl.eval_files": write_jsonl(tmp_path / "eval.jsonl", evals)})
    with caplog.at_level("WARNING"):
        domains, held_out = make_domains(cfg, ByteTokenizer(), None)
    assert [t.prompt[0]["content"] for _, t in held_out] == ["What is 9+1?", "What is 1-2?"]
    assert [d for d, _ in held_out] == ["user", "user"] and len(domains["user"].tasks) == 4
    assert "dropped 3 held-out tasks" in caplog.text and "eval.jsonl:1 (= " in caplog.text
    assert "train.jsonl:3" in caplog.text
    cfg = cfg.replace({"rl.eval_files": write_jsonl(tmp_path / "eval2.jsonl", evals[:3])})
    with pytest.raises(ValueError, match=r"eval2.jsonl': no usable task record \(3 were training prompts"):
        make_domains(cfg, ByteTokenizer(), None)
    cfg = cfg.replace({"rl.eval_files": ""})
    with pytest.raises(ValueError, match="no held-out tasks: set rl.eval_files"):
        make_domains(cfg, ByteTokenizer(), None)


def test_new_keys_that_cannot_take_effect_are_errors(tmp_path):
    def rlvr(changes):
        check_rlvr_stage(run_cfg(changes, stage="rlvr"))

    with pytest.raises(ValueError, match="rl.verifier_timeout_s=5.0 cannot take effect"):
        rlvr({"rl.verifier_timeout_s": 5.0})
    with pytest.raises(ValueError, match="rl.eval_files='x.jsonl' cannot take effect"):
        rlvr({"rl.eval_files": "x.jsonl", "rl.eval_every": 0})
    with pytest.raises(ValueError, match="rl.rollouts_fraction=0.5 cannot take effect"):
        rlvr({"rl.rollouts_fraction": 0.5})
    with pytest.raises(ValueError, match=r"rl.rollouts_fraction=1.5: expected > 0 and <= 1"):
        rlvr({"rl.rollouts_every": 1, "rl.rollouts_fraction": 1.5})
    with pytest.raises(ValueError, match="cannot import 'no_such_module_here'"):
        make_reward_fn(rl(verifiers="no_such_module_here:score"))


def test_rollout_log_samples_by_seed_and_step_and_writes_strict_json(tmp_path):
    from posttrain.rl.envs.base import Trajectory
    from posttrain.rl.reward import Reward
    from posttrain.rl.rollout.buffer import Rollout
    from posttrain.rl.rollout.log import RolloutLog
    from posttrain.rl.tasks.scheduler import Group

    tok = ByteTokenizer()
    trajs = [
        Trajectory(
            "t",
            [104, 105, 33 + i],
            [False, False, True],
            2,
            reward=Reward(
                float("nan") if i == 0 else 1.0,
                {"correct": float("nan") if i == 0 else 1.0},
                verifier_parts={"x": float("inf")},
            ),
        )
        for i in range(10)
    ]
    ro = Rollout(
        Group("d", Task("t", (), None, difficulty="easy"), [float("nan")] + [1.0] * 9, trajs), 7, [[0.0] * 3] * 10
    )
    log = RolloutLog(str(tmp_path), tok, every=3, fraction=0.3, seed=0)
    assert log.write(1, [ro]) is None and log.write(0, [ro]) is not None
    kept = [json.loads(line) for line in (tmp_path / "rollouts" / "0000000.jsonl").read_text().splitlines()]
    assert len(kept) == 3 and kept == log.records(0, [ro]) and log.records(3, [ro]) != kept
    assert {k["policy_version"] for k in kept} == {7} and kept[0]["prompt"] == tok.decode([104, 105])
    assert all(k["verifier_parts"] == {"x": None} for k in kept)
    everything = RolloutLog(str(tmp_path), tok, every=1, fraction=1.0, seed=0).records(0, [ro])
    assert everything[0]["reward"] is None and everything[0]["parts"] == {"correct": None}


def test_record_kinds_are_scored_by_their_verifiers(tmp_path, user_module):
    """A math record by the math verifier, a code record in the sandbox (CodeVerifier), a user record by
    the user's function with its named parts."""
    train_files = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"prompt": "What is 2+2?", "answer": 4},
            {
                "prompt": "Write add(a, b).",
                "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"],
                "entry_point": "add",
                "domain": "code",
            },
            {"prompt": "Shout.", "verifier": "score", "keyword": "a"},
        ],
    )
    cfg = run_cfg({"rl.train_files": train_files, "rl.verifiers": f"{user_module}:score", "rl.eval_every": 0})
    reward_fn = make_reward_fn(cfg.rl)
    domains, _ = make_domains(cfg, ByteTokenizer(), reward_fn)
    math, user = domains["user"].tasks
    (code,) = domains["code"].tasks
    assert reward_fn.verify(math.target, "so \\boxed{4}").score == 1.0
    assert reward_fn.verify(math.target, "so \\boxed{5}").score == 0.0
    good = reward_fn.verify(code.target, "```python\ndef add(a, b):\n    return a + b\n```")
    bad = reward_fn.verify(code.target, "```python\ndef add(a, b):\n    return a - b\n```")
    assert (good.score, good.error, bad.score) == (1.0, None, 0.0)
    reward_fn.verify(user.target, "x")  # call 1 raises, call 2 hangs (timeout 30 s):
    sys.modules[user_module].calls.append(None)  # skip the hang
    scored = reward_fn.verify(user.target, "banana")
    assert (scored.score, scored.verifier_parts, scored.error) == (1.0, {"length": 6.0}, None)
