"""RL with images (issue 29): episodes' images reach the sampler and the learner alike.

The rollout worker loads each episode's images (`env.images`) into patches for the sampler, the
trajectories carry them, and `rl_batch` lays them beside the tokens, so the learner's log-probs
of the sampled tokens are the sampler's behaviour log-probs, single-turn (rendered visual task
files) and multi-turn (screenshot episodes); without the patches they are not.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.data.tokenizer import load_tokenizer
from posttrain.models.decoder import Decoder
from posttrain.rl.algo.learner import learner_logprobs, rl_batch
from posttrain.rl.rollout.episodes import rollout_episodes
from posttrain.rl.rollout.worker import RolloutWorker
from posttrain.rl.tasks.registry import make_domains, make_reward_fn
from posttrain.sampling.rules import SamplingParams
from tests.support.paths import ROOT
from tests.support.typed_configs import run_cfg

sys.path.insert(0, str(ROOT / "tools"))
from visual_tasks import write_visual_tasks  # noqa: E402

TOK = load_tokenizer("byte")


def vision_rl_config(tmp_path, **rl):
    """A tiny vision model (16x16 images of 8x8 patches: 4 placeholder tokens each) and RL keys."""
    model = dict(vocab_size=264, embed_dim=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=32)
    vision = {"encoder": "linear", "image_size": 16, "patch_size": 8}
    return run_cfg(
        {
            **{f"model.{k}": v for k, v in model.items()},
            **{f"model.vision.{k}": v for k, v in vision.items()},
            "data.tokenizer": "byte",
            **{f"rl.{k}": v for k, v in {"max_new_tokens": 6, "group_size": 2, "temperature": 1.0, **rl}.items()},
        },
        workdir=str(tmp_path / "run"),
        stage="rlvr",
    )


@pytest.fixture(scope="module")
def visual_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("visual")
    write_visual_tasks(str(out), 12, 8, seed=1)
    return out


def _rollout_batch(cfg, num_tasks: int, episodes=None, **worker_kw) -> tuple[dict, nnx.Module]:
    domains, _ = make_domains(cfg, TOK, make_reward_fn(cfg.rl))
    model = Decoder(cfg.model, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    r = cfg.rl
    sampling = SamplingParams(
        temperature=r.temperature, max_new_tokens=r.max_new_tokens, stop_ids=tuple(TOK.stop_ids), num_samples=2
    )
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        worker = RolloutWorker(graphdef, domains, sampling, TOK.pad_id, pool, episodes=episodes, **worker_kw)
        tasks = [(d, t) for d, dom in domains.items() for t in dom.tasks[:num_tasks]]
        batch = worker.rollout(params, rest, tasks, jax.random.key(3))
    return rl_batch(batch.rollouts(0), pad_id=TOK.pad_id), model, sampling


def _check_logprobs_match_only_with_images(batch, model, sampling, images_per_row):
    assert "patches" in batch
    placeholders = batch["inputs"] == TOK.image_id
    assert (placeholders.sum(axis=1) >= 4 * images_per_row).all()
    assert (np.abs(batch["patches"]).sum(-1)[~placeholders] == 0).all()  # only at the placeholders
    mask = batch["loss_mask"].astype(bool)
    assert mask.sum() > 0

    def logp(b):
        return np.asarray(
            learner_logprobs(model, {k: jnp.asarray(v) for k, v in b.items()}, sampling, update_bias=False)[0]
        )

    np.testing.assert_allclose(logp(batch)[mask], batch["behav_logp"][mask], rtol=1e-5, atol=1e-5)
    blind = logp({k: v for k, v in batch.items() if k != "patches"})
    assert np.abs(blind[mask] - batch["behav_logp"][mask]).max() > 1e-3  # the images matter


def visual_task_config(tmp_path, visual_files):
    """RL on the visual task files (no built-in domain), evaluated every step."""
    return vision_rl_config(
        tmp_path,
        domains="",
        train_files=str(visual_files / "rl_train.jsonl"),
        eval_files=str(visual_files / "rl_eval.jsonl"),
        eval_every=1,
    )


def test_visual_task_rollouts_learner_logprobs_equal_the_samplers(tmp_path, visual_files):
    """Single-turn visual task files: the learner batch carries each prompt's image patches, and its
    log-probs equal the sampler's behaviour log-probs; without the patches they differ."""
    cfg = visual_task_config(tmp_path, visual_files)
    batch, model, sampling = _rollout_batch(cfg, 2)
    _check_logprobs_match_only_with_images(batch, model, sampling, 1)


