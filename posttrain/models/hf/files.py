"""Safetensors files of a Hugging Face model folder: lazy slice reads and sharded writes."""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os

import numpy as np

importlib.import_module("ml_dtypes")  # registers bfloat16 with numpy, which safetensors' numpy reader needs
try:
    from safetensors import safe_open
    from safetensors.numpy import save, save_file
except ImportError as e:
    raise ImportError("Hugging Face interop needs safetensors: pip install -e '.[hf]'") from e

from posttrain import storage  # noqa: E402 (after the safetensors check, whose error says how to install it)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class SafetensorsFolder:
    """Tensor-by-tensor, slice-by-slice reads (`safe_open`, memory-mapped) of a local model folder
    holding `model.safetensors` or the shards listed in `model.safetensors.index.json`.

    Files stay open (mapped) until `release()`: the pages read count as this process's resident
    memory while mapped, so a loader releases after each piece it reads.
    """

    def __init__(self, path: str):
        if "://" in path:
            raise ValueError(
                f"{path}: Hugging Face folders are read from local disk; copy it first "
                "(e.g. `gsutil -m cp -r`), or convert it once with tools/convert_hf.py"
            )
        self.path = path
        index, single = os.path.join(path, INDEX), os.path.join(path, SINGLE)
        if os.path.isfile(index):
            with open(index) as f:
                self.weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.isfile(single):
            with safe_open(single, framework="np") as f:
                self.weight_map = {name: SINGLE for name in f.keys()}
        else:
            raise FileNotFoundError(f"{path}: neither {INDEX} nor {SINGLE} found")
        self._files: dict[str, object] = {}
        self._stack = contextlib.ExitStack()

    def _file(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"{self.path}: no tensor {name!r} in the checkpoint")
        file = self.weight_map[name]
        if file not in self._files:
            full = os.path.join(self.path, file)
            if not os.path.isfile(full):
                raise FileNotFoundError(f"{full}: listed in {INDEX} for {name!r} but missing")
            self._files[file] = self._stack.enter_context(safe_open(full, framework="np"))
        return self._files[file]

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor `name`."""
        return tuple(self._file(name).get_slice(name).get_shape())

    def nbytes(self, name: str) -> int:
        """The stored size of tensor `name` in bytes."""
        tensor = self._file(name).get_slice(name)
        return math.prod(tensor.get_shape()) * DTYPE_BYTES[tensor.get_dtype()]

    def read(self, name: str, index: tuple) -> np.ndarray:
        """`tensor[index]` (ints and slices), reading only that part from disk."""
        return self._file(name).get_slice(name)[index]

    def release(self) -> None:
        """Close (unmap) the open files; later reads open them again."""
        self._stack.close()
        self._files.clear()

    def __enter__(self) -> SafetensorsFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class ShardWriter:
    """Writes tensors into `model-0000i-of-0000n.safetensors` files of at most `max_bytes` each
    (one tensor larger than that gets a file of its own) plus the index, or a single
    `model.safetensors` when everything fits in one. Holds at most one shard in memory. `path`
    may be a URL (gs://): each shard is serialised in memory and uploaded."""

    def __init__(self, path: str, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes = self.total_bytes = 0
        self.files: list[list[str]] = []

    def add(self, name: str, tensor: np.ndarray) -> None:
        """Queue `tensor` under `name`, writing the current shard first if it would overflow."""
        if self.pending and self.pending_bytes + tensor.nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += tensor.nbytes
        self.total_bytes += tensor.nbytes

    def _temp_name(self, i: int) -> str:
        return storage.join(self.path, f"model-{i + 1:05d}.safetensors.partial")

    def _flush(self) -> None:
        if storage.is_url(self.path):
            storage.write_bytes(self._temp_name(len(self.files)), save(self.pending, metadata={"format": "pt"}))
        else:
            save_file(self.pending, self._temp_name(len(self.files)), metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Write the last shard, give the files their final names and write the index."""
        if self.pending or not self.files:
            self._flush()
        n = len(self.files)
        if n == 1:
            storage.replace(self._temp_name(0), storage.join(self.path, SINGLE))
            return
        weight_map = {}
        for i, names in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            storage.replace(self._temp_name(i), storage.join(self.path, final))
            weight_map.update({name: final for name in names})
        storage.write_text(
            storage.join(self.path, INDEX),
            json.dumps({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, indent=2),
        )
