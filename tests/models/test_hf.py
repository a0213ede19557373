"""Hugging Face interop against `transformers` itself: tiny random models of every supported
architecture, saved by transformers, loaded into posttrain (1 device and a sharded 8-device mesh)
with equal logits, and saved back so that transformers reloads identical weights."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="HF interop tests need the hf extra: pip install torch==2.13.0 -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="HF interop tests need the hf extra: pip install -e '.[hf]'")

from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from posttrain.config import RunConfig  # noqa: E402
from posttrain.core.checkpoint import Checkpointer  # noqa: E402
from posttrain.core.hf_convert import hf_to_run, read_run_config, run_to_hf  # noqa: E402
from posttrain.core.init import load_model_state  # noqa: E402
from posttrain.core.state import abstract_model  # noqa: E402
from posttrain.models import lora  # noqa: E402
from posttrain.models.attention import rope_frequencies  # noqa: E402
from posttrain.models.decoder import Decoder  # noqa: E402
from posttrain.models.hf import hf_config_from_model, load_params, model_config_from_dict, model_config_from_hf, save_hf  # noqa: E402
from posttrain.parallel import DEFAULT_RULES, make_mesh, use_sharding  # noqa: E402

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.2,
)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=8.0, rope_theta=500.0)
LLAMA3 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
    rope_theta=500.0,
)
# id → (config class, its arguments, save_pretrained arguments)
CASES = {
    "llama-llama3-untied": ("LlamaConfig", dict(rope_parameters=LLAMA3), {}),
    "qwen2-bias-tied": ("Qwen2Config", dict(tie_word_embeddings=True), dict(max_shard_size="20KB")),
    "qwen3-qknorm-yarn": ("Qwen3Config", dict(head_dim=16, rope_parameters=YARN), {}),
    "qwen3moe-step2-mlponly": (
        "Qwen3MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            decoder_sparse_step=2,
            mlp_only_layers=[1, 2],
            head_dim=8,
            norm_topk_prob=False,
        ),
        dict(max_shard_size="30KB"),
    ),
    "qwen3moe-normtopk-fused": (
        "Qwen3MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            head_dim=8,
            norm_topk_prob=True,
            num_hidden_layers=2,
        ),
        dict(save_original_format=False),
    ),
    "mixtral-gqa": (
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=1, num_hidden_layers=2),
        dict(max_shard_size="30KB"),
    ),
}


def hf_model(kind: str, seed: int = 0, **overrides):
    """A random transformers model; norms and biases randomised too, so their mapping is tested."""
    cls, kw, _ = CASES[kind]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**SMALL, **kw, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    return model.float().eval()


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens))).logits.numpy()


def forward(cfg, params, rest, tokens, mesh):
    graphdef = nnx.graphdef(abstract_model(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    fn = jax.jit(lambda p, r, t: nnx.merge(graphdef, p, r)(t)[0])
    if mesh.size == 1:
        return np.asarray(fn(params, rest, tokens))
    with use_sharding(mesh, DEFAULT_RULES):
        return np.asarray(fn(params, rest, tokens))


@pytest.fixture(scope="module")
def meshes():
    return {
        "1 device": make_mesh(dict(data=1), jax.devices()[:1]),
        "data=2,expert=2,tensor=2": make_mesh(dict(data=2, expert=2, tensor=2)),
    }


@pytest.mark.parametrize("kind", list(CASES))
def test_logits_match_transformers_and_round_trip(kind, meshes, tmp_path):
    model = hf_model(kind)
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    model.save_pretrained(src, **CASES[kind][2])
    tokens = np.random.default_rng(0).integers(0, 64, (4, 24))
    ref = hf_logits(model, tokens)
    assert ref.std() > 0.3  # logits far from zero: the comparison means something
    cfg = model_config_from_hf(src)
    make = lambda: Decoder(cfg, rngs=nnx.Rngs(0))
    for name, mesh in meshes.items():
        with use_sharding(mesh, DEFAULT_RULES):
            params, rest, step = load_model_state(f"hf:{src}", make, mesh, DEFAULT_RULES)
        assert step == 0
        np.testing.assert_allclose(forward(cfg, params, rest, tokens, mesh), ref, atol=1e-4, rtol=0, err_msg=name)
    # round trip from the sharded params: transformers reloads the very same weights
    with open(os.path.join(src, "config.json")) as f:
        base = json.load(f)
    save_hf(out, params, cfg, base_config=base, max_shard_bytes=40_000, progress=False)
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 1
    np.testing.assert_array_equal(hf_logits(transformers.AutoModelForCausalLM.from_pretrained(out), tokens), ref)


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_type="linear", factor=2.0),
        dict(rope_type="dynamic", factor=3.0),
        YARN,
        dict(YARN, attention_factor=1.3),
        dict(YARN, mscale=2.0, mscale_all_dim=1.0),
        dict(YARN, truncate=False),
        LLAMA3,
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_frequencies_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(**{**SMALL, "head_dim": 16, "rope_parameters": {"rope_theta": 500.0, **rope}})
    cfg = model_config_from_dict(hf.to_dict())
    scaling = cfg.rope_scaling
    seq_len = 100  # past max_position_embeddings: dynamic scaling grows
    want, want_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, None, seq_len=seq_len)
    got = rope_frequencies(cfg.head_dim, cfg.rope_theta, scaling, jnp.asarray(seq_len))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert scaling.attention_scale() == pytest.approx(want_scale)


@pytest.mark.parametrize("kind", list(CASES))
def test_config_round_trips_through_config_json(kind):
    cls, kw, _ = CASES[kind]
    hf = getattr(transformers, cls)(**{**SMALL, **kw}).to_dict()
    cfg = model_config_from_dict(hf)
    for base in (hf, None):
        again = hf_config_from_model(cfg, base, context=0 if base else hf["max_position_embeddings"])
        assert model_config_from_dict(again).to_dict() == cfg.to_dict()
        assert again["model_type"] == hf["model_type"]
        assert again["max_position_embeddings"] == hf["max_position_embeddings"]
        # every key the import reads is explicit: transformers' class defaults play no part
        assert {"attention_dropout", "hidden_act", "max_position_embeddings"} <= again.keys()


@pytest.mark.parametrize(
    "change, key",
    [
        (dict(architectures=["GPT2LMHeadModel"]), "architectures"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_type='longrope'"),
        (
            dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4, "beta_fast": 8, "foo": 1}),
            "foo",
        ),
        (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
        (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    ],
)
def test_unsupported_config_is_an_error_naming_the_key(change, key):
    hf = {**transformers.LlamaConfig(**SMALL).to_dict(), **change}
    with pytest.raises(ValueError, match=key.replace("[", r"\[")):
        model_config_from_dict(hf, "m/config.json")


def test_mismatched_model_config_and_stray_tensors_are_errors(tmp_path):
    src = str(tmp_path / "src")
    hf_model("llama-llama3-untied").save_pretrained(src)
    cfg = model_config_from_hf(src).replace(rope_theta=1e6, tie_embeddings=True)
    mesh = make_mesh(dict(data=1), jax.devices()[:1])
    with pytest.raises(ValueError, match=r"model\.rope_theta: model has 1000000\.0(.|\n)*parameter head"):
        load_model_state(f"hf:{src}", lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, DEFAULT_RULES)
    # a tensor the model has no place for (here: in a second file of an index) is an error too
    with safe_open(os.path.join(src, "model.safetensors"), "np") as f:
        weight_map = {name: "model.safetensors" for name in f.keys()}
    weight_map["model.layers.0.mlp.extra.weight"] = "extra.safetensors"
    save_file({"model.layers.0.mlp.extra.weight": np.zeros(2, np.float32)}, os.path.join(src, "extra.safetensors"))
    with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    cfg = model_config_from_hf(src)
    _, params, _ = nnx.split(abstract_model(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
        load_params(src, params, cfg, mesh, DEFAULT_RULES)


def test_convert_runs_both_ways_with_lora_merged(tmp_path):
    """HF → posttrain run → HF is lossless; a LoRA run exports base + merged adapters."""
    src, run, lora_run = str(tmp_path / "src"), str(tmp_path / "run"), str(tmp_path / "lora_run")
    model = hf_model("qwen3moe-step2-mlponly")
    model.save_pretrained(src)
    tokens = np.random.default_rng(1).integers(0, 64, (2, 16))
    mesh = make_mesh(dict(fsdp=-1))
    hf_to_run(src, run, mesh, DEFAULT_RULES, progress=False)
    run_to_hf(read_run_config(run), str(tmp_path / "back"), mesh, DEFAULT_RULES, progress=False)
    np.testing.assert_array_equal(
        hf_logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back"), tokens),
        hf_logits(model, tokens),
    )

    cfg = RunConfig(model=model_config_from_hf(src), init_from=f"hf:{src}", workdir=lora_run).replace(
        {"lora.rank": 2, "lora.alpha": 4.0, "lora.targets": ("q", "o", "w_up", "down")}
    )
    make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(0))
    one = make_mesh(dict(data=1), jax.devices()[:1])
    base, rest, _ = load_model_state(cfg.init_from, make, one, DEFAULT_RULES)
    rng = np.random.default_rng(2)
    adapters = jax.tree.map(
        lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.3, x.dtype),
        lora.init_adapters(base, cfg.lora.targets, 2, jax.random.key(0)),
    )
    ckpt = Checkpointer(os.path.join(lora_run, "checkpoints"), every=0, keep=1, async_save=False)
    ckpt.save(5, {"params": adapters})
    ckpt.close()
    run_to_hf(cfg, str(tmp_path / "merged"), mesh, DEFAULT_RULES, progress=False)
    merged = lora.merge(base, adapters, cfg.lora.alpha / cfg.lora.rank)
    ours = forward(cfg.model, merged, rest, tokens, one)
    theirs = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged"), tokens)
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
    assert np.abs(theirs - hf_logits(model, tokens)).max() > 1e-2  # the adapters did change the model


def test_advertised_context():
    hf = transformers.LlamaConfig(**SMALL).to_dict()
    cfg = model_config_from_dict(hf)
    with pytest.raises(ValueError, match="max_position_embeddings is unknown"):
        hf_config_from_model(cfg, None)
    assert hf_config_from_model(cfg, hf, context=32)["max_position_embeddings"] == 64  # never shrinks
    assert hf_config_from_model(cfg, hf, context=300)["max_position_embeddings"] == 300  # trained longer
    dynamic = dict(type="dynamic", factor=2.0, original_max_position_embeddings=48)
    cfg = cfg.replace({f"rope_scaling.{k}": v for k, v in dynamic.items()})
    assert hf_config_from_model(cfg, hf, context=32)["max_position_embeddings"] == 96  # 48 x 2: its base's
    assert hf_config_from_model(cfg, hf, context=300)["max_position_embeddings"] == 300


def test_a_dynamic_rope_model_exports_as_the_plain_rope_it_computes(tmp_path):
    """Dynamic RoPE takes its base from the extended context (16 x 2) in every call, so it exports
    as plain RoPE with that base: transformers reads the export as we compute, on inputs shorter
    and longer than 32 tokens, where the source's `dynamic` config grows its base per call."""
    src, out = tmp_path / "src", tmp_path / "out"
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}
    hf_model("llama-llama3-untied", rope_parameters=dynamic, max_position_embeddings=16).save_pretrained(src)
    cfg, one = model_config_from_hf(str(src)), make_mesh(dict(data=1), jax.devices()[:1])
    assert (cfg.rope_scaling.type, cfg.rope_scaling.original_max_position_embeddings) == ("dynamic", 16)
    params, rest, _ = load_model_state(f"hf:{src}", lambda: Decoder(cfg, rngs=nnx.Rngs(0)), one, DEFAULT_RULES)
    save_hf(str(out), params, cfg, base_config=json.loads((src / "config.json").read_text()), progress=False)
    exported = json.loads((out / "config.json").read_text())
    assert exported["rope_parameters"]["rope_type"] == "default" and exported["max_position_embeddings"] == 32
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out)
    source = transformers.AutoModelForCausalLM.from_pretrained(src)
    for length in (8, 48):
        tokens = np.random.default_rng(length).integers(0, 64, (2, length))
        ours = forward(cfg, params, rest, tokens, one)
        np.testing.assert_allclose(hf_logits(theirs, tokens), ours, atol=1e-4, rtol=0, err_msg=f"{length} tokens")
        assert np.abs(hf_logits(source, tokens) - ours).max() > 1e-3  # transformers' per-call base differs


