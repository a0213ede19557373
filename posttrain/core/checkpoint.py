"""Checkpoints with orbax: asynchronous saves of the train state, data-iterator state and config.

A run started again in the same workdir resumes from the latest checkpoint. Restores take an
abstract state carrying target shardings, so a checkpoint written on one mesh loads onto another.

Safety: `save` refuses non-finite weights (one fused reduction at save time, which is rare), so a
diverged run never rotates good checkpoints out. `restore_newest` verifies by restoring: a
checkpoint that cannot be read (a truncated file, a half-written folder) is reported by name and
the next older one is tried (the unreadable folder is renamed `{step}.unreadable`, kept for a
look, so the step can be saved again); a checkpoint of a differently shaped model is an error
naming the parameter and both shapes (checked on orbax's metadata before any array is read).

Several processes: each reads only its own shards, so a damaged file may be unreadable to one
process alone. Each step is therefore tried by every process (a restore without orbax's global
barriers, `_local`), the outcome agreed (`parallel.agree`), and all of them keep the newest step
every process could read; the steps some could not read are set aside together (by process 0).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from posttrain.errors import UserError
from posttrain.parallel.agreement import agree


class NonFiniteCheckpoint(RuntimeError):
    """The trees to be saved hold NaN or inf."""


class ShapeMismatch(UserError):
    """A checkpoint holds a parameter whose shape differs from the model's."""


