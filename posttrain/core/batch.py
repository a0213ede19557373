"""Batch placement: a host batch (this process's rows) becomes global arrays sharded by logical names."""

from __future__ import annotations

import jax
import numpy as np

from posttrain.parallel import named_sharding


def put_batch(batch: dict, axes: dict[str, tuple[str, ...]] | None = None) -> dict:
    """Host batch (this process's rows) → global arrays sharded by logical names.

    Every process holds the same number of rows; the global batch is their concatenation in
    process order, and its sharding is derived from that global shape (a local shape could drop
    batch axes that the global batch divides).
    """
    processes = jax.process_count()

    def put(k, v):
        v = np.asarray(v)
        names = (axes or {}).get(k, ("batch", "length")[: v.ndim])
        shape = (v.shape[0] * processes, *v.shape[1:]) if v.ndim else v.shape
        sharding = named_sharding(names, shape)
        if processes > 1 and v.ndim and sharding.is_fully_replicated:
            raise ValueError(
                f"batch[{k!r}]: {shape[0]} rows over {processes} processes, but the batch axes "
                f"{sharding.mesh.shape} do not split them; make the batch size a multiple of them"
            )
        return jax.make_array_from_process_local_data(sharding, v, shape)

    return {k: put(k, v) for k, v in batch.items()}