def long_sft_file(path, n: int = 16) -> str:
    """SFT records alternately short (~30 byte tokens) and long (~200, over every seq_len here)."""
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(str(x) for x in rng.integers(0, 1000, 60 if i % 2 else 6))
            f.write(json.dumps({"prompt": text[: len(text) // 2], "response": text[len(text) // 2 :]}) + "\n")
    return str(path)


def test_export_keeps_source_config_and_advertises_trained_context(tmp_path):
    """--from_hf then --to_hf (no --hf_base) keeps every source key; a run trained longer (SFT
    from that run) exports its trained context with the source's other settings."""
    from posttrain.main import run as run_main

    src, run, out = str(tmp_path / "src"), str(tmp_path / "run"), str(tmp_path / "out")
    hf_model(
        "llama-llama3-untied",
        vocab_size=264,
        num_hidden_layers=2,
        max_position_embeddings=96,
        bos_token_id=5,
        eos_token_id=6,
        pad_token_id=7,
    ).save_pretrained(src)
    source = json.loads(open(os.path.join(src, "config.json")).read())
    mesh = make_mesh(dict(fsdp=-1))
    hf_to_run(src, run, mesh, DEFAULT_RULES, progress=False)
    run_to_hf(read_run_config(run), out, mesh, DEFAULT_RULES, progress=False)
    exported = json.loads(open(os.path.join(out, "config.json")).read())
    for key, value in source.items():
        if key not in ("transformers_version", "dtype"):
            assert exported.get(key) == value, key
    assert transformers.AutoConfig.from_pretrained(out).max_position_embeddings == 96

    cfg = read_run_config(run).replace(
        {
            **{"stage": "sft", "workdir": str(tmp_path / "long"), "init_from": run, "data.tokenizer": "byte"},
            **{"sft.train_files": long_sft_file(tmp_path / "long.jsonl"), "sft.eval_files": ""},
            **{"data.truncate": True, "train.progress": False, "checkpoint.async_save": False},
            **{"train.steps": 2, "train.batch_size": 2, "train.seq_len": 128},  # (staged runs: data/test_schedule)
        }
    )
    run_main(cfg)
    run_to_hf(read_run_config(cfg.workdir), str(tmp_path / "long_hf"), mesh, DEFAULT_RULES, progress=False)
    exported = json.loads(open(tmp_path / "long_hf" / "config.json").read())
    assert exported["max_position_embeddings"] == 128  # truncated rows of 128 were trained
    assert exported["rope_parameters"] == source["rope_parameters"]
    assert (exported["bos_token_id"], exported["eos_token_id"], exported["pad_token_id"]) == (5, 6, 7)
