"""Where each posttrain parameter lives in a Hugging Face checkpoint: tensor names and layouts.

Our parameters are stacked over scan repeats (`stacks/{segment}/blocks/{j}/...`, leading dim =
repeat, see `Decoder.stacks`); a Hugging Face checkpoint stores one tensor per layer (and, in the
published Qwen3-MoE / Mixtral checkpoints, per expert). `param_entries` maps every parameter (per
repeat) to its `Entry`; `read_entry` reads any slice of our layout from the checkpoint and
`hf_tensors` turns one of our arrays back into checkpoint tensors.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator

import numpy as np

from posttrain.config import ModelConfig
from posttrain.models.decoder import layer_kinds, scan_segments

Path = tuple  # a flat nnx state path, e.g. ("stacks", 0, "blocks", 1, "attn", "q")


@dataclasses.dataclass(frozen=True)
class Entry:
    """The Hugging Face tensor(s) behind one of our arrays (one layer's slice for stacked ones).

    A vector (split=0): ours = reshape(w). A matrix: ours = reshape(W.T) when `transpose` (nn.Linear
    stores [out, in]; our first `split` dims are its in-dims), else reshape(W) (our first `split`
    dims are its rows). `experts`: our leading dim is the expert, one matrix each: `names[e]`, or,
    with `rows` = (start, stop, total), rows start:stop of the fused [E, total, cols] tensor
    `names[0]` that current transformers writes.
    """

    names: tuple[str, ...]
    split: int = 0
    transpose: bool = True
    experts: bool = False
    rows: tuple[int, int, int] | None = None


def _vector(name: str) -> Entry:
    return Entry((name,))


def _linear(name: str, split: int) -> Entry:
    return Entry((name,), split)


def param_entries(
    cfg: ModelConfig, arch: str, fused: Callable[[int], bool] = lambda layer: False
) -> dict[Path, tuple[Entry, ...]]:
    """Our flat parameter path → its Entries: one per scan repeat for stacked parameters
    (path[0] == "stacks"), else one. `fused(layer)` says whether that MoE layer's experts are stored
    fused (`mlp.experts.gate_up_proj`) rather than per expert."""
    out = {
        ("embed",): (Entry(("model.embed_tokens.weight",), 1, transpose=False),),
        ("final_norm", "scale"): (_vector("model.norm.weight"),),
    }
    if not cfg.tie_embeddings:
        out[("head",)] = (_linear("lm_head.weight", 1),)
    start = 0
    for s, (kinds, repeats) in enumerate(scan_segments(layer_kinds(cfg))):
        for j, kind in enumerate(kinds):
            layers = [start + r * len(kinds) + j for r in range(repeats)]
            per_layer = [_block_entries(cfg, arch, layer, kind, fused(layer)) for layer in layers]
            for key in per_layer[0]:
                out[("stacks", s, "blocks", j, *key)] = tuple(p[key] for p in per_layer)
        start += len(kinds) * repeats
    return out


def _block_entries(cfg, arch: str, layer: int, kind: str, fused: bool) -> dict[tuple, Entry]:
    """The Entries of one decoder layer, keyed by the path inside a Block."""
    p = f"model.layers.{layer}."
    out = {
        ("attn_norm", "scale"): _vector(p + "input_layernorm.weight"),
        ("mlp_norm", "scale"): _vector(p + "post_attention_layernorm.weight"),
        ("attn", "q"): _linear(p + "self_attn.q_proj.weight", 1),
        ("attn", "k"): _linear(p + "self_attn.k_proj.weight", 1),
        ("attn", "v"): _linear(p + "self_attn.v_proj.weight", 1),
        ("attn", "o"): _linear(p + "self_attn.o_proj.weight", 2),
    }
    if cfg.attention_bias:
        out.update({("attn", f"{n}_bias"): _vector(p + f"self_attn.{n}_proj.bias") for n in "qkv"})
    if cfg.qk_norm:
        out.update({("attn", f"{n}_norm", "scale"): _vector(p + f"self_attn.{n}_norm.weight") for n in "qk"})
    if kind == "dense":
        out.update({("mlp", n): _linear(p + f"mlp.{n}_proj.weight", 1) for n in ("gate", "up", "down")})
    else:
        out.update(_moe_entries(cfg, arch, p, fused))
    return out


def _moe_entries(cfg, arch: str, p: str, fused: bool) -> dict[tuple, Entry]:
    """Router and experts of one MoE layer: per-expert names (Mixtral `block_sparse_moe.experts.{e}.w1`,
    Qwen3-MoE `mlp.experts.{e}.gate_proj`) or the fused [E, 2F, D] / [E, D, F] tensors."""
    num, hidden = cfg.moe.num_experts, cfg.moe.expert_mlp_dim
    if fused:
        gate_up, down = p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"
        return {
            ("mlp", "router"): _linear(p + "mlp.gate.weight", 1),
            ("mlp", "w_gate"): Entry((gate_up,), 1, experts=True, rows=(0, hidden, 2 * hidden)),
            ("mlp", "w_up"): Entry((gate_up,), 1, experts=True, rows=(hidden, 2 * hidden, 2 * hidden)),
            ("mlp", "w_down"): Entry((down,), 1, experts=True, rows=(0, cfg.embed_dim, cfg.embed_dim)),
        }
    module, names = (
        ("block_sparse_moe", ("w1", "w3", "w2"))
        if arch == "MixtralForCausalLM"
        else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    experts = lambda n: Entry(tuple(p + f"{module}.experts.{e}.{n}.weight" for e in range(num)), 1, experts=True)
    return {
        ("mlp", "router"): _linear(p + f"{module}.gate.weight", 1),
        ("mlp", "w_gate"): experts(names[0]),
        ("mlp", "w_up"): experts(names[1]),
        ("mlp", "w_down"): experts(names[2]),
    }


def checkpoint_order(entry: Entry) -> tuple:
    """Sort key putting entries in the usual checkpoint order: embedding, layers, norm, head."""
    name = entry.names[0]
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        return (1, int(m.group(1)), name)
    return ({"model.embed_tokens.weight": 0, "model.norm.weight": 2}.get(name, 3), 0, name)


def expected_shapes(entry: Entry, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """name → the checkpoint shape that our array of `shape` (one layer's slice) needs."""
    if entry.experts:
        inner = _matrix_shape(entry, shape[1:])
        if entry.rows is not None:
            return {entry.names[0]: (shape[0], entry.rows[2], inner[1])}
        return {name: inner for name in entry.names}
    if entry.split == 0:
        return {entry.names[0]: (math.prod(shape),)}
    return {entry.names[0]: _matrix_shape(entry, shape)}


def _matrix_shape(entry: Entry, shape: tuple[int, ...]) -> tuple[int, int]:
    a, b = math.prod(shape[: entry.split]), math.prod(shape[entry.split :])
    return (b, a) if entry.transpose else (a, b)


def _flat_indices(shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """C-order flat indices (into prod(shape)) of the sub-grid `index` selects."""
    ranges = [np.arange(*s.indices(n)) for s, n in zip(index, shape)]
    return np.ravel_multi_index(np.meshgrid(*ranges, indexing="ij"), shape).reshape(-1)


def _hull(flat: np.ndarray) -> tuple[slice, np.ndarray | None]:
    """The contiguous range covering `flat`, and the picks inside it (None when it is exactly that)."""
    lo, hi = int(flat.min()), int(flat.max()) + 1
    return slice(lo, hi), (None if hi - lo == flat.size else flat - lo)


def _read_matrix(
    read: Callable[[slice, slice], np.ndarray], entry: Entry, shape: tuple[int, ...], index: tuple[slice, ...]
) -> np.ndarray:
    """Our `index` slice of a matrix entry, reading only the rows and columns that cover it."""
    a = _flat_indices(shape[: entry.split], index[: entry.split])
    b = _flat_indices(shape[entry.split :], index[entry.split :])
    rows, cols = (b, a) if entry.transpose else (a, b)
    (row_range, row_pick), (col_range, col_pick) = _hull(rows), _hull(cols)
    block = read(row_range, col_range)
    if row_pick is not None:
        block = block[row_pick]
    if col_pick is not None:
        block = block[:, col_pick]
    if entry.transpose:
        block = block.T
    return block.reshape([len(range(*s.indices(n))) for s, n in zip(index, shape)])


def read_entry(
    read: Callable[[str, tuple], np.ndarray], entry: Entry, shape: tuple[int, ...], index: tuple[slice, ...], dtype
) -> np.ndarray:
    """The `index` slice (a tuple of slices, as `jax.make_array_from_callback` passes) of our array
    of `shape` as `dtype`, read through `read(name, checkpoint index)` one expert at a time."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    if entry.split == 0:
        flat = _flat_indices(shape, index)
        span, pick = _hull(flat)
        data = read(entry.names[0], (span,))
        data = data if pick is None else data[pick]
        return np.asarray(data.reshape([len(range(*s.indices(n))) for s, n in zip(index, shape)]), dtype)
    if not entry.experts:
        return np.asarray(_read_matrix(lambda r, c: read(entry.names[0], (r, c)), entry, shape, index), dtype)
    experts = range(*index[0].indices(shape[0]))
    out = np.empty([len(experts)] + [len(range(*s.indices(n))) for s, n in zip(index[1:], shape[1:])], dtype)
    for i, e in enumerate(experts):
        if entry.rows is None:
            reader = lambda r, c, e=e: read(entry.names[e], (r, c))
        else:
            start = entry.rows[0]
            reader = lambda r, c, e=e: read(entry.names[0], (e, slice(r.start + start, r.stop + start), c))
        out[i] = _read_matrix(reader, entry, shape[1:], index[1:])
    return out


def hf_tensors(entry: Entry, array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint tensors (per-expert layout) of one of our arrays (one layer's slice)."""

    def matrix(a):
        m = a.reshape(math.prod(a.shape[: entry.split]), -1)
        return np.ascontiguousarray(m.T if entry.transpose else m)

    if entry.experts:
        for e, name in enumerate(entry.names):
            yield name, matrix(array[e])
    elif entry.split == 0:
        yield entry.names[0], np.ascontiguousarray(array.reshape(-1))
    else:
        yield entry.names[0], matrix(array)