def test_screen_episode_rollouts_learner_logprobs_equal_the_samplers(tmp_path):
    """Multi-turn screenshot episodes (rl.env=screen): every turn's context is sampled with the
    screens shown so far, and the learner sees the same screens at the same tokens."""
    cfg = vision_rl_config(tmp_path, env="screen", domains="screen", max_turns=2, max_new_tokens=8, eval_size=12)
    batch, model, sampling = _rollout_batch(cfg, 2, episodes=partial(rollout_episodes, cohorts=2))
    _check_logprobs_match_only_with_images(batch, model, sampling, 1)
    screens = os.listdir(tmp_path / "run" / "screens")
    assert screens and all(s.endswith(".png") for s in screens)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("sampling.speculative_k", 2, "sampling.speculative_k: model.vision.encoder='linear'"),
        ("rl.reward_model", "runs/rm", "rl.reward_model: model.vision.encoder='linear'"),
        ("rl.inflight_update_every", 4, "rl.inflight_update_every: model.vision.encoder='linear'"),
    ],
)
def test_what_images_cannot_go_with_is_refused_by_name(tmp_path, key, value, match):
    from posttrain.rl.checks import check_rlvr_stage

    cfg = vision_rl_config(tmp_path, domains="screen", env="screen", max_staleness=1).replace({key: value})
    with pytest.raises(ValueError, match=re.escape(match)):
        check_rlvr_stage(cfg)


def test_continuous_batching_and_the_prefix_cache_take_images(tmp_path, visual_files):
    """sampling.continuous_batching and sampling.prefix_cache pass the start-up checks with images;
    visual task rollouts through continuously refilled slots are the static sampler's, and
    screenshot episodes served from the prefix cache keep the learner's log-probs equal to the
    sampler's (each turn's context starts with the earlier turns' screens)."""
    from posttrain.rl.checks import check_rlvr_stage
    from posttrain.sampling.generate import SlotConfig
    from posttrain.sampling.prefix_cache import PrefixCache

    for key, value in (("continuous_batching", True), ("prefix_cache", 4096)):
        cfg = vision_rl_config(tmp_path, domains="screen", env="screen", max_staleness=1)
        check_rlvr_stage(cfg.replace({f"sampling.{key}": value}))
    cfg = visual_task_config(tmp_path, visual_files)
    static, _, _ = _rollout_batch(cfg, 2)
    batch, model, sampling = _rollout_batch(cfg, 2, continuous=SlotConfig(2, 1))
    np.testing.assert_array_equal(batch["inputs"], static["inputs"])
    np.testing.assert_allclose(batch["behav_logp"], static["behav_logp"], atol=1e-5)
    _check_logprobs_match_only_with_images(batch, model, sampling, 1)
    cfg = vision_rl_config(tmp_path, env="screen", domains="screen", max_turns=2, max_new_tokens=8, eval_size=12)
    cache = PrefixCache(4096)
    batch, model, sampling = _rollout_batch(cfg, 2, episodes=partial(rollout_episodes, cohorts=2), prefix_cache=cache)
    assert cache.stats.hits > 0, cache.stats
    _check_logprobs_match_only_with_images(batch, model, sampling, 1)


def test_screen_env_keys(tmp_path):
    """rl.env=screen takes the multi-turn keys (max_turns, cohorts, the invalid-turn penalty), not
    the sandbox's; the screen domain needs it."""
    from posttrain.rl.checks import check_rlvr_stage
    from posttrain.rl.tasks.registry import make_env_factory

    cfg = vision_rl_config(tmp_path, env="screen", domains="screen", max_turns=3, invalid_tool_call_penalty=0.2)
    check_rlvr_stage(cfg)
    env = make_env_factory(cfg.rl, TOK, make_reward_fn(cfg.rl))()
    assert env.max_turns == 3 and env.max_turn_tokens == 6
    cfg = cfg.replace({"rl.tool_timeout_s": 3.0})
    with pytest.raises(ValueError, match=r"rl\.tool_timeout_s=3\.0 cannot take effect"):
        check_rlvr_stage(cfg)
    cfg = vision_rl_config(tmp_path, domains="screen")
    with pytest.raises(ValueError, match=r"needs rl\.env='screen'"):
        make_domains(cfg, TOK, make_reward_fn(cfg.rl))


