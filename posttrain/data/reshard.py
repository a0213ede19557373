"""Data-iterator states across process counts: the rule for resuming on another topology.

A checkpoint holds one iterator state per process (`{"processes": [state_0, state_1, ...]}`).
Resumed with the same process count, process i takes state i and reads exactly the batches of the
uninterrupted run. Resumed with another count, each process recomputes its slice from the
*global* read position:

- Process p of n reads records p, p + n, p + 2n, ... of each shuffled epoch (`iterator.process_records`),
  so old process p's read index j is global record `j·n + p`. The global position is the
  smallest next record over the old processes: `min_p(next_index_p) · n_old` (they differ only
  when some process skipped bad records; the records a process had read past the minimum are read
  again, never dropped).
- New process q of m starts at the first record of its slice at or after that position: in epoch
  e at offset k, its read index is `e · L_m + ceil(max(k - q, 0) / m)`, `L_m = len // m`.
- Examples the old processes had read but not yet put in a batch (carried-over and open packed
  rows) are dealt round-robin to the new processes and re-added before anything new is read.
- The counters (skipped, truncated, deferred) go to process 0, which logs them.

The global order of later batches then follows the new process count (with `data.packing` the
rows a process packs depend on its slice), so the losses after such a resume are not those of
the uninterrupted run; with the same count they are.
"""

from __future__ import annotations

import math

COUNTERS = ("skipped", "truncated", "deferred")
SLICE_KEYS = ("process_index", "process_count")


def unread_examples(state: dict) -> list[dict]:
    """Examples (JSON form) a state's batcher holds: waiting rows, then open packed rows."""
    batcher = state["batcher"]
    rows = batcher["rows"] + ((batcher.get("packer") or {}).get("rows") or [])
    return [e for row in rows for e in row] + list(state.get("readd", []))


def global_position(states: list[dict]) -> tuple[int, int]:
    """(epoch, offset within the shuffled epoch) of the first record not read by every old process."""
    count = states[0]["fingerprint"]["process_count"]
    if len(states) != count:
        raise ValueError(f"data iterator states: {len(states)} saved for process_count={count}")
    epoch_len = sum(states[0]["fingerprint"]["records"]) // count  # records per process per epoch
    epoch, k = divmod(min(s["grain"]["next_index"] for s in states), epoch_len)
    return epoch, k * count


def state_for_process(states: list[dict], process_index: int, process_count: int) -> dict:
    """This process's iterator state from the per-process states a checkpoint holds (see the
    module docstring for the rule when `process_count` differs from theirs)."""
    if len(states) == process_count:
        return states[process_index]
    if "fingerprint" not in states[0]:  # a global state (e.g. synthetic batches: the step)
        return states[0]
    epoch, offset = global_position(states)
    fingerprint = {**states[0]["fingerprint"], "process_index": process_index, "process_count": process_count}
    epoch_len = sum(fingerprint["records"]) // process_count
    next_index = epoch * epoch_len + math.ceil(max(offset - process_index, 0) / process_count)
    unread = [e for s in states for e in unread_examples(s)]
    first = states[0]
    packer = first["batcher"].get("packer")
    state = {
        **first,
        "fingerprint": fingerprint,
        "grain": {**first["grain"], "next_index": next_index},
        "consumed": next_index,
        "readd": unread[process_index::process_count],
        "batcher": {"rows": [], "packer": {"rows": []} if packer is not None else None},
    }
    for key in COUNTERS:
        state[key] = sum(s.get(key, 0) for s in states) if process_index == 0 else 0
    return state
