"""Device mesh, logical-axis sharding rules, multi-process start and agreement."""

from posttrain.parallel.agreement import Disagreement, agree
from posttrain.parallel.distributed import (
    allgather_json,
    broadcast_json,
    is_primary,
    local_rows,
    maybe_initialize_distributed,
    sync_processes,
)
from posttrain.parallel.mesh import (
    MESH_AXES,
    accelerator_paths,
    make_mesh,
    mesh_and_rules,
    mesh_device_kind,
    mesh_platform,
    resolve_mesh_shape,
)
from posttrain.parallel.sharding import (
    DEFAULT_RULES,
    constrain,
    current,
    decode_rules,
    logical_spec,
    named_sharding,
    parse_rules,
    rules_key,
    shardings_for,
    use_sharding,
)
from posttrain.parallel.zigzag import sequence_shards

__all__ = [
    "DEFAULT_RULES",
    "Disagreement",
    "MESH_AXES",
    "accelerator_paths",
    "agree",
    "allgather_json",
    "broadcast_json",
    "constrain",
    "current",
    "decode_rules",
    "is_primary",
    "local_rows",
    "logical_spec",
    "make_mesh",
    "maybe_initialize_distributed",
    "mesh_and_rules",
    "mesh_device_kind",
    "mesh_platform",
    "named_sharding",
    "parse_rules",
    "resolve_mesh_shape",
    "rules_key",
    "sequence_shards",
    "shardings_for",
    "sync_processes",
    "use_sharding",
]
