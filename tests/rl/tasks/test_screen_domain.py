"""`rl.eval_size` against the held-out tasks there are (issue 29): beyond the screen domain's distinct
held-out meanings it is refused, naming the key and the real count, never filled with repeats; a
data set smaller than asked is evaluated whole with a warning of its size (pure Python, no JAX)."""

import pytest

from posttrain.rl.tasks import screen_domain
from posttrain.rl.tasks.registry import DOMAINS
from posttrain.rl.tasks.screen_domain import KINDS, held_out_counts, max_held_out, screen_key, screen_tasks
from tests.support.typed_configs import run_cfg


def test_enumerated_meanings_are_what_the_generator_draws():
    """`held_out_counts` enumerates the meanings `_screen` draws: every drawn task's key is among
    them, in its split, and each kind's whole held-out set can be drawn (and no more)."""
    counts = held_out_counts()
    assert counts == {"select": 53, "marked": 72, "type": 18}
    for kind in KINDS:
        meanings = set(screen_domain._meanings(kind))
        test = screen_tasks(counts[kind], 3, "test", kinds=(kind,))
        assert len({screen_key(t.target) for t in test}) == counts[kind]
        for t in test + screen_tasks(60, 3, "train", kinds=(kind,)):
            assert screen_key(t.target) in meanings
        with pytest.raises(ValueError, match=f"{counts[kind]} {kind} .*at most {counts[kind]}\\)"):
            screen_tasks(counts[kind] + 1, 3, "test", kinds=(kind,))
    assert max_held_out() == 3 * counts["type"] + 2  # kinds in turn: type (third) runs out first


def test_more_held_out_screens_than_exist_are_refused_not_repeated():
    most = max_held_out()
    tasks = screen_tasks(most, 0, "test")
    assert len({screen_key(t.target) for t in tasks}) == most  # every held-out task counts once
    with pytest.raises(ValueError, match=rf"{most + 1} distinct held-out screen tasks.*18 type.*at most {most}"):
        screen_tasks(most + 1, 0, "test")
    assert len(screen_tasks(most + 50, 0, "train")) == most + 50  # training draws may repeat meanings


def test_rl_eval_size_beyond_the_held_out_screens_names_the_key():
    cfg = run_cfg({"rl.env": "screen", "rl.domains": "screen"})
    assert cfg.rl.eval_size == 128 and cfg.rl.eval_every > 0  # the defaults ask for more than exist
    with pytest.raises(ValueError, match=rf"rl.eval_size=128: .*only {max_held_out()} distinct held-out.*18 type"):
        DOMAINS["screen"](cfg, lambda: None)
    cfg = cfg.replace({"rl.eval_size": max_held_out()})
    _, held_out = DOMAINS["screen"](cfg, lambda: None)
    assert len({screen_key(t.target) for t in held_out}) == max_held_out()
    cfg = cfg.replace({"rl.eval_size": 128, "rl.eval_every": 0})  # nothing evaluates: none drawn, nothing refused
    domain, held_out = DOMAINS["screen"](cfg, lambda: None)
    assert held_out == [] and domain.tasks


def test_a_domain_with_fewer_held_out_tasks_than_asked_says_so(caplog):
    """A data set smaller than rl.eval_size (humaneval has 164 problems) is evaluated on what it
    has, with a warning naming the real count."""
    from posttrain.data.tokenizer import ByteTokenizer
    from posttrain.rl.envs.base import Task
    from posttrain.rl.tasks.domains import Domain
    from posttrain.rl.tasks.registry import make_domains, make_reward_fn

    tasks = [Task(f"t{i}", ({"role": "user", "content": f"{i}+1?"},), None) for i in range(3)]
    DOMAINS.register("tiny_set", lambda cfg, env: (Domain("tiny_set", tasks, env), tasks[: cfg.rl.eval_size]))
    try:
        cfg = run_cfg({"rl.domains": "tiny_set"})
        with caplog.at_level("WARNING"):
            _, held_out = make_domains(cfg, ByteTokenizer(), make_reward_fn(cfg.rl))
    finally:
        DOMAINS.unregister("tiny_set")
    assert len(held_out) == 3
    assert "rl.eval_size=128: domain tiny_set has only 3 held-out tasks" in caplog.text
