"""What the gradient stages (SFT, reward model, DPO) share: tokenizer, data options, evaluators, the
sample log."""

from __future__ import annotations

import itertools
import json
import logging

import jax
import numpy as np
from flax import nnx

from posttrain import storage
from posttrain.config import RLConfig
from posttrain.core import lineage
from posttrain.core.batch import put_batch
from posttrain.core.metrics import lines_before
from posttrain.data.examples import sft_locations, sft_messages, with_images
from posttrain.data.images import ImageSpec
from posttrain.data.packing import place_patches
from posttrain.data.pipeline import preference_batches, read_jsonl
from posttrain.data.tokenizer import Tokenizer, load_tokenizer
from posttrain.errors import UserError
from posttrain.parallel import agree, is_primary
from posttrain.sampling.generate import generate
from posttrain.sampling.rules import SamplingParams

SIDES = ("chosen", "rejected")


PREFERENCE_AXES = {
    f"{s}_{k}": ("batch", "length")
    for s in SIDES
    for k in ("inputs", "targets", "loss_mask", "positions", "segment_ids")
}


def make_evaluator(metric_fn, make_batches):
    """eval_fn(model, step) → metrics averaged over a finite pass of `make_batches()`, jitted once.

    Several processes step together while any still has a batch: each reads its own slice, and
    packed rows (SFT) give slices of the same records different numbers of batches; a process
    whose slice is done feeds an all-padding batch (no real tokens: weight 0 where the metric
    weights by tokens, as SFT's does; unpacked preference slices never differ)."""
    compiled = {}

    def eval_fn(model: nnx.Module, step: int | None = None) -> dict:
        graphdef, state = nnx.split(model)
        if "fn" not in compiled:
            compiled["fn"] = jax.jit(lambda state, batch: metric_fn(nnx.merge(graphdef, state), batch))
        sums, weight, last = {}, 0.0, None
        batches = iter(make_batches())
        while agree((batch := next(batches, None)) is not None, name="evaluation batches left", reduce="any"):
            if batch is None:
                if last is None:
                    raise RuntimeError("evaluation: this process's slice of the files has no batch")
                batch = {k: np.zeros_like(v) for k, v in last.items()}  # padding: segment 0, no loss
            last = batch
            metrics, w = compiled["fn"](state, put_batch(batch))
            w = float(w)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * w
            weight += w
        return {k: v / max(weight, 1e-9) for k, v in sums.items()}

    return eval_fn


def combine_evals(*fns):
    """One eval_fn(model, step) returning the union of the given ones' metrics (None entries
    skipped; None when there are none)."""
    fns = [f for f in fns if f is not None]
    if not fns:
        return None
    return lambda model, step=None: {k: v for f in fns for k, v in f(model, step).items()}


def finite_batches(make):
    """An iterator over one epoch in file order that stops at the padding rows of the last batch."""

    def batches():
        it = make()
        seen = -1
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            if it.epoch != seen and seen >= 0:
                return
            seen = it.epoch
            yield batch

    return batches


def data_kw(cfg) -> dict:
    d = cfg.data
    fields = dict(kv.split("=", 1) for kv in d.fields.split(",") if kv) if d.fields else None
    return dict(on_error=d.on_error, fields=fields)


def rl_sampling(r: RLConfig, stop_ids, num_samples: int, **extra) -> SamplingParams:
    """Sampling as the `rl` section sets it (temperature, top-k / top-p, new tokens), `num_samples`
    per prompt, stopping at `stop_ids`; `extra`: the other SamplingParams fields."""
    return SamplingParams(
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        stop_ids=tuple(stop_ids),
        num_samples=num_samples,
        **extra,
    )


def stage_tokenizer(cfg) -> Tokenizer:
    """The run's tokenizer, checked against the model: its ids fit the vocabulary, and with images
    (`model.vision`) its image placeholder is `model.vision.image_token_id`."""
    tok = load_tokenizer(cfg.data.tokenizer)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"data.tokenizer={cfg.data.tokenizer!r} has {tok.vocab_size} tokens but "
            f"model.vocab_size={cfg.model.vocab_size}"
        )
    vision = cfg.model.vision
    image_id = getattr(tok, "image_id", None)
    if vision.encoder != "none" and image_id != vision.image_token_id:
        why = (
            f"its image token's id is {image_id}"
            if image_id is not None
            else "it has no image token (tokenizer_config.json image_token, or <image> in its vocabulary)"
        )
        raise UserError(
            f"model.vision.encoder={vision.encoder!r} with model.vision.image_token_id={vision.image_token_id} "
            f"and data.tokenizer={cfg.data.tokenizer!r}: {why}",
            key="model.vision.image_token_id" if image_id is not None else "data.tokenizer",
        )
    return tok


