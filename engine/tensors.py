"""Arrays and their wire dtypes: MLX arrays to host bytes (`to_numpy`) and wire bytes into MLX
(`to_mlx`, which on CUDA also tells the driver the GPU reads them). The messages those bytes
travel in are proto/wire.py's; engine/ imports neither protobuf nor gRPC."""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from typing import Protocol

import mlx.core as mx
import numpy as np

from engine.errors import InvalidInput

# Wire dtype name -> (numpy dtype carrying the bytes, mlx dtype). bfloat16 has no
# numpy dtype, so its bytes travel as uint16 and are reinterpreted on arrival.
WIRE_DTYPES: dict[str, tuple[np.dtype, mx.Dtype]] = {
    "float32": (np.dtype("<f4"), mx.float32),
    "float16": (np.dtype("<f2"), mx.float16),
    "bfloat16": (np.dtype("<u2"), mx.bfloat16),
    "int32": (np.dtype("<i4"), mx.int32),
}
_NAMES = {mlx_dtype: name for name, (_, mlx_dtype) in WIRE_DTYPES.items()}


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
    """A host array in the wire's byte layout of `dtype_name_` into MLX (one array: to_mlx)."""
    return _as_mlx(array, mlx_dtype(dtype_name_))


def mlx_dtype(dtype_name_: str) -> mx.Dtype:
    return WIRE_DTYPES[dtype_name_][1]


def to_mlx(*segments: tuple[Sequence[np.ndarray], mx.Dtype]) -> list[mx.array]:
    """Host arrays into MLX: for each segment, the concatenation (axis 0) of its arrays, whose
    bytes are taken as they are and viewed as the segment's MLX dtype. Bytes are copied
    unchanged.

    On CUDA, where MLX memory is managed memory, every array made from host memory costs a
    page migration when the GPU first reads it, or a call to the driver to avoid one (several
    times a whole small kernel: docs/benchmarks.md), so there all segments travel in one buffer
    viewed apart on the device: a request's hidden states and indices, or a layer's replies and
    their gather index, as one. Where memory is one (Metal, the CPU) each segment is an array
    of its own, which costs fewer calls.
    """
    if not _managed_memory():
        return [_as_mlx(arrays[0] if len(arrays) == 1 else np.concatenate(arrays), dtype)
                for arrays, dtype in segments]
    if len(segments) == 1 and len(segments[0][0]) == 1:  # one array: no staging buffer
        (array,), dtype = segments[0]
        return [_as_mlx(array, dtype)]
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


def _as_mlx(array: np.ndarray, dtype: mx.Dtype) -> mx.array:
    """One host array into MLX, its bytes viewed as `dtype` (of the same item size)."""
    if array.dtype.itemsize != dtype.size:
        raise InvalidInput(f"{array.dtype} bytes cannot be read as {dtype}")
    device = mx.array(array)
    to_gpu_reader(device)
    return device if device.dtype == dtype else device.view(dtype)


@functools.cache
def _managed_memory() -> bool:
    """Whether MLX keeps arrays in CUDA managed memory (its CUDA backend)."""
    try:
        return bool(mx.cuda.is_available())
    except AttributeError:
        return False


# -- On MLX's CUDA backend: let the GPU read an array just made from wire bytes where it lies.
#
# MLX makes an array from host memory in CUDA managed memory, and the GPU's first read of such a
# buffer migrates its pages by faults, which costs a small kernel several times its own time;
# told that the GPU reads it (SetAccessedBy), the driver maps the pages instead of faulting them
# over. That is paid once per MoE layer on each end of a link (the worker's request, the
# coordinator's replies); the figure is in docs/benchmarks.md's H200 table
# (`python -m benchmarks.probes.host_arrays`). Advice moves no data and changes no bits; where
# the driver library or a call is missing, nothing is done.
#
# On Metal and on the CPU there is nothing to do: memory is one, and `to_gpu_reader` returns at
# once. Called by `to_mlx` above.

_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_SET_ACCESSED_BY = 5  # CU_MEM_ADVISE_SET_ACCESSED_BY


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Driver:
    """The CUDA driver calls used, bound once (raises OSError where they cannot be)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self.device = 0  # MLX computes on the first device it sees (CUDA_VISIBLE_DEVICES)
        self._context = ctypes.c_void_p()
        device = ctypes.c_int()
        self._check(lib.cuInit(0))
        self._check(lib.cuDeviceGet(ctypes.byref(device), self.device))
        # MLX runs on the device's primary context: the same one, made current per thread
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._context), device))
        self._set_current = lib.cuCtxSetCurrent
        self._advise = lib.cuMemAdvise_v2
        self._advise.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, _Location]

    @staticmethod
    def _check(result: int) -> None:
        if result != 0:
            raise OSError(f"CUDA driver call failed ({result})")

    def place(self, address: int, size: int) -> None:
        self._check(self._set_current(self._context))
        location = _Location(_LOCATION_DEVICE, self.device)
        self._check(self._advise(address, size, _SET_ACCESSED_BY, location))


@functools.cache
def _driver() -> _Driver | None:
    """The driver's calls, bound on first use; None off CUDA, where they cannot be bound, or
    with SHOAL_CUDA_ADVICE=0 (to compare, or if a driver objects)."""
    try:
        if mx.cuda.is_available() and os.environ.get("SHOAL_CUDA_ADVICE") != "0":
            return _Driver()
    except (OSError, AttributeError):
        pass
    return None


def to_gpu_reader(array: mx.array) -> None:
    """`array` was just made from host bytes and a GPU kernel reads it next: say so to the
    driver (see the comment above `_Driver`). A hint: any failure leaves the array as it was."""
    driver = _driver()
    if driver is None:
        return
    host = np.asarray(array)  # the managed buffer itself, not a copy
    try:
        driver.place(host.__array_interface__["data"][0], host.nbytes)
    except OSError:
        pass
