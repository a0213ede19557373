"""Run health alerts: each rule fires on a synthetic metrics stream built to trigger it and stays
silent on a normal one (pure, no model); one RLVR run with alerts.on=stop ends naming the rule."""

import json
import math

import numpy as np
import pytest

from posttrain.config import base_config
from posttrain.core.alerts import RULES, AlertMonitor, AlertStop
from posttrain.core.metrics import read_metrics
from posttrain.errors import UserError
from tests.support.typed_configs import TINY_DENSE


def normal_stream(n=40, seed=0):
    """Rows as the RL loop logs them: slowly improving reward, slowly falling entropy, steady
    lengths, clip fractions and throughput (the first row includes compilation)."""
    rng = np.random.default_rng(seed)
    for t in range(n):
        yield (
            t,
            {
                "loss": 1.0 - 0.01 * t,
                "rl/reward_mean": 0.2 + 0.01 * t + 0.03 * rng.standard_normal(),
                "rl/entropy": 1.2 - 0.005 * t,
                "rl/kl": 0.01 + 0.001 * t,
                "rl/response_len_mean": 20.0 + rng.standard_normal(),
                "rl/clip_frac_low": 0.02,
                "rl/clip_frac_high": 0.03,
                "rl/verifier_errors": 0,
                "rl/responses": 64,
                "tokens_per_s": (50.0 if t == 0 else 1000.0 + 30 * rng.standard_normal()),
            },
        )


# rule -> how step 25 of a normal stream is changed to trigger it
TRIGGERS = {
    "reward_drift": lambda m: {**m, "rl/reward_mean": m["rl/reward_mean"] + 0.8},
    "entropy_collapse": lambda m: {**m, "rl/entropy": 0.001},
    "kl_blowup": lambda m: {**m, "rl/kl": 5.0},
    "response_len_explosion": lambda m: {**m, "rl/response_len_mean": 90.0},
    "clip_saturation": lambda m: {**m, "rl/clip_frac_low": 0.3, "rl/clip_frac_high": 0.4},
    "verifier_error_rate": lambda m: {**m, "rl/verifier_errors": 20},
    "throughput_stall": lambda m: {**m, "tokens_per_s": 40.0},
    "nonfinite": lambda m: {**m, "loss": float("nan")},
}


def monitor(**kw):
    return AlertMonitor.from_config(_cfg(**kw).alerts)


def _cfg(**kw):
    cfg = base_config()
    cfg.alerts.update(kw)
    return cfg


def test_every_rule_has_a_trigger():
    assert set(TRIGGERS) == set(RULES) | {"nonfinite"}


def test_normal_stream_is_silent():
    m = monitor()
    assert [a for t, row in normal_stream() for a in m.update(t, row)] == []


@pytest.mark.parametrize("rule", sorted(TRIGGERS))
def test_rule_fires_on_its_trigger_only(rule):
    m = monitor()
    fired = []
    last = 26 if rule == "throughput_stall" else 25  # a stall must last two rows
    for t, row in normal_stream():
        fired += m.update(t, TRIGGERS[rule](row) if 25 <= t <= last else row)
    assert [(a.rule, a.step) for a in fired] == [(rule, last)], fired
    assert fired[0].message


def test_one_slow_interval_is_not_a_stall():
    m = monitor()
    assert not [
        a
        for t, row in normal_stream()
        for a in m.update(t, TRIGGERS["throughput_stall"](row) if t in (25, 27) else row)
    ]


@pytest.mark.parametrize("rule", sorted(RULES))
def test_zero_threshold_turns_a_rule_off(rule):
    m = monitor(**{rule: 0.0})
    assert not [a for t, row in normal_stream() for a in m.update(t, TRIGGERS[rule](row) if 25 <= t <= 26 else row)]


def test_nonfinite_switch_and_off_mode():
    stream = lambda: ((t, TRIGGERS["nonfinite"](row) if t == 25 else row) for t, row in normal_stream())
    assert not [a for t, row in stream() for a in monitor(nonfinite=False).update(t, row)]
    assert [a.rule for t, row in stream() for a in monitor().update(t, row)] == ["nonfinite"]
    everything = lambda: ((t, {**row, "rl/kl": 9.0}) for t, row in normal_stream())
    assert not [a for t, row in everything() for a in monitor(on="off").update(t, row)]


def test_drift_rules_need_warmup():
    """A jump in the first rows has no running statistics to drift from."""
    m = monitor()
    rows = [row for _, row in normal_stream()]
    assert not m.update(0, rows[0]) and not m.update(1, {**rows[1], "rl/reward_mean": 5.0})


