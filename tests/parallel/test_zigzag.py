"""Context parallelism's zig-zag layout: one shard count for the layout and the ring, the reward
model's scored token independent of the layout, and the measured balance of attention work."""

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain.core.batch import put_batch
from posttrain.data.packing import build_row
from posttrain.models.reward import RewardModel, last_token_index
from posttrain.ops.context_parallel import sequence_axes
from posttrain.parallel import DEFAULT_RULES, make_mesh, parse_rules, use_sharding
from posttrain.parallel.zigzag import (
    balanced_batch,
    sequence_shards,
    tiles_per_shard,
    zigzag,
    zigzag_batch,
    zigzag_indices,
)
from posttrain.stages import lm
from posttrain.stages.common import PREFERENCE_AXES
from posttrain.stages.reward_model import reward_model_loss
from tests.support.typed_configs import model, run_cfg


def test_the_layout_and_the_ring_take_their_shard_count_from_the_length_rule(tmp_path):
    """`sequence_shards` (the loop's zig-zag) and `sequence_axes` (the ring) agree for any rules:
    a `length` rule over sequence × tensor splits a row 4 ways, one without mesh axes not at all
    (the loop once zig-zagged by mesh.sequence alone: 2 here, while the ring ran over 4)."""
    mesh = make_mesh(dict(data=2, sequence=2, tensor=2))
    for length, want in ((("sequence", "tensor"), (("sequence", "tensor"), 4)), ((), ((), 1))):
        rules = {**DEFAULT_RULES, "length": length}
        assert sequence_shards(mesh, rules) == want
        with use_sharding(mesh, rules):
            assert sequence_axes() == want
    cfg = run_cfg(
        {
            **{"mesh.data": 2, "mesh.sequence": 2, "mesh.tensor": 2, "sharding.rules.length": "sequence,tensor"},
            "train.seq_len": 36,  # divisible by 2 × 2, not by 2 × 4
        },
        workdir=str(tmp_path),
    )
    with pytest.raises(ValueError, match=r"seq_len=36.*mesh.sequence=2, mesh.tensor=2.*4 shards"):
        lm.run(cfg)


def test_last_token_index_finds_the_last_real_token_in_any_order():
    pos = np.array([[0, 1, 2, 0, 0, 0, 0, 0], [0, 1, 0, 1, 2, 3, 0, 0], [0] * 8], np.int32)
    seg = np.array([[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 2, 2, 2, 2, 0, 0], [0] * 8], np.int32)
    assert np.asarray(last_token_index(pos, seg)).tolist() == [2, 5, 0]
    perm = np.random.default_rng(0).permutation(8)
    assert perm[np.asarray(last_token_index(pos[:, perm], seg[:, perm]))][:2].tolist() == [2, 5]


def preference_batch(pairs: int, length: int, rng) -> dict:
    """Right-padded preference rows of different lengths (3 .. length tokens)."""
    out = {}
    for side in ("chosen", "rejected"):
        rows = [
            build_row([{"tokens": rng.integers(1, 64, n), "loss_mask": np.ones(n, bool)}], length)
            for n in rng.integers(3, length + 1, pairs)
        ]
        out.update({f"{side}_{k}": np.stack([r[k] for r in rows]) for k in rows[0]})
    return out