def _rows(path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # ~1 CPU-minute; the default suite covers SFT with images (tests/models/test_vision.py) and RL
# rollouts with images whose learner log-probs equal the sampler's (test_visual_task_rollouts_...)
def test_vision_tiny_pipeline_smoke(tmp_path, visual_files, monkeypatch):
    """configs/vision_tiny.py end to end, a few steps on small task files: SFT on image records,
    then RLVR on image task files whose learner log-probs are the sampler's (rl/behav_gap_max ≈ 0:
    the learner sees the images the sampler saw), with held-out accuracy before and after RL."""
    import runpy

    from posttrain import main

    cfg = runpy.run_path(str(ROOT / "configs" / "vision_tiny.py"))["get_config"]()
    for section, name, file in (("sft", "train_files", "sft_train"), ("sft", "eval_files", "sft_eval")):
        cfg[section][name] = str(visual_files / f"{file}.jsonl")
    cfg.rl.train_files, cfg.rl.eval_files = str(visual_files / "rl_train.jsonl"), str(visual_files / "rl_eval.jsonl")
    cfg.workdir = str(tmp_path / "run")
    cfg.sft.steps, cfg.train.batch_size, cfg.train.eval_every, cfg.train.log_every = 3, 8, 3, 1
    cfg.model.num_layers, cfg.model.embed_dim, cfg.model.mlp_dim = 1, 32, 64
    cfg.rl.steps, cfg.rl.eval_every, cfg.rl.eval_size, cfg.rl.eval_samples = 2, 2, 4, 2
    cfg.rl.prompts_per_step, cfg.rl.group_size, cfg.rl.max_new_tokens = 2, 4, 6
    main.run(cfg)
    rows = _rows(tmp_path / "run" / "1_rlvr" / "metrics.jsonl")
    gaps = [r["rl/behav_gap_max"] for r in rows if "rl/behav_gap_max" in r]
    assert len(gaps) == 2 and max(gaps) < 1e-4, gaps
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert len(evals) == 2  # before RL (after SFT) and after


@pytest.mark.slow  # ~1 CPU-minute; the default suite runs screen episodes in test_screen_episode_rollouts_...
def test_screen_rlvr_runs_end_to_end(tmp_path):
    """rl.env=screen: a 2-step RLVR run of screenshot episodes with a tiny vision model; the
    learner's log-probs are the sampler's over multi-turn contexts with screens."""
    from posttrain import main

    cfg = vision_rl_config(tmp_path, env="screen", domains="screen", max_turns=2, max_new_tokens=8, eval_size=4)
    rl = {"steps": 2, "prompts_per_step": 2, "group_size": 2, "eval_every": 2, "eval_samples": 2}
    cfg = cfg.replace({**{f"rl.{k}": v for k, v in rl.items()}, "train.log_every": 1, "train.seq_len": 128})
    main.run(cfg)
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    gaps = [r["rl/behav_gap_max"] for r in rows if "rl/behav_gap_max" in r]
    assert len(gaps) == 2 and max(gaps) < 1e-4, gaps
    assert all("rl/turns_per_episode" in r for r in rows if "rl/behav_gap_max" in r)
    assert len([r for r in rows if "eval/tool_success_rate" in r]) == 2


@pytest.mark.slow  # ~1 CPU-minute; the default suite runs screen episodes in test_screen_episode_rollouts_...
def test_screen_tiny_pipeline_smoke(tmp_path):
    """configs/screen_tiny.py end to end, a few steps: SFT on sloppy screen demonstrations
    (tools/screen_demos.py --by named --error-rate), then GRPO on screen episodes whose learner
    log-probs are the sampler's, with greedy held-out success per kind before and after RL."""
    import runpy

    from screen_demos import write_screen_demos

    from posttrain import main

    demos = tmp_path / "demos"
    write_screen_demos(str(demos), 12, 3, by="named", error_rate=0.6)
    cfg = runpy.run_path(str(ROOT / "configs" / "screen_tiny.py"))["get_config"]()
    cfg.sft.train_files, cfg.sft.eval_files = (
        str(demos / "screen_sft_train.jsonl"),
        str(demos / "screen_sft_eval.jsonl"),
    )
    cfg.workdir, cfg.init_from = str(tmp_path / "run"), ""  # from scratch, not the `:marked` stage
    cfg.sft.steps, cfg.train.batch_size, cfg.train.eval_every, cfg.train.log_every = 2, 4, 2, 1
    cfg.model.num_layers, cfg.model.embed_dim, cfg.model.mlp_dim = 1, 32, 64
    cfg.rl.steps, cfg.rl.eval_every, cfg.rl.eval_size, cfg.rl.eval_samples = 2, 2, 3, 2
    cfg.rl.prompts_per_step, cfg.rl.group_size, cfg.rl.max_turns = 2, 2, 2
    main.run(cfg)
    rows = _rows(tmp_path / "run" / "1_rlvr" / "metrics.jsonl")
    gaps = [r["rl/behav_gap_max"] for r in rows if "rl/behav_gap_max" in r]
    assert len(gaps) == 2 and max(gaps) < 1e-4, gaps
    evals = [r for r in rows if "eval/accuracy" in r]
    assert len(evals) == 2 and all(f"eval/accuracy/{k}" in r for r in evals for k in ("select", "marked", "type"))
