"""Ahead-of-time compilation for TPU topologies that are not attached: abstract devices, chip
facts, and what a compiled program costs (memory, FLOPs, collective bytes from its optimized HLO).

With `libtpu` installed beside jax (`pip install -e '.[tpu]'`), the TPU compiler runs on any host:
`jax.experimental.topologies.get_topology_desc` describes a slice as abstract devices, a mesh over
them compiles programs exactly as a pod would, and nothing is allocated.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class Chip:
    """Published per-chip facts of a TPU generation (bf16 peak, HBM size and bandwidth, ICI
    bandwidth per chip). A chip has 2 ICI links per torus dimension (one to each neighbour);
    `link_bytes_per_s` is one of them: what a ring's hop to its neighbour can use."""

    hbm_bytes: float
    peak_flops: float  # bf16 FLOP/s
    ici_bytes_per_s: float  # all ICI links of one chip together, one direction
    cores_per_chip: int  # TensorCores the slice name counts (v4/v5p: 2, megacore)
    dims: int  # torus dimensions
    hbm_bytes_per_s: float = 0.0  # HBM bandwidth
    dcn_bytes_per_s: float = 0.0  # data-center network between slices, per chip (0: not published)

    @property
    def links(self) -> int:
        """ICI links of one chip: one to each neighbour along every torus dimension."""
        return 2 * self.dims

    @property
    def link_bytes_per_s(self) -> float:
        """One link's bandwidth (one direction): the chip's ICI bandwidth over its links."""
        return self.ici_bytes_per_s / self.links


CHIPS = {
    "v4": Chip(32e9, 275e12, 2400e9 / 8, 2, 3, 1228e9),
    # DCN per chip from the Cloud TPU docs: v5p "DCN bandwidth per chip 50 Gbps"; v5e "2 x 100 Gbps
    # NIC" per host of 8 chips (6.4 Tbps per 256-chip pod), 25 Gbps
    "v5e": Chip(16e9, 197e12, 1600e9 / 8, 1, 2, 819e9, 25e9 / 8),
    "v5p": Chip(95e9, 459e12, 4800e9 / 8, 2, 3, 2765e9, 50e9 / 8),
    "v6e": Chip(32e9, 918e12, 3584e9 / 8, 1, 2, 1640e9),
}

COLLECTIVES = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce", "collective-permute")


def parse_topology(name: str) -> tuple[str, str]:
    """(generation, topology name for `get_topology_desc`) from 'v5p:4x4x4' or a slice name like
    'v5p-128' (Cloud TPU naming: TensorCores for v4/v5p, i.e. 64 chips; chips for v5e/v6e)."""
    m = re.fullmatch(r"(v4|v5e|v5p|v6e)(?::(\d+(?:x\d+)+)|-(\d+))", name.strip())
    if not m:
        raise ValueError(f"topology {name!r}: expected e.g. 'v5p:2x2x1' or 'v5p-128' (generations {sorted(CHIPS)})")
    gen, shape, cores = m.groups()
    chip = CHIPS[gen]
    if shape:
        if len(shape.split("x")) != chip.dims:
            raise ValueError(
                f"topology {name!r}: {gen} slices are {chip.dims}-D (e.g. {'2x2x1' if chip.dims == 3 else '2x2'})"
            )
        return gen, f"{gen}:{shape}"
    chips = int(cores) // chip.cores_per_chip
    if chips < 1 or chips & (chips - 1):
        raise ValueError(f"topology {name!r}: expected a power-of-two slice size")
    dims = [1] * chip.dims
    i = 0
    while math.prod(dims) < chips:  # grow the torus evenly: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...
        dims[i % chip.dims] *= 2
        i += 1
    dims = sorted(dims, reverse=1 in dims)  # 2x2x1, 2x2x2, 2x2x4, 2x4x4, ... as Cloud TPU names them
    return gen, f"{gen}:{'x'.join(map(str, dims))}"


def tpu_devices(topology: str) -> list:
    """Abstract TPU devices of a slice (see `parse_topology`); needs libtpu, not a TPU."""
    from jax.experimental import topologies

    _, name = parse_topology(topology)
    # libtpu takes a machine-wide lock meant for real chips; compiling only, several processes
    # (a test run beside a compile plan) may load it
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)


def libtpu_available() -> bool:
    """Whether the TPU compiler (libtpu) is installed, so TPU programs can be compiled here."""
    return importlib.util.find_spec("libtpu") is not None


