"""Attention kernels against the reference: blockwise (one device), ring and all-gather context
parallelism (8 simulated devices), the zig-zag layout, memory from compiled programs, and the
`model.attention` / `model.context_parallel` switches."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.models.attention import attention_mask, dot_product_attention
from posttrain.ops.blockwise import blockwise_attention, visible
from posttrain.ops.context_parallel import context_parallel_attention
from posttrain.parallel import DEFAULT_RULES, make_mesh, use_sharding
from posttrain.parallel.zigzag import unzigzag, visible_pairs_per_shard, zigzag, zigzag_batch

B, S, H, K, D = 2, 48, 4, 2, 8
BLOCK = 5  # divides neither S nor the per-device chunks (6, 12)


def packed_rows(b, s, cuts):
    """Segment ids and restarting positions for rows cut at `cuts` (row: [(start, segment id)])."""
    seg = np.zeros((b, s), np.int32)
    for r, row_cuts in enumerate(cuts):
        for (start, sid), (end, _) in zip(row_cuts, row_cuts[1:] + [(s, 0)]):
            seg[r, start:end] = sid
    pos = np.zeros((b, s), np.int32)
    for r in range(b):
        for i in range(1, s):
            pos[r, i] = 0 if seg[r, i] != seg[r, i - 1] else pos[r, i - 1] + 1
    return jnp.asarray(pos), jnp.asarray(seg)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    # Row 0: two packed segments then padding (segment 0); row 1: two segments.
    pos, seg = packed_rows(B, S, [[(0, 1), (15, 2), (40, 0)], [(0, 1), (20, 3)]])
    return arr(B, S, H, D), arr(B, S, K, D), arr(B, S, K, D), arr(B, S, H, D), pos, seg


def value_and_grads(attend, q, k, v, w):
    """(out, (dq, dk, dv)) of sum(attend(q, k, v) · w) in one program."""
    f = lambda q, k, v: (lambda o: ((o * w).sum(), o))(attend(q, k, v))
    (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


_REFERENCE = {}


def reference_outputs(data, causal):
    """The reference attention's output and q/k/v gradients (computed once per mask kind)."""
    if causal not in _REFERENCE:
        q, k, v, w, pos, seg = data
        mask = visible(pos, pos, seg, seg, causal)[:, None]
        _REFERENCE[causal] = value_and_grads(lambda q, k, v: dot_product_attention(q, k, v, mask), q, k, v, w)
    return _REFERENCE[causal]


def assert_close(got, want):
    out, grads = got
    np.testing.assert_allclose(out, want[0], rtol=1e-5, atol=2e-6)
    for name, a, r in zip("qkv", grads, want[1]):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=5e-6, err_msg=f"d{name}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_blockwise_matches_reference(data, causal):
    q, k, v, w, pos, seg = data
    want = reference_outputs(data, causal)
    attend = lambda q, k, v: blockwise_attention(q, k, v, pos, pos, seg, seg, causal=causal, block_size=BLOCK)
    assert_close(jax.jit(value_and_grads, static_argnums=0)(attend, q, k, v, w), want)
    assert float(jnp.abs(want[0][0, 40:]).max()) == 0.0  # padding rows see nothing: zeros


MESHES = [dict(sequence=8), dict(sequence=4, tensor=2)]


CASES = [(True, s, m) for s in MESHES for m in ("ring", "all_gather")] + [
    (False, MESHES[0], "ring"),
    (False, MESHES[1], "all_gather"),
]


@pytest.mark.parametrize(
    "causal,sizes,mode",
    CASES,
    ids=lambda x: (
        x
        if isinstance(x, str)
        else ",".join(f"{k}={v}" for k, v in x.items())
        if isinstance(x, dict)
        else ("causal" if x else "full")
    ),
)
def test_context_parallel_matches_reference(data, causal, sizes, mode):
    q, k, v, w, pos, seg = data
    want = reference_outputs(data, causal)
    n = sizes["sequence"]
    z = lambda x: zigzag(x, n)

    def attend(q, k, v):  # zig-zag order inside, original order outside
        out = context_parallel_attention(z(q), z(k), z(v), z(pos), z(seg), mode=mode, causal=causal, block_size=BLOCK)
        return unzigzag(out, n)

    with use_sharding(make_mesh(dict(data=1, **sizes)), DEFAULT_RULES):
        got = jax.jit(value_and_grads, static_argnums=0)(attend, q, k, v, w)
    assert_close(got, want)


