"""Reading a checkpoint's safetensors files: ``model.safetensors``, or the shards that
``model.safetensors.index.json`` lists.

A shard is opened once per pass (:class:`Shard`): non-blocking, its type checked on the opened descriptor
(a regular file; a FIFO, a device or a socket is refused, never waited on), its header parsed and checked
here (each tensor's dtype known, its shape and byte range consistent and inside the file), and each tensor
memory mapped from that same descriptor: a file replaced or renamed while it is read is never reopened by
its path, so nothing is read past the checks. Every error is a ValueError naming the file and, where there
is one, the tensor (:func:`~jax_oc128.checks.shown`).
"""

from __future__ import annotations

import json
import math
import os
import pathlib

import ml_dtypes
import numpy as np

from jax_oc128 import files
from jax_oc128.checks import shown

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: the largest index read, in bytes (DeepSeek-V3's, 91k tensors with their FP8 scales, is 8.9 MiB)
MAX_INDEX_BYTES = 64 << 20
#: the largest safetensors header read, in bytes (safetensors' own limit)
MAX_HEADER_BYTES = 100 << 20
#: the bits of an element of each safetensors dtype (the format's whole list; :data:`NUMPY_DTYPES` are read)
BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "C64": 64,
    **{f"{kind}{bits}": bits for kind in ("I", "U") for bits in (8, 16, 32, 64)},
    **{f"F{bits}": bits for bits in (16, 32, 64)},
    "BF16": 16,
}
#: the numpy dtype of each safetensors dtype read (a tensor is memory mapped as it is stored: little-endian)
NUMPY_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    **{
        f"{kind}{bits}": np.dtype(f"{kind.lower()}{bits // 8}")
        for kind in ("I", "U")
        for bits in (8, 16, 32, 64)
    },
}
#: a tensor's header: (its file, shape, safetensors dtype)
Header = tuple[pathlib.Path, tuple[int, ...], str]