@jax.jit
def _leaves_finite(leaves: list[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def first_nonfinite(trees: dict[str, Any]) -> str | None:
    """The path ("params/…/w") of the first floating-point leaf holding NaN/inf, or None."""
    named = [
        (f"{name}/{jax.tree_util.keystr(path, simple=True, separator='/')}", x)
        for name, tree in trees.items()
        for path, x in jax.tree_util.tree_leaves_with_path(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    if not named:
        return None
    ok = np.asarray(_leaves_finite([x for _, x in named]))
    bad = np.flatnonzero(~ok)
    return named[bad[0]][0] if len(bad) else None


def _names(path: tuple) -> tuple[str, ...]:
    """A pytree key path as plain names: dict keys, attributes and indices alike."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _shape_of(x: Any) -> tuple | None:
    shape = getattr(x, "shape", None)
    return tuple(shape) if shape is not None else None


OK, UNREADABLE, SHAPE_MISMATCH = 0, 1, 2  # a process's outcome of restoring a step (the worst is agreed)


class Checkpointer:
    """Saves every `every` steps into `{directory}`, keeping the newest `keep`."""

    def __init__(self, directory: str, *, every: int, keep: int, async_save: bool = True, create: bool = True):
        """`create=False` for reading another run's checkpoints: the folder is never created."""
        self.every = every
        directory = directory if "://" in directory else os.path.abspath(directory)
        self.directory = directory
        self.manager = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=async_save, create=create, read_only=not create
            ),
        )
        here = {jax.process_index()}  # restores with no barrier across processes (restore_newest)
        self._local = ocp.Checkpointer(
            ocp.CompositeCheckpointHandler(),
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                primary_host=jax.process_index(), active_processes=here
            ),
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of every complete checkpoint, ascending."""
        return sorted(self.manager.all_steps())

    def should_save(self, step: int, last_step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == last_step)

    def save(self, step: int, trees: dict[str, Any], *, data: dict | None = None, meta: dict | None = None) -> None:
        """Start saving named pytrees of arrays (e.g. params, opt_state) with JSON `data` (the data
        iterator's state) and `meta` (config, seed) at `step`.

        Returns once the device arrays are copied; writing continues in the background. Empty
        trees (e.g. no router biases) are skipped: orbax refuses them. Raises NonFiniteCheckpoint
        (and saves nothing) if a tree holds NaN or inf.
        """
        bad = first_nonfinite(trees)
        if bad is not None:
            self.wait()
            raise NonFiniteCheckpoint(
                f"refusing to save checkpoint {step} in {self.directory}: {bad} holds NaN/inf; "
                f"the newest saved checkpoint ({self.latest_step()}) is kept as it is"
            )
        items = {k: ocp.args.StandardSave(v) for k, v in trees.items() if jax.tree.leaves(v)}
        items.update(data=ocp.args.JsonSave(data or {}), meta=ocp.args.JsonSave(meta or {}))
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(self, step: int, abstract: dict[str, Any]) -> tuple[dict[str, Any], dict, dict]:
        """The named trees in `abstract` (ShapeDtypeStructs with target shardings: any mesh), and
        the data and meta JSON of checkpoint `step`. Items not asked for are not read; empty
        trees (nothing was saved for them) come back as given."""
        items = {k: ocp.args.StandardRestore(v) for k, v in abstract.items() if jax.tree.leaves(v)}
        args = ocp.args.Composite(**items, data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore())
        # this process's shards only, with no barrier: a process that fails does not leave the
        # others in one (restore_newest agrees on the outcome instead)
        out = self._local.restore(epath.Path(self.directory) / str(step), args=args)
        logging.info("restored checkpoint %d from %s", step, self.manager.directory)
        return {k: out[k] if k in items else v for k, v in abstract.items()}, out["data"], out["meta"]

    def check_shapes(self, step: int, abstract: dict[str, Any]) -> None:
        """Raise ShapeMismatch naming the first parameter whose shape in checkpoint `step` differs
        from `abstract`'s (read from orbax's metadata: no array is loaded)."""
        for name, target in abstract.items():
            folder = epath.Path(self.directory) / str(step) / name
            if not jax.tree.leaves(target) or not folder.exists():
                continue
            saved = ocp.StandardCheckpointHandler().metadata(folder)
            saved = {
                _names(p): x
                for p, x in jax.tree_util.tree_leaves_with_path(
                    getattr(saved, "tree", saved), is_leaf=lambda x: _shape_of(x) is not None
                )
            }
            for path, x in jax.tree_util.tree_leaves_with_path(target):
                old = saved.get(_names(path))
                if old is not None and _shape_of(old) != _shape_of(x):
                    names = _names(path)
                    where = "/".join((name, *(names[:-1] if names[-1] == "value" else names)))
                    raise ShapeMismatch(
                        f"checkpoint {self.directory}/{step}: {where} has shape {_shape_of(old)}, "
                        f"the model expects {_shape_of(x)}",
                        path=f"{self.directory}/{step}",
                    )

    def restore_newest(
        self, abstract: dict[str, Any], *, at_most: int | None = None
    ) -> tuple[int, dict[str, Any], dict, dict] | None:
        """(step, trees, data, meta) of the newest checkpoint (at or below `at_most`) that every
        process can read, or None if there is none. An unreadable one is skipped with a warning
        naming it (and set aside); if none can be read the error lists each with its reason."""
        self.manager.reload()
        listed = [s for s in self.manager.all_steps() if at_most is None or s <= at_most]
        steps = sorted(agree(listed, name="checkpoint steps", reduce="intersection"), reverse=True)
        failed = []
        for step in steps:
            out, outcome, reason = None, OK, ""
            try:
                self.check_shapes(step, abstract)
                out = self.restore(step, abstract)
            except ShapeMismatch as e:
                outcome, mismatch = SHAPE_MISMATCH, e
            except Exception as e:  # orbax / tensorstore / JSON: whatever a damaged folder raises
                outcome = UNREADABLE
                reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
            agreed = agree(outcome, name=f"checkpoint {step} outcome", reduce="max")
            if agreed == SHAPE_MISMATCH:
                if outcome == SHAPE_MISMATCH:
                    raise mismatch
                raise ShapeMismatch(
                    f"checkpoint {self.directory}/{step}: another process found a parameter of another "
                    "shape (see its log)",
                    path=f"{self.directory}/{step}",
                )
            if agreed == OK:
                self._set_aside([int(f.split(" ", 1)[0]) for f in failed])
                return (step, *out)
            reason = reason or "unreadable on another process"
            failed.append(f"{step} ({reason})")
            logging.warning(
                "checkpoint %s/%d cannot be read (%s); %s",
                self.directory,
                step,
                reason,
                "trying the previous one" if step != steps[-1] else "no older checkpoint",
            )
        if failed:
            raise UserError(
                f"no readable checkpoint in {self.directory}: {'; '.join(failed)}. Move the damaged "
                "step folders (or the whole checkpoints folder, to start over) out of the way",
                path=self.directory,
            )
        return None

    def _set_aside(self, steps: list[int]) -> None:
        """Rename unreadable step folders to `{step}.unreadable` (process 0; the others wait)."""
        if steps and jax.process_index() == 0:
            for step in steps:
                folder = epath.Path(self.directory) / str(step)
                target = folder.parent / f"{step}.unreadable"
                if target.exists():
                    target = folder.parent / f"{step}.unreadable-{int(time.time())}"
                folder.rename(target)
                logging.warning("moved the unreadable checkpoint %s aside to %s", folder, target)
        if steps:
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("posttrain_checkpoint_set_aside")
            self.manager.reload()

    def wait(self) -> None:
        """Block until pending asynchronous saves are on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
        self._local.close()


def abstract_with_shardings(shapes: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying target shardings (the restore target for any mesh)."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
