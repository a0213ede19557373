"""Examples → rows of the train step's batch format, packed several to a row or one per row.

Row format (every array int32 [seq_len]): `inputs` (tokens), `targets` (inputs shifted left by one
*within* a segment; 0 at a segment's last token), `loss_mask` (1 where the target is a trainable
token), `positions` (0, 1, … restarting in each segment), `segment_ids` (1, 2, … per packed
example, 0 = padding). An example is `{"tokens": int[n], "loss_mask": bool[n]}` with the mask
aligned to the tokens (True where the token is a target), so row `loss_mask[i]` is the example's
`loss_mask[i + 1]`.

Images (`model.vision`, `data.images.ImageSpec`): an example may carry `pixels` (uint8 [k, size,
size, 3], its images in token order), each image standing as `num_patches` placeholder tokens.
Rows then also hold `patches` (float32 [seq_len, patch_dim]): each placeholder's patch at the
placeholder's own position, zeros elsewhere — aligned with `inputs`, so a zig-zag layout or a
sequence-sharded batch moves the patches with their tokens. Rows hold whole examples, so packing
never cuts an image; truncation that would is an error (the record is bad).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from posttrain.data.images import ImageSpec, patches_of

ROW_KEYS = ("inputs", "targets", "loss_mask", "positions", "segment_ids")


def fit_length(example: dict, seq_len: int, *, truncate: bool = False, images: ImageSpec | None = None) -> dict:
    """The example if it fits in `seq_len`, its first `seq_len` tokens if `truncate`, else an error.
    With images (`pixels`) the cut keeps the images before it and must not fall inside one."""
    n = len(example["tokens"])
    if n <= seq_len:
        return example
    if not truncate:
        raise ValueError(f"example of {n} tokens does not fit seq_len={seq_len} (set truncate=True to cut it)")
    out = {"tokens": example["tokens"][:seq_len], "loss_mask": example["loss_mask"][:seq_len]}
    if "pixels" in example:
        if images is None:
            raise ValueError("an example with images needs its ImageSpec to be truncated")
        kept = int(np.count_nonzero(np.asarray(out["tokens"]) == images.token_id))
        if kept % images.num_patches:
            raise ValueError(
                f"example of {n} tokens does not fit seq_len={seq_len}, and cutting it there would cut an image"
            )
        out["pixels"] = example["pixels"][: kept // images.num_patches]
    return out


def build_row(
    examples: Sequence[dict], seq_len: int, *, pad_id: int = 0, images: ImageSpec | None = None
) -> dict[str, np.ndarray]:
    """Lay `examples` (which fit together) side by side in one row, padding the rest; with
    `images`, the row also holds `patches` (see the module's docstring)."""
    row = {k: np.zeros(seq_len, np.int32) for k in ROW_KEYS}
    row["inputs"][:] = pad_id
    if images is not None:
        row["patches"] = np.zeros((seq_len, images.patch_dim), np.float32)
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
        if images is not None:
            place_patches(row["patches"][offset:end], tokens, ex.get("pixels"), images)
        elif "pixels" in ex:
            raise ValueError("an example with images in a row without patches (no ImageSpec)")
        offset = end
    return row


def place_patches(out: np.ndarray, tokens: np.ndarray, pixels, images: ImageSpec) -> None:
    """Write the patches of `pixels` (uint8 [k, size, size, 3]) at the placeholder tokens of
    `tokens`, in order, into `out` [len(tokens), patch_dim]; the counts must agree."""
    slots = np.flatnonzero(tokens == images.token_id)
    px = np.zeros((0,), np.uint8) if pixels is None else np.asarray(pixels, np.uint8)
    k = px.size // (images.image_size**2 * 3)
    if len(slots) != k * images.num_patches:
        raise ValueError(f"{len(slots)} image placeholder tokens for {k} images of {images.num_patches} patches")
    if k:
        patches = patches_of(px.reshape(k, images.image_size, images.image_size, 3), images.patch_size)
        out[slots] = patches.reshape(-1, images.patch_dim)


def pad_example(
    example: dict, seq_len: int, *, pad_id: int = 0, truncate: bool = False, images: ImageSpec | None = None
) -> dict:
    """One example per row (the unpacked alternative to `pack_examples`)."""
    return build_row(
        [fit_length(example, seq_len, truncate=truncate, images=images)], seq_len, pad_id=pad_id, images=images
    )


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
    """Inverse of `example_to_json` for token examples: ids int32, masks bool, pixels uint8."""
    kind = lambda k: np.uint8 if k == "pixels" else bool if "mask" in k else np.int32
    return {k: np.asarray(v, kind(k)) if isinstance(v, list) else v for k, v in example.items()}


def pack_examples(
    examples: Iterable[dict],
    seq_len: int,
    *,
    truncate: bool = False,
    open_rows: int = 8,
    pad_id: int = 0,
    images: ImageSpec | None = None,
) -> Iterator[dict]:
    """Pack examples into rows of `seq_len` (see `Packer`); a longer example is an error unless
    `truncate`, which keeps its first `seq_len` tokens (never part of an image)."""
    packer = Packer(seq_len, open_rows=open_rows)
    for ex in examples:
        for row in packer.add(fit_length(ex, seq_len, truncate=truncate, images=images)):
            yield build_row(row, seq_len, pad_id=pad_id, images=images)
    for row in packer.flush():
        yield build_row(row, seq_len, pad_id=pad_id, images=images)