def test_zigzag_layout_round_trips_and_balances_causal_work():
    n, length = 8, 1024
    batch = {
        "inputs": np.arange(2 * length).reshape(2, length),
        "loss_mask": np.ones((2, length)),
        "positions": np.broadcast_to(np.arange(length), (2, length)),
        "step": np.int32(3),
    }
    z = zigzag_batch(batch, n)
    assert z["step"] == 3
    np.testing.assert_array_equal(z["inputs"][0, : length // 16], np.arange(length // 16))  # chunk 0 ...
    np.testing.assert_array_equal(z["inputs"][0, length // 16 : length // 8], np.arange(15 * 64, 1024))  # ... and 15
    np.testing.assert_array_equal(unzigzag(z["inputs"], n), batch["inputs"])
    balanced = visible_pairs_per_shard(z["positions"], n)
    contiguous = visible_pairs_per_shard(batch["positions"], n)
    assert balanced.sum() == contiguous.sum() == 2 * length * (length + 1) // 2
    assert balanced.max() / balanced.min() < 1.10
    assert contiguous.max() / contiguous.min() > 10  # what the layout fixes
    with pytest.raises(ValueError, match="divisible by 16"):
        zigzag(np.zeros((1, 40)), n)


def compiled_grad(attend, length, mesh=None, heads=(4, 2), dim=16, batch=1):
    """The compiled gradient program of sum(attend(q, k, v, pos, seg)) at `length`."""
    h, kv = heads
    sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    ints = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    loss = lambda q, k, v, pos, seg: attend(q, k, v, pos, seg).sum()
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    args = (sd(batch, length, h, dim), sd(batch, length, kv, dim), sd(batch, length, kv, dim), ints, ints)
    if mesh is None:
        return fn.lower(*args).compile()
    with use_sharding(mesh, DEFAULT_RULES):
        return fn.lower(*args).compile()


def square_buffers(hlo_text: str, length: int) -> list[str]:
    """f32 shapes in the HLO with two dimensions of at least `length`: an L×L score buffer."""
    return [
        s for s in re.findall(r"f32\[([\d,]+)\]", hlo_text) if sum(int(d) >= length for d in s.split(",") if d) >= 2
    ]


def test_blockwise_memory_grows_linearly_with_length():
    blockwise = lambda q, k, v, pos, seg: blockwise_attention(q, k, v, pos, pos, seg, seg, block_size=128)
    reference = lambda q, k, v, pos, seg: dot_product_attention(q, k, v, attention_mask(seg, pos))
    temps = {}
    for name, fn in (("blockwise", blockwise), ("reference", reference)):
        for length in (1024, 2048):
            compiled = compiled_grad(fn, length)
            temps[name, length] = compiled.memory_analysis().temp_size_in_bytes
            if name == "blockwise":
                assert not square_buffers(compiled.as_text(), length)
    assert temps["blockwise", 2048] / temps["blockwise", 1024] < 2.2
    assert temps["reference", 2048] / temps["reference", 1024] > 3.5  # the L² it replaces
    assert temps["blockwise", 2048] < temps["reference", 2048] / 20


def over_layers(attend, layers: int = 2):
    """attend applied `layers` times under `lax.scan`, as the decoder runs its layers: positions,
    segment ids, keys and values are loop-invariant inputs of the scan, the queries its carry."""
    return lambda q, k, v, pos, seg: jax.lax.scan(
        lambda x, _: (attend(x, k, v, pos, seg), None), q, None, length=layers
    )[0]


@pytest.mark.parametrize("mode", ["blockwise", "ring"])
def test_memory_stays_linear_under_a_layer_scan(mode):
    """Under `grad` of a scan over layers, JAX's partial evaluation hoists what depends only on
    loop-invariant inputs out of the loop; the tile masks (built from integer positions) and their
    `lax.cond` branch values were hoisted as residuals stacked over every (q block, kv block)
    tile, O(L²) memory. The kernels tie the masks to q (`ops.blockwise._tie_masks_to`)."""
    if mode == "blockwise":
        fn, mesh, lengths = (
            (lambda q, k, v, pos, seg: blockwise_attention(q, k, v, pos, pos, seg, seg, block_size=128)),
            None,
            (1024, 2048),
        )
    else:
        fn = lambda q, k, v, pos, seg: context_parallel_attention(q, k, v, pos, seg, mode="ring", block_size=128)
        mesh, lengths = make_mesh(dict(data=2, sequence=4)), (4096, 8192)
    temps = {}
    for length in lengths:
        compiled = compiled_grad(over_layers(fn), length, mesh, batch=1 if mesh is None else 2)
        temps[length] = compiled.memory_analysis().temp_size_in_bytes
        tiles = [
            s
            for s in re.findall(r"(?:f32|pred)\[([\d,]+)\]", compiled.as_text())
            if s.endswith("128,128") and len(s.split(",")) >= 7
        ]
        assert not tiles, f"{mode}: stacked score tiles {tiles[:3]}"
    assert temps[lengths[1]] / temps[lengths[0]] < 2.2, temps


def test_ring_memory_falls_with_sequence_shards():
    """Per-device temporaries at a fixed total length as `sequence` grows 4 → 8 (each device holds
    one row's L/n chunk; at 2 the per-tile scratch weighs more); all-gather keeps whole-length K/V
    and so holds more."""
    length = 4096
    mesh = lambda n: make_mesh(dict(data=8 // n, sequence=n))
    programs = {
        (mode, n): compiled_grad(
            lambda q, k, v, pos, seg: context_parallel_attention(q, k, v, pos, seg, mode=mode, block_size=64),
            length,
            mesh(n),
            batch=8 // n,
        )
        for mode, n in [("ring", 4), ("ring", 8), ("all_gather", 8)]
    }
    temps = {key: c.memory_analysis().temp_size_in_bytes for key, c in programs.items()}
    assert temps["ring", 8] < 0.6 * temps["ring", 4], temps
    assert temps["all_gather", 8] > 1.5 * temps["ring", 8]
    # The partitioned programs: no ring device holds a whole-length array; all-gather does (K/V).
    whole = lambda c: re.findall(rf"[fs]32\[[\d,]*\b{length}\b[\d,]*\]", c.as_text())
    assert not whole(programs["ring", 8]) and whole(programs["all_gather", 8])