def test_bad_settings_are_errors_at_start_up(tmp_path):
    with pytest.raises(ValueError, match="alerts.on='loud'"):
        monitor(on="loud")
    with pytest.raises(ValueError, match="alerts.kl_blowup=-1.0"):
        monitor(kl_blowup=-1.0)
    from posttrain.main import run

    cfg = sft_config(tmp_path / "run", on="loud")
    with pytest.raises(UserError, match="alerts.on='loud'"):
        run(cfg)
    assert not (tmp_path / "run" / "config.json").exists()


class FakeBar:
    postfix = "reward=0.1"

    def set_postfix_str(self, s):
        self.postfix = s


class FakeWriter:
    def __init__(self):
        self.events = []

    def event(self, step, kind, **fields):
        self.events.append((step, kind, fields))


def test_check_reports_on_writer_and_bar_and_stop_raises():
    m, bar, writer = monitor(), FakeBar(), FakeWriter()
    m.check(3, {"rl/kl": 2.0}, writer, bar)
    assert writer.events == [
        (3, "alert", {"rule": "kl_blowup", "value": 2.0, "threshold": 1.0, "message": "2 > alerts.kl_blowup=1"})
    ]
    assert bar.postfix == "reward=0.1, alert=kl_blowup"
    with pytest.raises(AlertStop, match="kl_blowup"):
        monitor(on="stop").check(3, {"rl/kl": 2.0})


def sft_config(workdir, **alerts):
    """A tiny SFT run on generated arithmetic conversations."""
    cfg = base_config()
    cfg.stage, cfg.workdir = "sft", str(workdir)
    m = cfg.model
    m.update(TINY_DENSE)
    cfg.data.synthetic, cfg.data.synthetic_size = "arithmetic", 64
    cfg.sft.train_files = "synthetic:"
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len, cfg.train.log_every = 4, 8, 64, 1
    cfg.train.progress, cfg.checkpoint.every = False, 0
    cfg.alerts.update(alerts)
    return cfg


def test_sft_run_with_a_diverging_learning_rate_stops_naming_the_rule(tmp_path):
    """optim.lr = 1e30: the first update makes the weights overflow, the next row's loss is not finite."""
    from posttrain.main import run

    cfg = sft_config(tmp_path, on="stop")
    cfg.optim.lr, cfg.optim.warmup_steps = 1e30, 0
    with pytest.raises(SystemExit, match="nonfinite"):
        run(cfg)
    rows = read_metrics(str(tmp_path))  # strict JSON: non-finite values come back as NaN
    assert [r["step"] for r in rows] == [0, 1, 1]  # stopped at the first non-finite row
    assert rows[2]["event"] == "alert" and rows[2]["rule"] == "nonfinite"
    bad = [k for k, v in rows[1].items() if isinstance(v, float) and not math.isfinite(v)]
    assert bad and rows[2]["message"] == f"non-finite metrics: {', '.join(sorted(bad))}"
    assert all(math.isfinite(v) for k, v in rows[0].items() if isinstance(v, float))


@pytest.mark.slow
def test_rlvr_run_stops_on_an_alert_naming_the_rule(tmp_path):
    cfg = base_config()
    cfg.stage, cfg.workdir = "rlvr", str(tmp_path)
    m = cfg.model
    m.update(TINY_DENSE)
    cfg.train.steps, cfg.train.log_every, cfg.train.progress = 3, 1, False
    cfg.checkpoint.every = 0
    r = cfg.rl
    r.prompts_per_step, r.group_size, r.max_new_tokens, r.eval_every = 2, 4, 8, 0
    r.arithmetic_size, r.verifier_workers = 20, 2
    cfg.alerts.on, cfg.alerts.entropy_collapse = "stop", 100.0  # a random policy's entropy is ~5.6 nats
    from posttrain.main import run

    with pytest.raises(SystemExit, match="entropy_collapse"):
        run(cfg)
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 0]  # stopped after the first logged step
    assert rows[1]["event"] == "alert" and rows[1]["rule"] == "entropy_collapse"
    assert rows[1]["value"] == pytest.approx(rows[0]["rl/entropy"]) and math.isfinite(rows[1]["value"])


def test_an_alert_on_a_bar_that_shows_nothing_yet_is_shown():
    """A row without rl/reward_mean (a skipped RL update) leaves the bar without a postfix: the
    alert used to crash reading `bar.postfix`."""
    from tqdm import tqdm

    bar = tqdm(total=1, disable=True)
    alerts = monitor().check(0, {"rl/verifier_errors": 8, "rl/responses": 8}, bar=bar)
    assert [a.rule for a in alerts] == ["verifier_error_rate"]
