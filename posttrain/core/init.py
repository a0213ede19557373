"""Starting a stage from another run's checkpoint (`config.init_from`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from flax import nnx
from jax.sharding import Mesh

from posttrain.core.checkpoint import Checkpointer, ShapeMismatch, abstract_with_shardings
from posttrain.core.state import abstract_model, shardings_for
from posttrain.data.sources import unreachable
from posttrain.errors import UserError
from posttrain.parallel.agreement import agree
from posttrain.parallel.sharding import Rules


def checkpoint_dir(path: str) -> str:
    """A run's workdir or its checkpoints folder → the checkpoints folder."""
    sub = os.path.join(path, "checkpoints")
    return sub if _exists(sub) else path


def _exists(path: str) -> bool:
    if "://" not in path:
        return os.path.isdir(path)
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(path)
        return fs.isdir(root)
    except Exception as e:  # credentials, network: say which path and why, in one line
        error = unreachable(path, e, "cannot be read")
        raise UserError(f"init_from={error}", key="init_from", path=path) from e


def require_init_from(path: str) -> None:
    """Fail (UserError naming `init_from`) unless `path` is an existing folder or `hf:` folder;
    cheap, so runs check it before anything compiles. Never creates the folder."""
    folder = path.removeprefix("hf:")
    if not _exists(folder):
        raise UserError(
            f"init_from={path!r}: no such folder; give a run's workdir, its checkpoints folder or hf:/path/to/hf_model",
            key="init_from",
            path=path,
        )


def load_model_state(
    path: str, make_model: Callable[[], nnx.Module], mesh: Mesh, rules: Rules, *, step: int | None = None
) -> tuple[nnx.State, nnx.State, int]:
    """(params, rest, step) of the newest checkpoint under `path` (or the one at `step`), for a
    model built by `make_model`, placed on `mesh` by `rules` (any mesh: restore reshards).

    `hf:/path/to/model` reads a Hugging Face model folder instead (step 0); the model config must
    match its config.json (see `posttrain.models.hf.model_config_from_hf`).
    """
    if path.startswith("hf:"):
        from posttrain.models import hf  # safetensors is only needed here

        return (*hf.load_model_state(path.removeprefix("hf:"), make_model, mesh, rules), 0)
    require_init_from(path)
    ckpt = Checkpointer(checkpoint_dir(path), every=0, keep=1, async_save=False, create=False)
    if step is not None and step not in ckpt.manager.all_steps():
        raise FileNotFoundError(f"{path!r}: no checkpoint at step {step} (have {sorted(ckpt.manager.all_steps())})")
    if step is None:  # the newest step every process lists (a run still saving may add one in between)
        newest = agree(-1 if ckpt.latest_step() is None else ckpt.latest_step(), name=f"newest of {path}", reduce="min")
        step = None if newest < 0 else newest
    if step is None:
        raise FileNotFoundError(f"init_from={path!r}: no checkpoint found under {checkpoint_dir(path)}")
    _, params, rest = nnx.split(abstract_model(make_model), nnx.Param, ...)
    target = {
        k: abstract_with_shardings(v, shardings_for(v, mesh, rules)) for k, v in (("params", params), ("rest", rest))
    }
    try:
        found = ckpt.restore_newest(target, at_most=step)
    except ShapeMismatch as e:
        raise UserError(
            f"init_from={path!r} is a different model: {e}; init_from needs a checkpoint of the "
            "same model.* shapes (or hf:/folder for a Hugging Face model)",
            key="init_from",
            path=path,
        ) from None
    finally:
        ckpt.close()
    if found is None:
        raise UserError(
            f"init_from={path!r}: no checkpoint under {checkpoint_dir(path)}; give a run's workdir or "
            "its checkpoints folder",
            key="init_from",
            path=path,
        )
    if found[0] != step:
        raise UserError(
            f"init_from={path!r}: the checkpoint at step {step} cannot be read (see the warning above)",
            key="init_from",
            path=path,
        )
    step, trees, _, _ = found
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
                raise UserError(
                    f"init_from: {'/'.join(map(str, path))} has shape {new.shape}, the model expects {v.shape}",
                    key="init_from",
                )
            return new
        return v

    return nnx.from_flat_state([(p, pick(p, v)) for p, v in nnx.to_flat_state(target)])


def init_model_from(init_from: str, make_source, mesh: Mesh, rules: Rules):
    """`TrainSpec.init_model`: overlay the variables of `init_from`'s newest checkpoint (a model
    built by `make_source`, read into the run's `mesh` and `rules`) on the freshly initialised
    ones; None when `init_from` is empty."""
    if not init_from:
        return None

    def init(params, rest):
        src_params, src_rest, step = load_model_state(init_from, make_source, mesh, rules)
        logging.info("init_from %s (step %d)", init_from, step)
        return overlay(params, src_params), overlay(rest, src_rest)

    return init
