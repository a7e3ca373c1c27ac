"""Safetensors files held in a memory buffer: parse the header (8-byte length + JSON) and
build MLX arrays from slices of the buffer, so a worker can read a file into a reusable
buffer of its own and decode it without going through a file API."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.errors import CorruptData

# Safetensors dtype -> (numpy dtype carrying the bytes, MLX dtype to view them as, or None).
_DTYPES: dict[str, tuple[np.dtype, mx.Dtype | None]] = {
    "F32": (np.dtype("<f4"), None),
    "F16": (np.dtype("<f2"), None),
    "BF16": (np.dtype("<u2"), mx.bfloat16),
    "I8": (np.dtype("i1"), None),
    "U8": (np.dtype("u1"), None),
    "I16": (np.dtype("<i2"), None),
    "U16": (np.dtype("<u2"), None),
    "I32": (np.dtype("<i4"), None),
    "U32": (np.dtype("<u4"), None),
    "I64": (np.dtype("<i8"), None),
    "U64": (np.dtype("<u8"), None),
    "BOOL": (np.dtype("?"), None),
}


def _entry(
    name: str, entry: dict, origin: str
) -> tuple[np.dtype, mx.Dtype | None, tuple[int, ...], int, int]:
    try:
        np_dtype, view_as = _DTYPES[entry["dtype"]]
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise CorruptData(f"{origin}: tensor {name} has an unreadable header entry") from None
    return np_dtype, view_as, shape, begin, end


def read_header(buffer: memoryview, *, origin: str) -> tuple[dict, int]:
    """The header's tensor entries and the offset where the data section starts."""
    if len(buffer) < 8:
        raise CorruptData(f"{origin} is too short to be a safetensors file")
    (length,) = struct.unpack_from("<Q", buffer, 0)
    if length > len(buffer) - 8:
        raise CorruptData(f"{origin} is truncated or not a safetensors file")
    try:
        header = json.loads(bytes(buffer[8 : 8 + length]))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CorruptData(f"{origin} has an unreadable safetensors header") from None
    if not isinstance(header, dict):
        raise CorruptData(f"{origin} has an unreadable safetensors header")
    header.pop("__metadata__", None)
    return header, 8 + length


def tensors_from_buffer(buffer: memoryview, *, origin: str) -> dict[str, mx.array]:
    """Every tensor of a safetensors file whose bytes are `buffer`, copied into MLX arrays.

    The arrays own their memory, so the buffer may be reused as soon as this returns.
    """
    header, start = read_header(buffer, origin=origin)
    tensors = {}
    for name, entry in header.items():
        np_dtype, view_as, shape, begin, end = _entry(name, entry, origin)
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * np_dtype.itemsize or begin < 0 or start + end > len(buffer):
            raise CorruptData(f"{origin}: tensor {name} does not fit the file's data")
        array = np.frombuffer(buffer, np_dtype, count, start + begin).reshape(shape)
        out = mx.array(array)
        tensors[name] = out.view(view_as) if view_as is not None else out
    return tensors


def placeholders(path: Path) -> dict[str, mx.array]:
    """Zero arrays with the names, shapes and dtypes of a safetensors file, reading only its
    header: enough to build and quantize a module the file's tensors will later fill."""
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        header, _ = read_header(memoryview(head + f.read(length)), origin=str(path))
    out = {}
    for name, entry in header.items():
        np_dtype, view_as, shape, _, _ = _entry(name, entry, str(path))
        out[name] = mx.zeros(shape, dtype=view_as or mx.array(np.zeros(0, np_dtype)).dtype)
    return out