def test_reward_model_loss_on_zigzagged_sequence_shards_equals_one_shard():
    """The Bradley–Terry loss and its metrics with the length over 2 devices, the rows zig-zagged
    as the train loop lays them out, equal the unsharded loss in natural order. The head once read
    index count(real) − 1, which after the zig-zag is another token of every row shorter than
    the whole length."""
    shape = dict(vocab_size=64, embed_dim=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
    m = model(**shape, attention="blockwise", attention_block=4)
    graphdef, state = nnx.split(RewardModel(m, rngs=nnx.Rngs(0)))
    batch = preference_batch(4, 16, np.random.default_rng(0))
    moe = m.moe

    def metrics(sequence):
        mesh, rules = make_mesh(dict(data=1, sequence=sequence), jax.devices()[:sequence]), parse_rules({})
        placed = zigzag_batch(batch, sequence_shards(mesh, rules)[1])
        fn = lambda s, b: reward_model_loss(nnx.merge(graphdef, s), b, moe)[1]
        with use_sharding(mesh, rules):
            return jax.device_get(jax.jit(fn)(state, put_batch(placed, PREFERENCE_AXES)))

    want, got = metrics(1), metrics(2)
    assert want["rm/accuracy"] not in (0.0, 1.0)  # rewards that differ from row to row
    for k in ("loss", "rm/chosen", "rm/rejected", "rm/margin", "rm/accuracy"):
        assert float(got[k]) == pytest.approx(float(want[k]), rel=1e-5, abs=1e-6), k


def test_zigzag_balances_the_attention_tiles_each_shard_computes():
    """Full causal rows: the last of 8 contiguous shards computes 12× the tiles of the first; in
    zig-zag order every shard computes the same number. Rows of different lengths cost what the
    longest costs (a tile pair is computed for every row when one row needs it)."""
    length, n = 1024, 8
    pos, seg = np.broadcast_to(np.arange(length), (2, length)), np.ones((2, length), np.int32)
    natural = tiles_per_shard(pos, seg, n, 32)
    balanced = tiles_per_shard(zigzag(pos, n), zigzag(seg, n), n, 32)
    assert natural.sum() == balanced.sum() == 32 * 33 // 2
    assert natural.tolist() == [(1 + 2 + 3 + 4) + 4 * 4 * i for i in range(n)]
    assert balanced.max() == balanced.min()
    seg[1, 100:] = 0  # a short second row changes nothing
    assert tiles_per_shard(pos, seg, n, 32).tolist() == natural.tolist()


def brute_force_tiles(positions, segment_ids, n, block):
    """`tiles_per_shard` by its definition: every (query tile, key tile) pair's tokens compared, in
    every row (the kernel computes a pair for all rows when any row needs it)."""
    b, length = positions.shape
    s = length // n
    t = min(block, s)
    nb = -(-s // t)

    def tiles(x):
        x = x.reshape(b, n, s)
        return np.concatenate([x, np.zeros((b, n, nb * t - s), x.dtype)], axis=2).reshape(b, n * nb, t)

    pos, seg = tiles(positions), tiles(segment_ids)
    seen = (seg[:, :, None, :, None] == seg[:, None, :, None, :]) & (seg[:, None, :, None, :] != 0)
    seen &= pos[:, None, :, None, :] <= pos[:, :, None, :, None]
    return seen.any(axis=(0, 3, 4)).sum(axis=1).reshape(n, nb).sum(axis=1)


def test_tiles_per_shard_counts_the_tiles_the_kernel_computes_for_packed_rows_in_any_order():
    rng = np.random.default_rng(0)
    for length, n, block in ((64, 2, 4), (96, 4, 5), (128, 8, 3), (64, 2, 64)):
        seg, pos = np.zeros((4, length), np.int32), np.zeros((4, length), np.int32)
        for r in range(4):  # packed segments with padding between and after them
            start, sid = 0, 1
            while start < length:
                m = min(int(rng.integers(1, length // 2)), length - start)
                if rng.random() > 0.2:
                    seg[r, start : start + m], pos[r, start : start + m], sid = sid, np.arange(m), sid + 1
                start += m
        for order in (np.arange(length), zigzag_indices(length, n), rng.permutation(length)):
            got = tiles_per_shard(pos[:, order], seg[:, order], n, block)
            np.testing.assert_array_equal(got, brute_force_tiles(pos[:, order], seg[:, order], n, block))


def test_tiles_per_shard_is_what_the_compiled_ring_computes(monkeypatch):
    """The ring's compiled forward on 4 devices, its tile predicate reported by a debug callback:
    the (query tile, key tile) pairs each device computes equal `tiles_per_shard`, in token order
    (10, 26, 42, 58 pairs) and zig-zagged (34 each)."""
    import jax.numpy as jnp

    import posttrain.ops.blockwise as blockwise
    from posttrain.ops.context_parallel import context_parallel_attention

    length, n, block = 64, 4, 4
    extents = np.array([64, 40, 17])  # row 0 is full: its positions name the query tile's shard
    seg = (np.arange(length)[None] < extents[:, None]).astype(np.int32)
    pos = np.where(seg > 0, np.arange(length), 0).astype(np.int32)
    calls = []
    kernel_visible = blockwise.visible

    def reporting(q_pos, kv_pos, q_seg, kv_seg, causal):
        mask = kernel_visible(q_pos, kv_pos, q_seg, kv_seg, causal)
        jax.debug.callback(lambda p, a: calls.append((int(p[0, 0]), bool(a))), q_pos, mask.any())
        return mask

    monkeypatch.setattr(blockwise, "visible", reporting)
    mesh = make_mesh(dict(data=1, sequence=n), devices=jax.devices()[:n])
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.normal(size=(3, length, h, 8)), jnp.float32) for h in (2, 1))
    attend = jax.jit(lambda q, k, p, s: context_parallel_attention(q, k, k, p, s, mode="ring", block_size=block))
    counts = {}
    for name, (p, s) in {"natural": (pos, seg), "zigzag": (zigzag(pos, n), zigzag(seg, n))}.items():
        calls.clear()
        with use_sharding(mesh, DEFAULT_RULES):
            jax.block_until_ready(attend(q, k, jnp.asarray(p), jnp.asarray(s)))
        shard_of = np.argsort(p[0]) // (length // n)  # position in row 0 -> the shard holding it
        computed = np.bincount([shard_of[first] for first, any_ in calls if any_], minlength=n)
        assert len(calls) == n * n * (length // n // block) ** 2  # every tile of every ring step reported
        np.testing.assert_array_equal(computed, tiles_per_shard(p, s, n, block))
        counts[name] = computed
    assert counts["natural"].tolist() == [10, 26, 42, 58] and counts["zigzag"].tolist() == [34] * n


def test_a_batch_is_zigzagged_only_where_that_lowers_the_busiest_shards_tiles():
    """Full rows zig-zag (busiest of 4 shards: 15 → 9 tiles); rows whose longest ends just past
    the middle stay in token order (7 vs 9 zig-zagged: the middle of the length, the densest part
    of the longest row, would sit on one shard); a preference batch's chosen_ and rejected_ rows
    are counted together (one forward attends over both: the full chosen rows decide) and
    placed together."""

    def rows(lengths, length=64):
        seg = (np.arange(length)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
        return {"positions": np.where(seg > 0, np.arange(length), 0), "segment_ids": seg, "loss_mask": seg}

    full, middle = rows([64, 64]), rows([36, 20])
    placed, zigzagged = balanced_batch(full, 4, 8)
    assert zigzagged and all((placed[k] == zigzag(v, 4)).all() for k, v in full.items())
    assert not balanced_batch(middle, 4, 8)[1] and not balanced_batch(full, 1, 8)[1]
    pairs = lambda rejected: {
        f"{s}_{k}": v for s, b in (("chosen", full), ("rejected", rejected)) for k, v in b.items()
    }
    placed, zigzagged = balanced_batch(pairs(middle), 4, 8)
    assert zigzagged and (placed["rejected_positions"] == zigzag(middle["positions"], 4)).all()
