"""`sampling.max_context`: no sampler call, evaluation or long-context grid runs past the context the
model was trained and configured for unless the key allows it (pure Python: the refusals come
before anything is compiled)."""

import json

import pytest

from posttrain.config import RunConfig
from posttrain.core import lineage
from posttrain.data.tokenizer import load_tokenizer
from posttrain.errors import UserError
from posttrain.eval import long_context_eval
from posttrain.sampling.continuous import ContinuousBatcher
from posttrain.sampling.generate import SlotConfig, generate
from posttrain.sampling.rules import SamplingParams
from tests.support.typed_configs import run_cfg

PAST = r"sampling\.max_context=64: a request needs 70 positions \(prompt of 60 tokens \+ max_new_tokens 10\)"


def test_sampler_refuses_past_max_context_before_compiling():
    sampling = SamplingParams(max_new_tokens=10, max_context=64)
    prompts = [[5] * 20, [5] * 60]
    for call in (
        lambda: generate(None, None, None, prompts, sampling, None),
        lambda: generate(None, None, None, prompts, sampling, None, slots=SlotConfig()),
        lambda: ContinuousBatcher(None, sampling).submit(prompts[1]),
    ):
        with pytest.raises(UserError, match=PAST) as e:
            call()
        assert e.value.key == "sampling.max_context" and "--config.sampling.max_context=70" in str(e.value)
    sampling.check_context([54], [10])  # exactly the context: allowed
    sampling.check_context([60], [4])  # a shorter per-prompt limit fits
    SamplingParams(max_new_tokens=10).check_context([10_000], [10])  # 0: unchecked
    # not part of the compiled program: params differing only in max_context share it
    assert SamplingParams(max_context=64) == SamplingParams(max_context=4096)
    assert hash(SamplingParams(max_context=64)) == hash(SamplingParams())


def test_configured_context_is_what_was_trained_and_configured():
    cfg = RunConfig()
    empty = lineage.empty()
    assert lineage.configured_context(cfg.model, empty) == 0  # nothing known: unchecked
    assert lineage.configured_context(cfg.model, {"trained_context": 256}) == 256
    assert lineage.configured_context(cfg.model, {"trained_context": 256}, seq_len=1024) == 1024  # this run trains it
    # SFT at train.seq_len=128 on examples of at most 46 tokens: a later stage samples up to 128 (the
    # quickstart's RL evaluation needs 58; refused when only the longest real example counted)
    short = lineage.merge(empty, 46, 128)
    assert short["trained_context"] == 46 and lineage.configured_context(cfg.model, short) == 128
    assert lineage.merge(short, 30, 64) == short  # only ever raised
    hf = {"hf_config": {"max_position_embeddings": 4096}, "trained_context": 512}
    assert lineage.configured_context(cfg.model, hf) == 4096  # the source model's context stays usable
    yarn = dict(type="yarn", factor=4.0, original_max_position_embeddings=256)
    cfg = cfg.replace({f"model.rope_scaling.{k}": v for k, v in yarn.items()})
    assert lineage.configured_context(cfg.model, {"trained_context": 256}) == 1024  # extended by the scaling
    assert lineage.max_context(cfg, {"trained_context": 256}) == 1024
    cfg = cfg.replace({"sampling.max_context": 8192})  # explicit: allowed past it
    assert lineage.max_context(cfg, {"trained_context": 256}) == 8192
    lineage.check_need(8192, 8192, "x")
    with pytest.raises(UserError, match=r"eval.long_context.lengths='1024' needs 1024 positions.*\(256: "):
        lineage.check_need(1024, 256, "eval.long_context.lengths='1024'")


def test_long_context_grid_past_the_trained_context_is_refused_at_start_up(tmp_path):
    grid = dict(lengths="256,1024", kinds="needle", depths="0", samples=1)
    lc = run_cfg({f"eval.long_context.{k}": v for k, v in grid.items()}).eval.long_context
    tok = load_tokenizer("byte")
    trained_256 = lineage.max_context(RunConfig(), {"trained_context": 256})
    with pytest.raises(UserError, match=r"sampling\.max_context.*1024 positions.*\(256: ") as e:
        long_context_eval.make_long_context_eval(lc, str(tmp_path), tok, trained_256)
    assert e.value.key == "sampling.max_context"
    with pytest.raises(UserError, match=r"sampling\.max_context"):
        long_context_eval.evaluate(object(), tok, lc, max_context=trained_256)
    cfg = run_cfg({"sampling.max_context": 1024})  # told to: the grid is built
    assert long_context_eval.make_long_context_eval(lc, str(tmp_path), tok, lineage.max_context(cfg, {})) is not None
    # and a run that trains at 1024 (train.seq_len) evaluates at 1024 without the key
    assert long_context_eval.make_long_context_eval(lc, str(tmp_path), tok, 1024) is not None


def test_sft_sample_log_refuses_prompts_past_train_seq_len(tmp_path):
    from posttrain.stages.common import make_sampler_log

    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps({"prompt": "x" * 100, "response": "y"}) + "\n")
    cfg = run_cfg({"train.seq_len": 64, "sft.sample_tokens": 16})
    with pytest.raises(UserError, match=r"sampling\.max_context: sft\.sample_tokens.*needs 1\d\d positions.*\(64: "):
        make_sampler_log(cfg, load_tokenizer("byte"), str(path))
    cfg = cfg.replace({"sampling.max_context": 256})
    assert callable(make_sampler_log(cfg, load_tokenizer("byte"), str(path)))


def checked(max_context: int, stages: tuple[str, ...]) -> RunConfig:
    """The run of `stages` (one stage, or a pipeline of them) with `sampling.max_context`, checked as
    a run starts."""
    pipeline = {"pipeline.stages": stages} if len(stages) > 1 else {}
    stage = "pipeline" if pipeline else stages[0]
    return run_cfg({"sampling.max_context": max_context, **pipeline}, stage=stage).check_stages()


def test_the_key_is_every_sampling_stages_and_refused_where_nothing_samples():
    for stages in (("sft",), ("eval",), ("rejection_sampling",), ("sft", "dpo"), ("rlvr",)):
        checked(2048, stages)
    with pytest.raises(ValueError, match=r"sampling\.max_context=2048: no stage of this run \(lm\) samples"):
        checked(2048, ("lm",))
    checked(0, ("lm",))