def require_files(files: str, key: str) -> str:
    if not files:
        raise ValueError(f"config.{key} is empty: give a JSONL path or glob (local, gs:// or memory://)")
    return files


def preference_data(cfg, files: str, *, eval: bool, tok: Tokenizer, kw: dict):
    make = lambda: preference_batches(
        files,
        tok,
        batch_size=cfg.train.batch_size,
        max_len=cfg.train.seq_len,
        seed=0 if eval else cfg.seed,
        shuffle=not eval,
        epochs=1 if eval else None,
        **kw,
    )
    return finite_batches(make) if eval else make()


def sample_prompts(
    files: str, tok: Tokenizer, n: int, fields=None, images: ImageSpec | None = None
) -> list[tuple[str, list[int], np.ndarray | None]]:
    """The first `n` conversations of `files` up to their last assistant turn, as (text, prompt ids,
    patches [len(ids), patch_dim] aligned with the ids, or None without `images`)."""
    out = []
    for rec in itertools.islice(read_jsonl(files), n):
        messages, _ = sft_messages(rec.data, fields)
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
        places = sft_locations(rec.data, len(messages), fields)[:last]
        shown, pixels = with_images(messages[:last], places, images, rec.path)
        ids, _ = tok.encode_chat(shown, add_generation_prompt=True)
        patches = None
        if images is not None:
            patches = np.zeros((len(ids), images.patch_dim), np.float32)
            place_patches(patches, np.asarray(ids), pixels, images)
        content = messages[last - 1]["content"] if last else ""
        if not isinstance(content, str):  # parts: the text, an image as <image>
            content = "".join(p.get("text", "<image>") if isinstance(p, dict) else "" for p in content)
        out.append((content, ids, patches))
    return out


def run_max_context(cfg) -> int:
    """`sampling.max_context` of a run that trains its model (sft, dpo): the key, else the context
    trained and configured (init_from's lineage, train.seq_len; `core.lineage.max_context`)."""
    return lineage.max_context(cfg, lineage.of_init(cfg.init_from), cfg.train.seq_len)


def make_sampler_log(cfg, tok: Tokenizer, files: str, n: int = 3):
    """sample_fn for `TrainSpec`: greedy completions of a few held-out prompts → `{workdir}/samples.jsonl`.
    Prompts past `sampling.max_context` (with sft.sample_tokens) are refused here, at start-up."""
    images = ImageSpec.from_config(cfg.model.vision)
    prompts = sample_prompts(files, tok, n, data_kw(cfg)["fields"], images)
    limit = run_max_context(cfg)
    lineage.check_need(
        max((len(ids) for _, ids, _ in prompts), default=0) + cfg.sft.sample_tokens,
        limit,
        f"sft.sample_tokens ({files})",
    )
    sampling = SamplingParams(
        temperature=0.0, max_new_tokens=cfg.sft.sample_tokens, stop_ids=tuple(tok.stop_ids), max_context=limit
    )

    fresh = True  # the first write drops the lines at or past its step: a resumed run writes them again

    def sample_fn(model: nnx.Module, step: int) -> None:
        nonlocal fresh
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        out = generate(
            graphdef,
            params,
            rest,
            [ids for _, ids, _ in prompts],
            sampling,
            jax.random.key(0),
            pad_id=tok.pad_id,
            patches=None if images is None else [p for _, _, p in prompts],
        )
        lines = []
        for i, (text, _, _) in enumerate(prompts):
            completion = tok.decode(out.completion(i))
            lines.append(json.dumps({"step": step, "prompt": text, "completion": completion}) + "\n")
            logging.info("sample %d: %r → %r", i, text[-80:], completion[:160])
        if is_primary():
            path = storage.join(cfg.workdir, "samples.jsonl")
            if fresh and storage.exists(path):
                storage.write_text(path, lines_before(storage.read_text(path), step))
            fresh = False
            storage.append_text(path, "".join(lines))

    return sample_fn
