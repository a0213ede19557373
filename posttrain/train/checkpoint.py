"""Checkpoints with orbax: asynchronous saves of the train state, data-iterator state and config.

A run started again in the same workdir resumes from the latest checkpoint. Restores take an
abstract state carrying target shardings, so a checkpoint written on one mesh loads onto another.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Saves every `every` steps into `{directory}`, keeping the newest `keep`."""

    def __init__(self, directory: str, *, every: int, keep: int, async_save: bool = True):
        self.every = every
        directory = directory if "://" in directory else os.path.abspath(directory)
        self.manager = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                 create=True))

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of every complete checkpoint, ascending."""
        return sorted(self.manager.all_steps())

    def should_save(self, step: int, last_step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == last_step)

    def save(self, step: int, trees: dict[str, Any], *, data: dict | None = None,
             meta: dict | None = None) -> None:
        """Start saving named pytrees of arrays (e.g. params, opt_state) with JSON `data` (the data
        iterator's state) and `meta` (config, seed) at `step`.

        Returns once the device arrays are copied; writing continues in the background. Empty
        trees (e.g. no router biases) are skipped: orbax refuses them.
        """
        items = {k: ocp.args.StandardSave(v) for k, v in trees.items() if jax.tree.leaves(v)}
        items.update(data=ocp.args.JsonSave(data or {}), meta=ocp.args.JsonSave(meta or {}))
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(self, step: int, abstract: dict[str, Any]) -> tuple[dict[str, Any], dict, dict]:
        """The named trees in `abstract` (ShapeDtypeStructs with target shardings: any mesh), and
        the data and meta JSON of checkpoint `step`. Items not asked for are not read; empty
        trees (nothing was saved for them) come back as given."""
        items = {k: ocp.args.StandardRestore(v) for k, v in abstract.items() if jax.tree.leaves(v)}
        out = self.manager.restore(step, args=ocp.args.Composite(
            **items, data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
        logging.info("restored checkpoint %d from %s", step, self.manager.directory)
        return {k: out[k] if k in items else v for k, v in abstract.items()}, out["data"], out["meta"]

    def wait(self) -> None:
        """Block until pending asynchronous saves are on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_with_shardings(shapes: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying target shardings (the restore target for any mesh)."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
