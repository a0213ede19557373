"""Starting a stage from another run's checkpoint (`config.init_from`)."""

from __future__ import annotations

import os
from collections.abc import Callable

from flax import nnx
from jax.sharding import Mesh

from posttrain.parallel.sharding import Rules
from posttrain.train.checkpoint import Checkpointer, abstract_with_shardings
from posttrain.train.state import abstract_model, shardings_for


def checkpoint_dir(path: str) -> str:
    """A run's workdir or its checkpoints folder → the checkpoints folder."""
    sub = os.path.join(path, "checkpoints")
    return sub if os.path.isdir(sub) else path


def load_model_state(path: str, make_model: Callable[[], nnx.Module], mesh: Mesh,
                     rules: Rules, step: int | None = None) -> tuple[nnx.State, nnx.State, int]:
    """(params, rest, step) of checkpoint `step` (default: the newest) under `path`, for a model
    built by `make_model`, placed on `mesh` by `rules` (any mesh: restore reshards).

    `hf:/path/to/model` reads a Hugging Face model folder instead (step 0); the model config must
    match its config.json (see `posttrain.models.hf.model_config_from_hf`).
    """
    if path.startswith("hf:"):
        from posttrain.models import hf    # safetensors is only needed here
        return (*hf.load_model_state(path.removeprefix("hf:"), make_model, mesh, rules), 0)
    ckpt = Checkpointer(checkpoint_dir(path), every=0, keep=1, async_save=False)
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"init_from={path!r}: no checkpoint found under {checkpoint_dir(path)}")
    _, params, rest = nnx.split(abstract_model(make_model), nnx.Param, ...)
    target = {k: abstract_with_shardings(v, shardings_for(v, mesh, rules))
              for k, v in (("params", params), ("rest", rest))}
    trees, _, _ = ckpt.restore(step, target)
    ckpt.close()
    return trees["params"], trees["rest"], step


def overlay(target: nnx.State, source: nnx.State) -> nnx.State:
    """`target` with every variable that `source` also has replaced by source's (same shapes).

    Lets a reward model (decoder + value head) start from a plain decoder checkpoint.
    """
    flat = dict(nnx.to_flat_state(source))
    def pick(path, v):
        if path in flat:
            new = flat[path]
            if new.shape != v.shape:
                raise ValueError(f"init_from: {'/'.join(map(str, path))} has shape {new.shape}, model expects {v.shape}")
            return new
        return v
    return nnx.from_flat_state([(p, pick(p, v)) for p, v in nnx.to_flat_state(target)])
