"""Attention work per context shard: the (query tile, key tile) pairs each shard computes, the
tiles `ops.blockwise.flash_forward`'s `lax.cond` does not skip (`parallel.zigzag.tiles_per_shard`),
in token order, in zig-zag order, and in the layout `parallel.zigzag.balanced_batch` picks of
the two (what the train loop, the RL learner and the learned reward's scorer place now). A pair
of tiles is computed for every row of a device's batch when any row needs it, so a batch costs
what its longest rows cost; the batch stands for one device's rows.

    PYTHONPATH=. python tools/zigzag_balance.py [--block 512]

Prints a markdown table: the busiest shard's tiles (a step waits for it) and max / mean over the
shards (1.00: perfect balance). Nothing runs on a device: the counts are the kernel's skip
predicate evaluated on the batches' positions and segment ids.
"""

from __future__ import annotations

import argparse

import numpy as np

from posttrain.parallel.zigzag import balanced_batch, tiles_per_shard, zigzag


def right_padded(lengths, length: int) -> dict:
    """Rows of one sequence each, `lengths` real tokens, right-padded to `length`."""
    seg = (np.arange(length)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
    return {"positions": np.where(seg > 0, np.arange(length)[None], 0).astype(np.int32), "segment_ids": seg}


def batches(rng) -> dict:
    """name → (batch, shards): full SFT rows; RL learner batches (256-token prompts, responses up
    to the bucketed length, or ending just past its middle); preference rows of 20-100%."""
    rl = 256 + rng.integers(64, 3841, 64)
    middle = rng.integers(512, 2300, 64)
    return {
        "SFT, 1 full row of 32768": (right_padded([32768], 32768), 8),
        "SFT, 8 full rows of 4096": (right_padded([4096] * 8, 4096), 2),
        "RL learner, 64 rows of 320..4096 in 4096": (right_padded(rl, 4096), 2),
        "RL learner, same rows": (right_padded(rl, 4096), 8),
        "RL learner, 64 rows of 1280..16384 in 16384": (right_padded(rl * 4, 16384), 8),
        "RL learner, 64 rows of 512..2300 in 4096": (right_padded(middle, 4096), 2),
        "RM / DPO, 64 rows of 819..4096 in 4096": (right_padded(rng.integers(819, 4097, 64), 4096), 4),
        "RL learner, 16 rows of 8K..128K in 131072": (right_padded(rng.integers(8192, 131073, 16), 131072), 64),
    }


def cell(tiles: np.ndarray) -> str:
    return f"{tiles.max()} ({tiles.max() / tiles.mean():.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block", type=int, default=512, help="model.attention_block (tile length)")
    args = parser.parse_args()
    print(f"busiest shard's tiles (max / mean), model.attention_block = {args.block}\n")
    print("| batch | shards | token order (RL learner before) | zig-zag (train loop before) | now: chosen |")
    print("|---|---|---|---|---|")
    for name, (batch, n) in batches(np.random.default_rng(0)).items():
        pos, seg = batch["positions"], batch["segment_ids"]
        natural = tiles_per_shard(pos, seg, n, args.block)
        whole = tiles_per_shard(zigzag(pos, n), zigzag(seg, n), n, args.block)
        placed, zigzagged = balanced_batch(batch, n, args.block)
        now = tiles_per_shard(placed["positions"], placed["segment_ids"], n, args.block)
        chosen = "zig-zag" if zigzagged else "token order"
        print(f"| {name} | {n} | {cell(natural)} | {cell(whole)} | {cell(now)}, {chosen} |")


if __name__ == "__main__":
    main()