class Shard:
    """The safetensors ``file`` opened (see the module's docstring): ``tensors``, name -> (shape, dtype,
    (begin, end) bytes of the data); :meth:`read` maps one. A context manager (closing the descriptor; the
    maps stay valid)."""

    def __init__(self, file: pathlib.Path):
        self.file = file
        try:
            descriptor = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as error:
            raise ValueError(f"{file}: cannot be read ({error})") from None
        self.stream = open(descriptor, "rb")
        try:
            self.size = files.regular_file(file, os.fstat(descriptor)).st_size
            self.start, self.tensors = self._header()
        except BaseException:
            self.stream.close()
            raise

    def __enter__(self) -> Shard:
        return self

    def __exit__(self, *_) -> None:
        self.stream.close()

    def _bad(self, why: str) -> ValueError:
        return ValueError(f"{self.file}: not a readable safetensors file ({why})")

    def _header(self) -> tuple[int, dict]:
        """The data's first byte and each tensor's (shape, dtype, (begin, end)), checked."""
        length = int.from_bytes(self.stream.read(8), "little")
        if not 0 < length <= min(self.size - 8, MAX_HEADER_BYTES):
            raise self._bad(f"a header of {length} bytes in a file of {self.size}")
        try:
            header = json.loads(self.stream.read(length))
        except RecursionError:
            raise self._bad("its header nested too deeply") from None
        except ValueError as error:
            raise self._bad(f"its header: {error}") from None
        if not isinstance(header, dict):
            raise self._bad("its header is not a JSON object")
        data = self.size - 8 - length
        tensors = {}
        for name, entry in header.items():
            if name != "__metadata__":
                tensors[name] = self._entry(name, entry, data)
        return 8 + length, tensors

    def _entry(self, name: str, entry, data: int) -> tuple[tuple[int, ...], str, tuple[int, int]]:
        """The checked (shape, dtype, (begin, end)) of the tensor ``name``'s header ``entry`` in a file of
        ``data`` bytes of tensors."""
        where = f"{self.file}: tensor {shown(name)}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: its header entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in BITS:
            raise ValueError(
                f"{where}: unknown dtype {shown(dtype if isinstance(dtype, str) else repr(dtype))}"
            )
        if not isinstance(shape, list) or not all(_count(size) for size in shape):
            raise ValueError(f"{where}: shape must be a list of ints >= 0, got {shown(repr(shape))}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)):
            raise ValueError(f"{where}: data_offsets must be [begin, end], got {shown(repr(offsets))}")
        begin, end = offsets
        if not begin <= end <= data:
            raise ValueError(f"{where}: data_offsets {offsets} outside the file's {data} bytes of tensors")
        if (end - begin) * 8 != math.prod(shape) * BITS[dtype]:
            raise ValueError(f"{where}: {end - begin} bytes for shape {tuple(shape)} of {dtype}")
        return tuple(shape), dtype, (begin, end)

    def read(self, name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """The tensor ``name`` memory mapped (:data:`NUMPY_DTYPES`: nothing is read until it is indexed),
        which must have the ``shape`` and ``dtype`` it was checked with: a ValueError naming the tensor
        otherwise (the file replaced since)."""
        where = f"{self.file}: tensor {shown(name)}"
        if name not in self.tensors:
            raise ValueError(
                f"{where}: not readable (no longer in the file: the file changed while it was loaded)"
            )
        now_shape, now_dtype, (begin, end) = self.tensors[name]
        if (now_shape, now_dtype) != (shape, dtype):
            raise ValueError(
                f"{where}: now shape {now_shape} and dtype {now_dtype}, checked as {shape} and {dtype} (the "
                "file changed while it was loaded)"
            )
        numpy_dtype = np.dtype(NUMPY_DTYPES[dtype])
        if begin == end:  # (np.memmap maps no empty range)
            return np.zeros(shape, numpy_dtype)
        data = np.memmap(
            self.stream, dtype=np.uint8, mode="r", offset=self.start + begin, shape=(end - begin,)
        )
        return data.view(numpy_dtype).reshape(shape)


def _count(value) -> bool:
    """An int >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_headers(directory: pathlib.Path) -> dict[str, Header]:
    """Every tensor of the checkpoint in ``directory``: name -> (its file, shape, safetensors dtype)."""
    if (directory / SINGLE).exists():
        shards = {directory / SINGLE: None}
    elif (directory / INDEX).exists():
        shards = read_index(directory)
    else:
        raise ValueError(f"path: {directory} has neither {SINGLE} nor {INDEX}")
    headers = {}
    for file, names in shards.items():
        with Shard(file) as shard:
            for name in shard.tensors if names is None else names:
                if name not in shard.tensors:
                    raise ValueError(f"{directory / INDEX}: tensor {shown(name)}: not in {file.name}")
                shape, dtype, _ = shard.tensors[name]
                headers[name] = file, shape, dtype
    return headers


def read_index(directory: pathlib.Path) -> dict[pathlib.Path, list[str]]:
    """The shards of ``model.safetensors.index.json`` and the tensors each holds."""
    file = directory / INDEX
    index = files.read_json(file, MAX_INDEX_BYTES)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{file}: not an index (a JSON object with a weight_map object {{tensor: file}})")
    shards = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or shard in ("", "..") or pathlib.Path(shard).name != shard:
            raise ValueError(
                f"{file}: weight_map[{shown(name)}]: must be a file name in {directory}, got "
                f"{shown(repr(shard))}"
            )
        shards.setdefault(directory / shard, []).append(name)
    return shards


def by_file(headers: dict[str, Header]) -> dict[pathlib.Path, list[str]]:
    """The tensor names of each file, in file order."""
    named = {}
    for name, (file, _, _) in sorted(headers.items(), key=lambda item: str(item[1][0])):
        named.setdefault(file, []).append(name)
    return named
