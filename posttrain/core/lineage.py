"""A model's lineage across runs: the Hugging Face config.json its weights came from and the
longest context they have been trained at.

Every checkpoint the training loop writes carries it in its `meta` (key `lineage`), inherited
from `init_from` and updated as training sees longer sequences, so exporting any run
(`tools/convert_hf.py --run R --to_hf OUT`) keeps every setting of the source model and
advertises the context actually trained (`max_position_embeddings`).
"""

from __future__ import annotations

import json
import logging

import fsspec

from posttrain.core.checkpoint import Checkpointer
from posttrain.errors import UserError

KEY = "lineage"


def empty() -> dict:
    """No source config, nothing trained."""
    return {"hf_config": None, "trained_context": 0}


def merge(lineage: dict, trained_context: int, configured_context: int = 0) -> dict:
    """`lineage` with its trained context (the longest real sequence trained) raised to at least
    `trained_context`, and its configured context (the longest `train.seq_len` it was trained at,
    padding included: what a sampler may use, `configured_context`) to `configured_context`."""
    most = lambda key, value: max(int(lineage.get(key) or 0), int(value))  # noqa: E731
    return {
        **lineage,
        "trained_context": most("trained_context", trained_context),
        "configured_context": most("configured_context", configured_context),
    }


def of_init(init_from: str, _depth: int = 0) -> dict:
    """The lineage a run starting from `init_from` inherits: an `hf:` folder's config.json (nothing
    trained yet), another run's newest checkpoint's, or nothing."""
    if not init_from:
        return empty()
    if init_from.startswith("hf:"):
        from posttrain.models.hf.config import read_hf_config  # models below train: import on use

        return {"hf_config": read_hf_config(init_from.removeprefix("hf:")), "trained_context": 0}
    return of_run(init_from, _depth)


def of_run(path: str, _depth: int = 0, *, step: int | None = None) -> dict:
    """The lineage of the newest checkpoint (or that of `step`) under run (or checkpoints folder) `path`.

    Checkpoints written before lineage was recorded fall back to what they have: the source
    config a `convert_hf.py --from_hf` run stored, else the lineage of the run's own `init_from`.
    """
    from posttrain.core.init import checkpoint_dir

    fs, _ = fsspec.core.url_to_fs(path)
    if not fs.exists(path):
        return empty()
    ckpt = Checkpointer(checkpoint_dir(path), every=0, keep=1, async_save=False)
    step = ckpt.latest_step() if step is None else step
    meta = ckpt.restore(step, {})[2] if step is not None else {}
    ckpt.close()
    if meta.get(KEY):
        return {**empty(), **meta[KEY]}
    if meta.get("hf_config"):
        return {"hf_config": meta["hf_config"], "trained_context": 0}
    init_from = _run_init_from(path)
    if init_from and _depth < 16:
        logging.warning("%s: checkpoint has no lineage; using that of its init_from %s", path, init_from)
        return of_init(init_from, _depth + 1)
    return empty()


def _run_init_from(path: str) -> str:
    """`init_from` of the run config saved in `{path}/config.json` ('' when there is none)."""
    file = f"{path.rstrip('/')}/config.json"
    fs, _ = fsspec.core.url_to_fs(file)
    if not fs.exists(file):
        return ""
    with fsspec.open(file) as f:
        return json.load(f).get("init_from", "")


def configured_context(model_cfg, source: dict, seq_len: int = 0) -> int:
    """The context a model was trained and configured for: the longest of its trained context
    (`source`, a lineage: the longest real sequence, and the longest `train.seq_len` its runs
    trained at, so a model fine-tuned on short examples still samples within its configured
    length), its source config's `max_position_embeddings`, the RoPE scaling's extended length
    (`original_max_position_embeddings` × `factor`) and `seq_len` (the `train.seq_len` of a run
    that trains it). 0 when none is known (the sampler then checks nothing)."""
    s = model_cfg.rope_scaling
    scaled = int(s.original_max_position_embeddings * s.factor) if s.type and s.original_max_position_embeddings else 0
    hf = int((source.get("hf_config") or {}).get("max_position_embeddings") or 0)
    trained = max(int(source.get("trained_context") or 0), int(source.get("configured_context") or 0))
    return max(trained, hf, scaled, int(seq_len))


def max_context(cfg, source: dict, seq_len: int = 0) -> int:
    """`sampling.max_context` resolved for a model of lineage `source`: the key when it is set (an
    explicit limit), else `configured_context` (see there; `seq_len` when this run trains it)."""
    return int(cfg.sampling.max_context) or configured_context(cfg.model, source, seq_len)


def check_need(need: int, limit: int, what: str) -> None:
    """Refuse at start-up what a sampler call would refuse later: `what` (e.g. "eval.long_context.
    lengths=256,1024") needing `need` positions (prompt + new tokens) past `limit` (0: unchecked)."""
    if limit and need > limit:
        raise UserError(
            f"sampling.max_context: {what} needs {need} positions (prompt + new tokens), past the context "
            f"the model is trained and configured for ({limit}: the longest of its trained context, "
            "train.seq_len, the source config's max_position_embeddings and the RoPE scaling's extended "
            f"length, or sampling.max_context); set --config.sampling.max_context={need} (or more) to "
            "sample past it explicitly",
            key="sampling.max_context",
        )
