"""Arrays <-> wire tensors (proto `Tensor`), with the dtype and shape checks both sides rely on.

No networking here: a tensor is anything with the proto Tensor's three fields, so engine/ does
not import gRPC."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import mlx.core as mx
import numpy as np

from engine.cuda_memory import to_gpu_reader
from engine.errors import MAX_ECHO, InvalidInput, clip

# Wire dtype name -> (numpy dtype carrying the bytes, mlx dtype). bfloat16 has no
# numpy dtype, so its bytes travel as uint16 and are reinterpreted on arrival.
_DTYPES: dict[str, tuple[np.dtype, mx.Dtype]] = {
    "float32": (np.dtype("<f4"), mx.float32),
    "float16": (np.dtype("<f2"), mx.float16),
    "bfloat16": (np.dtype("<u2"), mx.bfloat16),
    "int32": (np.dtype("<i4"), mx.int32),
}
_NAMES = {mlx_dtype: name for name, (_, mlx_dtype) in _DTYPES.items()}


class WireTensor(Protocol):
    """The fields of proto `Tensor` (shoal.proto) that `decode` reads."""

    dtype: str
    shape: Sequence[int]
    data: bytes


def dtype_name(dtype: mx.Dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise InvalidInput(f"dtype {dtype} cannot travel on the wire") from None


def to_numpy(array: mx.array) -> np.ndarray:
    """The array's bytes as a numpy array (bfloat16 viewed as uint16), without copying twice."""
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    return np.asarray(array)


def from_numpy(array: np.ndarray, dtype_name_: str) -> mx.array:
    out = mx.array(array)
    return out.view(mx.bfloat16) if dtype_name_ == "bfloat16" else out


def mlx_dtype(dtype_name_: str) -> mx.Dtype:
    return _DTYPES[dtype_name_][1]


def to_mlx(*segments: tuple[Sequence[np.ndarray], mx.Dtype]) -> list[mx.array]:
    """Host arrays into MLX through one buffer: for each segment, the concatenation (axis 0)
    of its arrays, whose bytes are taken as they are and viewed as the segment's MLX dtype.

    One buffer because on CUDA, where MLX memory is managed memory, every array made from
    host memory costs a page migration when the GPU first reads it (about 130 us on the H200
    machine, against 30 us for a whole small kernel): a request's hidden states and indices,
    or a layer's replies and their gather index, travel as one. Bytes are copied unchanged.
    """
    sizes = [sum(a.nbytes for a in arrays) for arrays, _ in segments]
    starts = np.cumsum([0] + [-(-n // 8) * 8 for n in sizes])  # 8-byte aligned views
    buffer = np.empty(int(starts[-1]), dtype=np.uint8)
    for (arrays, _), start in zip(segments, starts, strict=False):
        at = int(start)
        for a in arrays:
            buffer[at : at + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            at += a.nbytes
    device = mx.array(buffer)
    to_gpu_reader(device)
    out = []
    for (arrays, dtype), start, size in zip(segments, starts, sizes, strict=False):
        rows = sum(a.shape[0] for a in arrays)
        view = device[int(start) : int(start) + size].view(dtype)
        out.append(view.reshape(rows, *arrays[0].shape[1:]))
    return out


def encode(array: np.ndarray, dtype_name_: str) -> dict:
    """A numpy array (already in the wire's byte layout for `dtype_name_`) as the fields of a
    proto Tensor, to give a message's tensor field: `ExpertRequest(hidden=encode(...))`.

    A dict, not a Tensor: protobuf (upb) builds a field from a dict in place, but copies a
    ready Tensor message slowly (48 ms against 7 ms for 8 MB here).
    """
    return {"dtype": dtype_name_, "shape": array.shape, "data": array.tobytes()}


def decode(
    tensor: WireTensor,
    *,
    what: str,
    dtypes: tuple[str, ...] | None = None,
    ndim: int | None = None,
) -> np.ndarray:
    """Check a Tensor against what the caller expects and view its bytes as numpy.

    Raises InvalidInput naming `what` when the dtype, rank or byte count is wrong.
    """
    if tensor.dtype not in _DTYPES:
        raise InvalidInput(f"{what}: unknown dtype {clip(repr(tensor.dtype), MAX_ECHO)}")
    if dtypes is not None and tensor.dtype not in dtypes:
        raise InvalidInput(f"{what}: dtype {tensor.dtype} is not one of {', '.join(dtypes)}")
    shape = tuple(tensor.shape)
    if ndim is not None and len(shape) != ndim:
        raise InvalidInput(f"{what}: expected {ndim} dimensions, got shape "
                           f"{clip(str(shape), 80)}")
    if any(not 0 <= d < 2**31 for d in shape):
        raise InvalidInput(f"{what}: a dimension of shape {clip(str(shape), 80)} is negative "
                           "or too large")
    np_dtype = _DTYPES[tensor.dtype][0]
    expected = math.prod(shape) * np_dtype.itemsize  # Python ints: no overflow
    data = tensor.data  # each read of a bytes field makes a new copy: read it once
    if len(data) != expected:
        raise InvalidInput(
            f"{what}: {clip(str(shape), 80)} of {tensor.dtype} needs {expected} bytes, "
            f"got {len(data)}"
        )
    return np.frombuffer(data, dtype=np_dtype).reshape(shape)
