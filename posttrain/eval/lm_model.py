"""A posttrain model as an evaluation harness sees one, without the harness: weights loaded from a
run, a Hugging Face folder or a GGUF file; token log-probabilities of whole rows in one batched,
sharded forward; greedy continuations that stop at stop strings. `eval/lm_harness.py` wraps this
as an lm-eval model, and stage `eval` runs lm-eval tasks on its own loaded weights through it.

Checkpoint specs (`load_checkpoint`): `hf:FOLDER` (or a folder holding `config.json` and
safetensors), `gguf:FILE.gguf` (converted once to an HF folder under `$POSTTRAIN_CACHE`, default
`~/.cache/posttrain/gguf`), else a posttrain run's workdir (its saved `config.json` gives the
model and tokenizer; the newest checkpoint, or `step`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from posttrain.core import lineage
from posttrain.core.init import load_model_state
from posttrain.core.state import abstract_model
from posttrain.data.tokenizer import load_tokenizer
from posttrain.models.decoder import Decoder
from posttrain.models.logprobs import token_logprobs
from posttrain.parallel import DEFAULT_RULES, make_mesh, use_sharding
from posttrain.parallel.sharding import Rules
from posttrain.sampling.generate import PaddedPrompts, bucket, host_outputs, sharding_key, static_samples
from posttrain.sampling.inflight import chunk_program, start_program
from posttrain.sampling.rules import SamplingParams

DEFAULT_MAX_LENGTH = 2048  # lm-eval's hf backend's default context when the model names none
MIN_LENGTH_BUCKET = 8


@dataclasses.dataclass
class LoadedModel:
    """Weights on a mesh with their tokenizer: what the harness scores and samples with.
    `max_length`: the longest row (prompt + continuation) a request may use."""

    graphdef: nnx.GraphDef
    params: nnx.State
    rest: nnx.State
    tok: object
    max_length: int
    mesh: Mesh
    rules: Rules


def gguf_folder(path: str, cache: str | None = None) -> str:
    """GGUF file `path` as a Hugging Face folder (written once per file content and size)."""
    from posttrain.models.hf.gguf import gguf_to_hf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint=gguf:{path}: no such GGUF file")
    stat = os.stat(path)
    tag = hashlib.sha256(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cache = cache or os.environ.get("POSTTRAIN_CACHE", os.path.expanduser("~/.cache/posttrain"))
    out = os.path.join(cache, "gguf", f"{os.path.basename(path).removesuffix('.gguf')}-{tag}")
    if not os.path.isfile(os.path.join(out, "config.json")):
        gguf_to_hf(path, out + ".partial", progress=False)
        os.replace(out + ".partial", out)
    return out


def resolve_spec(spec: str) -> tuple[str, str | None]:
    """A checkpoint spec → (what `core.init.load_model_state` reads, the HF folder or None)."""
    if spec.startswith("gguf:"):
        folder = gguf_folder(spec.removeprefix("gguf:"))
        return f"hf:{folder}", folder
    if spec.startswith("hf:"):
        return spec, spec.removeprefix("hf:")
    config = os.path.join(spec, "config.json")
    if os.path.isfile(config) and not os.path.isdir(os.path.join(spec, "checkpoints")):
        with open(config) as f:
            if "architectures" in json.load(f):  # an HF config.json (a run's names its stage)
                return f"hf:{spec}", spec
    return spec, None


def load_checkpoint(
    spec: str, *, max_length: int = 0, step: int | None = None, mesh: Mesh | None = None, rules: Rules | None = None
) -> LoadedModel:
    """The weights and tokenizer of checkpoint `spec` (module docstring) on `mesh` (default: one
    device) under `rules`; `max_length` 0: the model's configured context (else 2048)."""
    from posttrain.models.hf import model_config_from_hf

    path, folder = resolve_spec(spec)
    if folder is not None:
        model_cfg, tok_path, source = model_config_from_hf(folder), folder, lineage.of_init(path)
    else:
        from posttrain.core.hf_convert import read_run_config

        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise FileNotFoundError(f"checkpoint={spec!r}: neither hf:FOLDER, gguf:FILE nor a run with config.json")
        run = read_run_config(spec)
        model_cfg, tok_path, source = run.model, run.data.tokenizer, lineage.of_run(spec, step=step)
    mesh = mesh or make_mesh(dict(data=1), jax.devices()[:1])
    rules = rules or DEFAULT_RULES
    make = lambda: Decoder(model_cfg, rngs=nnx.Rngs(0))
    with use_sharding(mesh, rules):
        params, rest, _ = load_model_state(path, make, mesh, rules, step=step)
    limit = max_length or lineage.configured_context(model_cfg, source) or DEFAULT_MAX_LENGTH
    graphdef = nnx.graphdef(abstract_model(make))
    return LoadedModel(graphdef, params, rest, load_tokenizer(tok_path), limit, mesh, rules)


