"""The checkpointable batch iterator under every grain pipeline (`data/pipeline.py`): grain's indexed
read position, then packing and batching, both in `get_state`; this process's slice of each epoch."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Required, TypedDict

import grain
import numpy as np

from posttrain.data.packing import Packer, example_from_json, example_to_json
from posttrain.data.sources import DataError, JsonlSource, RawLine, SkipLog, parse_line
from posttrain.data.tokenizer import Tokenizer
from posttrain.errors import UserError

STATE_VERSION = 1


LENGTH_KEYS = ("seq_len", "final_seq_len", "max_len")  # what stages of a seq_len schedule may change


class Loaded(NamedTuple):
    """A record after the map step: its example, or why it is bad."""

    where: str  # "path:line"
    example: dict | None
    error: str | None = None
    truncated: bool = False


class Batcher:
    """Groups examples into rows (via a `Packer`, or one per row) and rows into batches."""

    def __init__(self, num_rows: int, collate: Callable[[list[list[dict]]], Any], packer: Packer | None = None):
        self.num_rows, self.collate, self.packer = num_rows, collate, packer
        self._rows: list[list[dict]] = []

    def add(self, example: dict) -> None:
        """Take one example; rows it completes wait for `take`."""
        self._rows += self.packer.add(example) if self.packer else [[example]]

    def ready(self) -> bool:
        """Whether a full batch of rows is waiting."""
        return len(self._rows) >= self.num_rows

    def finish(self) -> bool:
        """End of data: close open rows; whether a (last, partial) batch remains."""
        if self.packer:
            self._rows += self.packer.flush()
        return bool(self._rows)

    def take(self) -> Any:
        """The next batch (the last one may be partial; `collate` decides how to fill it)."""
        rows, self._rows = self._rows[: self.num_rows], self._rows[self.num_rows :]
        return self.collate(rows)

    def get_state(self) -> dict:
        """Waiting rows and open packed rows, JSON-serialisable."""
        return {
            "rows": [[example_to_json(e) for e in row] for row in self._rows],
            "packer": self.packer.get_state() if self.packer else None,
        }

    def set_state(self, state: dict) -> None:
        """Restore what `get_state` saved."""
        self._rows = [[example_from_json(e) for e in row] for row in state["rows"]]
        if self.packer:
            self.packer.set_state(state["packer"])

    def pending(self) -> list[dict]:
        """Every example taken but not yet in a batch, in the order they were added to rows."""
        open_rows = self.packer.get_state()["rows"] if self.packer else []
        return [e for row in self._rows for e in row] + [example_from_json(e) for row in open_rows for e in row]


class BatchIterator:
    """What trainers iterate: this process's rows of each global batch, plus resumable state.

    `skipped` (bad records, with on_error="skip"), `truncated` (with truncate=True) and `deferred`
    (longer than this stage of a staged-context run allows) are counts for the trainer to log as
    `data/skipped`, `data/truncated` and `data/deferred`; `epoch` is the current pass over this
    process's records.
    """

    def __init__(
        self,
        dataset: grain.MapDataset,
        batcher: Batcher,
        *,
        on_error: str,
        fingerprint: dict,
        epoch_len: int,
        read_threads: int = 1,
    ):
        self._it = iter(
            dataset.to_iter_dataset(
                grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=64 * max(read_threads, 1))
            )
        )
        self._batcher = batcher
        self._skips = SkipLog(on_error)
        self._fingerprint = fingerprint
        self._epoch_len = epoch_len
        self._consumed = 0
        self.truncated = 0
        self.deferred = 0

    @property
    def skipped(self) -> int:
        """Bad records skipped so far (on_error="skip")."""
        return self._skips.skipped

    @property
    def epoch(self) -> int:
        """Passes completed over this process's records (0 during the first)."""
        return self._consumed // self._epoch_len

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> Any:
        """The next batch; bad records raise `DataError("path:line: ...")` or are skipped."""
        bad_in_a_row = 0
        while not self._batcher.ready():
            try:
                item = next(self._it)
            except StopIteration:
                if self._batcher.finish():
                    break
                raise
            self._consumed += 1
            if item.example is None:
                if item.error is None:
                    self.deferred += 1
                else:
                    self._skips.bad(item.where, item.error)
                bad_in_a_row += 1
                if bad_in_a_row >= self._epoch_len:  # repeating forever would never yield
                    raise DataError(
                        f"{item.where}: the last {bad_in_a_row} records (an epoch's worth) "
                        f"were all bad or deferred to a longer stage, e.g. "
                        f"{item.error or 'longer than ' + str(self._fingerprint.get('seq_len'))}"
                    )
                continue
            bad_in_a_row = 0
            self.truncated += item.truncated
            self._batcher.add(item.example)
        return self._batcher.take()

    def get_state(self) -> dict:
        """JSON-serialisable position: grain's read index, carried-over rows, counters, config."""
        return {
            "version": STATE_VERSION,
            "grain": self._it.get_state(),
            "batcher": self._batcher.get_state(),
            "consumed": self._consumed,
            "skipped": self.skipped,
            "truncated": self.truncated,
            "deferred": self.deferred,
            "fingerprint": self._fingerprint,
        }

    def set_state(self, state: dict) -> None:
        """Resume from `get_state()`; refused if the data, seed or batch layout differ."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data iterator state version {state.get('version')!r}, expected {STATE_VERSION}")
        saved = state["fingerprint"]
        for key in sorted(set(saved) | set(self._fingerprint)):
            if _comparable(key, saved.get(key)) != _comparable(key, self._fingerprint.get(key)):
                raise ValueError(
                    f"data iterator state was saved with {key}={saved.get(key)!r} but this "
                    f"iterator has {self._fingerprint.get(key)!r}: the batches would differ"
                )
        self._it.set_state(state["grain"])
        self._batcher.set_state(state["batcher"])
        self._consumed = state["consumed"]
        self._skips.skipped = state["skipped"]
        self.truncated = state["truncated"]
        self.deferred = state.get("deferred", 0)
        for example in state.get("readd", ()):  # dealt from other processes' rows (data/reshard.py)
            self._batcher.add(example_from_json(example))

    def continue_from(self, previous: BatchIterator) -> None:
        """Carry on where `previous` (the same data at another length) stopped: its read position,
        counters, and the examples it had taken but not batched, re-packed to this iterator's
        length. The next stage of a staged-context run (`train.seq_len_schedule`) starts so."""
        mine = {k: v for k, v in self._fingerprint.items() if k not in LENGTH_KEYS}
        theirs = {k: v for k, v in previous._fingerprint.items() if k not in LENGTH_KEYS}
        if mine != theirs:
            diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            raise ValueError(f"continue_from: the iterators read different data or order (differ in {diff})")
        self._it.set_state(previous._it.get_state())
        for example in previous._batcher.pending():
            self._batcher.add(example)
        self._consumed = previous._consumed
        self._skips.skipped = previous.skipped
        self.truncated, self.deferred = previous.truncated, previous.deferred


def _comparable(key: str, value: Any) -> Any:
    """A fingerprint entry as it is saved and compared: local data files by their absolute path (the
    same file named from another working directory, or by a workdir written absolutely; a state
    saved with relative paths resolves them from this directory), URLs as written."""
    if key != "files" or not value:
        return value
    return [path if "://" in path else os.path.abspath(path) for path in value]


def process_shard(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, process_count={process_count})")
    return process_index, process_count


def rows_per_process(batch_size: int, process_count: int) -> int:
    if batch_size <= 0 or batch_size % process_count:
        raise ValueError(f"batch_size={batch_size} must be a positive multiple of process_count={process_count}")
    return batch_size // process_count


def process_records(
    source: JsonlSource, *, seed: int, shuffle: bool, epochs: int | None, process_index: int, process_count: int
) -> grain.MapDataset:
    """Shuffled (per epoch), process-sliced, repeated raw lines."""
    usable = len(source) - len(source) % process_count
    if len(source) == 0:
        raise UserError(
            f"{', '.join(source.paths)}: no records (empty, or only blank lines); give JSONL with one "
            "JSON object per line",
            path=source.paths[0],
        )
    if usable == 0:
        raise UserError(
            f"{', '.join(source.paths)}: {len(source)} records, fewer than the {process_count} "
            "processes that each need one",
            path=source.paths[0],
        )
    ds = grain.MapDataset.source(source)
    if shuffle:
        # Hash the seed: grain reshuffles epoch e with seed + e, which would make (seed, epoch 1)
        # replay (seed + 1, epoch 0).
        ds = ds.shuffle(seed=int(np.random.SeedSequence(seed).generate_state(1)[0]))
    return ds[process_index:usable:process_count].repeat(epochs)


Fit = Callable[[dict], tuple[dict | None, str | None, bool]]  # example → (example, error, truncated)


def load_fn(make: Callable[[dict, str], dict], fit: Fit) -> Callable[[RawLine], Loaded]:
    """The map step: parse the line, build the example (from the record and its file's path, which
    relative image paths are under), check (or cut) its length."""

    def load(raw: RawLine) -> Loaded:
        try:
            example = make(parse_line(raw), raw.path)
        except ValueError as e:
            return Loaded(raw.where, None, str(e))
        return Loaded(raw.where, *fit(example))

    return load


class Reading(TypedDict, total=False):
    """How a pipeline reads its files into batches, whatever it makes of the records
    (`pipeline_iterator`'s defaults): `batch_size` (global rows) and shuffle `seed` (both
    required), `on_error` "raise" or "skip" bad records, `epochs` (None: forever), `shuffle`, this
    process's slice `process_index` of `process_count` (None: jax's) and `read_threads`."""

    batch_size: Required[int]
    seed: Required[int]
    on_error: str
    epochs: int | None
    shuffle: bool
    process_index: int | None
    process_count: int | None
    read_threads: int


def pipeline_iterator(
    kind: str,
    paths: str | Sequence[str],
    tok: Tokenizer,
    make: Callable[[dict, str], dict],
    fit: Fit,
    batcher: Callable[[int], Batcher],
    *,
    batch_size: int,
    seed: int,
    fields: Mapping[str, str] | None,
    on_error: str = "raise",
    epochs: int | None = None,
    shuffle: bool = True,
    process_index: int | None = None,
    process_count: int | None = None,
    read_threads: int = 1,
    **shape,
) -> BatchIterator:
    """Source → grain dataset → `BatchIterator` of pipeline `kind`: records made into examples by
    `make(record, path)`, checked by `fit`, grouped by `batcher(rows per process)`. Everything that
    determines the batches (seed, shuffle, epochs, process slice, `shape`, ...) is saved in the
    state, with the process slice resolved."""
    process_index, process_count = process_shard(process_index, process_count)
    rows = rows_per_process(batch_size, process_count)
    SkipLog(on_error)  # validate on_error before reading anything
    source = JsonlSource(paths)
    ds = process_records(
        source, seed=seed, shuffle=shuffle, epochs=epochs, process_index=process_index, process_count=process_count
    )
    config = {
        "kind": kind,
        "vocab_size": tok.vocab_size,
        "seed": seed,
        "shuffle": shuffle,
        "epochs": epochs,
        "process_index": process_index,
        "process_count": process_count,
        "batch_size": batch_size,
        "fields": dict(fields or {}),
        **shape,
    }
    return BatchIterator(
        ds.map(load_fn(make, fit)),
        batcher(rows),
        on_error=on_error,
        fingerprint={"files": _comparable("files", source.paths), "records": source.file_lengths, **config},
        epoch_len=len(source) // process_count,
        read_threads=read_threads,
    )