def shard_bytes(tree: Any) -> int:
    """Per-device bytes of a pytree of sharded arrays or ShapeDtypeStructs (largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shape) * jax.numpy.dtype(x.dtype).itemsize
    return total


# --- collectives in optimized HLO -------------------------------------------------------------

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
_SHAPE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLEE = re.compile(r"\b(?:body|calls|to_apply|branch_computations)=\{?(%?[\w.\-]+(?:,\s*%?[\w.\-]+)*)\}?")


def _bytes_of(text: str) -> int:
    return sum(
        _DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in _SHAPE.findall(text)
    )


def _collective_kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVES and not opcode.endswith("-done") else None


def _parse_hlo(hlo_text: str) -> tuple[dict[str, list[tuple[str, str, str, str]]], str | None]:
    """Computations of an HLO module → their instructions (name, result type, opcode, rest)."""
    comps: dict[str, list] = {}
    entry, name = None, None
    for line in hlo_text.splitlines():
        head = _HEADER.match(line)
        if head and not line.startswith(" "):
            name = head.group(2)
            comps[name] = []
            entry = name if head.group(1) else entry
        elif name is not None and line.startswith(" "):
            op = _OP.match(line)
            if op:
                comps[name].append(op.groups())
    return comps, entry


def _trip_count(condition: list[tuple[str, str, str, str]]) -> int | None:
    """N of a counted loop whose condition is `i < N` with N a constant; None when data-dependent."""
    constants = {n: rest for n, _, op, rest in condition if op == "constant"}
    for _, _, op, rest in condition:
        if op == "compare" and "direction=LT" in rest:
            for operand in re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0]):
                if operand in constants:
                    return int(constants[operand].split(")", 1)[0])
    return None


def collective_bytes(hlo_text: str) -> tuple[dict[str, int], bool]:
    """Bytes per device moved by each kind of collective in one run of an optimized HLO module.

    Each collective counts its full-size buffer: the result of an all-gather, all-to-all,
    all-reduce or collective-permute, the operand of a reduce-scatter; a ragged all-to-all counts
    the rows it may send (its input: every local assignment; the receive buffer is a bound). Loop
    bodies count once per trip of every enclosing counted loop (a scan over layers runs its body
    once per layer). Returns
    the counts and whether some loop was not counted (a data-dependent decode loop: its body is
    counted once, i.e. per iteration).
    """
    counts, loops = _count_collectives(hlo_text)
    return counts, bool(loops)


def loop_iteration_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes per device moved by each kind of collective in one iteration of the module's
    data-dependent loops (a sampler's decode loop: per token), nested counted loops (the scan
    over layers) times their trip counts; outermost such loops only, summed."""
    return _count_collectives(hlo_text)[1]


def _count_collectives(hlo_text: str) -> tuple[dict[str, int], dict[str, int]]:
    """(`collective_bytes`'s counts, `loop_iteration_bytes`'s); see those."""
    comps, entry = _parse_hlo(hlo_text)
    types = {n: t for instrs in comps.values() for n, t, _, _ in instrs}
    uncounted: dict[str, set[str]] = {}  # body of a data-dependent loop → the computations it calls
    memo: dict[str, dict[str, int]] = {}

    def total(comp: str) -> dict[str, int]:
        if comp in memo:
            return memo[comp]
        out = memo[comp] = dict.fromkeys(COLLECTIVES, 0)
        for _, result, opcode, rest in comps.get(comp, []):
            kind = _collective_kind(opcode)
            operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
            if opcode == "ragged-all-to-all":  # the rows it sends (its output is a bound)
                out["all-to-all"] += _bytes_of(types.get(operands[0], ""))
            elif kind == "reduce-scatter":
                out[kind] += sum(_bytes_of(types.get(o, "")) for o in operands)
            elif kind:
                out[kind] += _bytes_of(result)
            if opcode.endswith("-done") or opcode == "async-update":
                continue  # the -start already counted the called computation
            trips = 1
            callees = [
                c
                for group in _CALLEE.findall(rest)
                for c in re.findall(r"%?([\w.\-]+)", group)
                if c in comps and c != comp
            ]
            if opcode == "while":
                cond = re.search(r"condition=%?([\w.\-]+)", rest)
                n = _trip_count(comps.get(cond.group(1), [])) if cond else None
                body = re.search(r"body=%?([\w.\-]+)", rest)
                if n is None and body:
                    uncounted[body.group(1)] = _reachable(comps, body.group(1))
                trips = n or 1
            for callee in callees:
                for k, v in total(callee).items():
                    out[k] += trips * v
        return out

    counts = total(entry) if entry else dict.fromkeys(COLLECTIVES, 0)
    per_iteration = dict.fromkeys(COLLECTIVES, 0)
    for body in uncounted:
        if not any(body in inner for other, inner in uncounted.items() if other != body):
            for k, v in total(body).items():
                per_iteration[k] += v
    return counts, {k: v for k, v in per_iteration.items() if uncounted}


def _reachable(comps: dict[str, list], comp: str) -> set[str]:
    """The computations `comp` calls, directly or not."""
    seen, todo = set(), [comp]
    while todo:
        for _, _, _, rest in comps.get(todo.pop(), []):
            for group in _CALLEE.findall(rest) + re.findall(r"condition=(%?[\w.\-]+)", rest):
                for c in re.findall(r"%?([\w.\-]+)", group):
                    if c in comps and c not in seen:
                        seen.add(c)
                        todo.append(c)
    return seen
