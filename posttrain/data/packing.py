"""Examples → rows of the train step's batch format, packed several to a row or one per row.

Row format (every array int32 [seq_len]): `inputs` (tokens), `targets` (inputs shifted left by one
*within* a segment; 0 at a segment's last token), `loss_mask` (1 where the target is a trainable
token), `positions` (0, 1, … restarting in each segment), `segment_ids` (1, 2, … per packed
example, 0 = padding). An example is `{"tokens": int[n], "loss_mask": bool[n]}` with the mask
aligned to the tokens (True where the token is a target), so row `loss_mask[i]` is the example's
`loss_mask[i + 1]`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

ROW_KEYS = ("inputs", "targets", "loss_mask", "positions", "segment_ids")


def fit_length(example: dict, seq_len: int, *, truncate: bool = False) -> dict:
    """The example if it fits in `seq_len`, its first `seq_len` tokens if `truncate`, else an error."""
    n = len(example["tokens"])
    if n <= seq_len:
        return example
    if not truncate:
        raise ValueError(f"example of {n} tokens does not fit seq_len={seq_len} (set truncate=True to cut it)")
    return {"tokens": example["tokens"][:seq_len], "loss_mask": example["loss_mask"][:seq_len]}


def build_row(examples: Sequence[dict], seq_len: int, *, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Lay `examples` (which fit together) side by side in one row, padding the rest."""
    row = {k: np.zeros(seq_len, np.int32) for k in ROW_KEYS}
    row["inputs"][:] = pad_id
    offset = 0
    for segment, ex in enumerate(examples, start=1):
        tokens, mask = np.asarray(ex["tokens"], np.int32), np.asarray(ex["loss_mask"], bool)
        n = len(tokens)
        if offset + n > seq_len:
            raise ValueError(f"examples of {offset + n} tokens in all do not fit seq_len={seq_len}")
        end = offset + n
        row["inputs"][offset:end] = tokens
        row["targets"][offset : end - 1] = tokens[1:]
        row["loss_mask"][offset : end - 1] = mask[1:]
        row["positions"][offset:end] = np.arange(n)
        row["segment_ids"][offset:end] = segment
        offset = end
    return row


def pad_example(example: dict, seq_len: int, *, pad_id: int = 0, truncate: bool = False) -> dict:
    """One example per row (the unpacked alternative to `pack_examples`)."""
    return build_row([fit_length(example, seq_len, truncate=truncate)], seq_len, pad_id=pad_id)


def stack_rows(rows: Sequence[dict], num_rows: int, empty: dict) -> dict[str, np.ndarray]:
    """Rows → a batch `[num_rows, ...]` per key; missing rows (end of data) are `empty`."""
    if len(rows) > num_rows:
        raise ValueError(f"{len(rows)} rows for a batch of {num_rows}")
    rows = list(rows) + [empty] * (num_rows - len(rows))
    return {k: np.stack([r[k] for r in rows]) for k in empty}


class Packer:
    """First-fit packing with a bounded number of open rows — deterministic and checkpointable.

    An example goes into the first open row with room; when none has room and `open_rows` rows are
    open, the fullest is closed (returned) to make space. A row that fills exactly is closed at
    once. The state is the open rows' examples, so a restored packer continues identically.
    """

    def __init__(self, seq_len: int, *, open_rows: int = 8):
        if open_rows < 1:
            raise ValueError(f"open_rows={open_rows}: need at least 1")
        self.seq_len = seq_len
        self.open_rows = open_rows
        self._rows: list[list[dict]] = []
        self._used: list[int] = []

    def add(self, example: dict) -> list[list[dict]]:
        """Place one example (at most seq_len tokens); returns the rows this closed (0 or 1)."""
        n = len(example["tokens"])
        if n > self.seq_len:
            raise ValueError(f"example of {n} tokens does not fit seq_len={self.seq_len}")
        closed = []
        slot = next((i for i, used in enumerate(self._used) if used + n <= self.seq_len), None)
        if slot is None:
            if len(self._rows) == self.open_rows:
                closed.append(self._close(int(np.argmax(self._used))))
            self._rows.append([])
            self._used.append(0)
            slot = len(self._rows) - 1
        self._rows[slot].append(example)
        self._used[slot] += n
        if self._used[slot] == self.seq_len:
            closed.append(self._close(slot))
        return closed

    def _close(self, i: int) -> list[dict]:
        self._used.pop(i)
        return self._rows.pop(i)

    def flush(self) -> list[list[dict]]:
        """Close and return every open row (end of data)."""
        rows, self._rows, self._used = self._rows, [], []
        return rows

    def get_state(self) -> dict:
        """The open rows' examples, JSON-serialisable."""
        return {"rows": [[example_to_json(e) for e in row] for row in self._rows]}

    def set_state(self, state: dict) -> None:
        """Restore open rows saved by `get_state`."""
        self._rows = [[example_from_json(e) for e in row] for row in state["rows"]]
        self._used = [sum(len(e["tokens"]) for e in row) for row in self._rows]


def example_to_json(example: dict) -> dict:
    """An example's arrays as lists (for iterator state); other values are kept."""
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in example.items()}


def example_from_json(example: dict) -> dict:
    """Inverse of `example_to_json` for token examples: ids int32, masks bool."""
    return {
        k: np.asarray(v, bool if "mask" in k else np.int32) if isinstance(v, list) else v for k, v in example.items()
    }


def pack_examples(
    examples: Iterable[dict], seq_len: int, *, truncate: bool = False, open_rows: int = 8, pad_id: int = 0
) -> Iterator[dict]:
    """Pack examples into rows of `seq_len` (see `Packer`); a longer example is an error unless
    `truncate`, which keeps its first `seq_len` tokens."""
    packer = Packer(seq_len, open_rows=open_rows)
    for ex in examples:
        for row in packer.add(fit_length(ex, seq_len, truncate=truncate)):
            yield build_row(row, seq_len, pad_id=pad_id)
    for row in packer.flush():
        yield build_row(row, seq_len, pad_id=pad_id)