@functools.partial(jax.jit, static_argnames=("graphdef", "rules"))
def score_program(graphdef, params, rest, tokens, lengths, *, rules=None):
    """tokens [B, L] right-padded to lengths [B] → (log p(tokens[:, t+1]) at t, and whether it is
    the argmax), both [B, L-1]; past a row's length: 0 and True."""
    del rules
    model = nnx.merge(graphdef, params, rest)
    real = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits, _ = model(tokens, positions, real.astype(jnp.int32))
    logits, targets = logits[:, :-1], tokens[:, 1:]
    logp = jnp.where(real[:, 1:], token_logprobs(logits, targets), 0.0)
    greedy = (jnp.argmax(logits, axis=-1) == targets) | ~real[:, 1:]
    return logp, greedy


def score_rows(model: LoadedModel, rows: Sequence[Sequence[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per row of token ids: (log-probs [len-1] of each token after the first, whether each is the
    greedy choice [len-1]), from one forward of the rows padded to a power-of-two batch and length."""
    n, width = len(rows), bucket(max(map(len, rows)), MIN_LENGTH_BUCKET)
    tokens = np.full((bucket(n), width), model.tok.pad_id, np.int32)
    lengths = np.ones((len(tokens),), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)], lengths[i] = r, len(r)
    with use_sharding(model.mesh, model.rules):
        logp, greedy = score_program(model.graphdef, model.params, model.rest, tokens, lengths, rules=sharding_key())
        logp, greedy = host_outputs((logp, greedy))
    return [(np.asarray(logp[i, : len(r) - 1]), np.asarray(greedy[i, : len(r) - 1])) for i, r in enumerate(rows)]


def first_stop(text: str, stops: Sequence[str]) -> int:
    """Where the first of the non-empty `stops` starts in `text` (-1: none occurs)."""
    found = [i for s in stops if s and (i := text.find(s)) >= 0]
    return min(found) if found else -1


def greedy_until(
    model: LoadedModel, prompts: Sequence[Sequence[int]], max_new: int, stops: Sequence[str], chunk: int = 32
) -> list[list[int]]:
    """Greedy continuations of `prompts`, each ending at a stop token, after `max_new` tokens, or
    (checked every `chunk` decode steps on the host) once its text holds one of `stops` (the text
    is cut there by the caller). One compiled program per power-of-two batch, prompt length and
    `max_new`: the sampler's static batch decoded in chunks (`sampling.inflight`)."""
    tok = model.tok
    sampling = SamplingParams(temperature=0.0, max_new_tokens=bucket(max_new), stop_ids=tuple(tok.stop_ids))
    with use_sharding(model.mesh, model.rules):
        batch = PaddedPrompts.of(prompts, sampling, tok.pad_id, max_new_tokens=[max_new] * len(prompts))
        static = dict(sampling=sampling, pad_id=tok.pad_id, rules=sharding_key())
        slots, out = batch.run(start_program, model.graphdef, model.params, model.rest, jax.random.key(0))
        while True:
            out, slots = chunk_program(model.graphdef, model.params, model.rest, slots, out, np.int32(chunk), **static)
            tokens, lengths, done = (np.asarray(a) for a in host_outputs((out.tokens, out.lengths, slots.done)))
            stopped = np.array(
                [d or first_stop(tok.decode(t[:n]), stops) >= 0 for t, n, d in zip(tokens, lengths, done)]
            )
            if stopped.all():
                break
            if stopped.any() and not np.array_equal(stopped, done):
                slots = slots.replace(done=jax.device_put(jnp.asarray(stopped), slots.done.sharding))
        samples = static_samples(host_outputs(out), len(prompts), 1)
    return [samples.completion(i) for i in range(len(prompts))]
