"""On MLX's CUDA backend: let the GPU read an array just made from host bytes where it lies,
instead of faulting its pages over on the first read.

MLX makes an array from host memory in CUDA managed memory, and the GPU's first read of such a
buffer migrates its pages by faults: on the H200 machine (MLX 0.32.4, `python -m
benchmarks.host_arrays`, docs/measurements/h200-host-arrays.json) a kernel on a 4 or 16 KB
array fresh from host bytes took 132 and 160 us against 25 us on a resident array, and 26-27 us
once the driver was told that the GPU reads it (SetAccessedBy: the GPU maps the pages instead
of faulting them over). That is paid once per MoE layer on each end of a link (the worker's
request, the coordinator's replies): decode +5 to +12% there (docs/benchmarks.md). Advice moves
no data and changes no bits; where the driver library or a call is missing, nothing is done.

On Metal and on the CPU there is nothing to do: memory is one, and `to_gpu_reader` returns at
once.
"""

from __future__ import annotations

import ctypes
import os
import threading

import mlx.core as mx
import numpy as np

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


_driver: _Driver | None = None
_tried = False
_lock = threading.Lock()


def _get_driver() -> _Driver | None:
    global _driver, _tried
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    # SHOAL_CUDA_ADVICE=0 turns it off (to compare, or if a driver objects)
                    if mx.cuda.is_available() and os.environ.get("SHOAL_CUDA_ADVICE") != "0":
                        _driver = _Driver()
                except (OSError, AttributeError):
                    _driver = None
                _tried = True
    return _driver


def to_gpu_reader(array: mx.array) -> None:
    """`array` was just made from host bytes and a GPU kernel reads it next: say so to the
    driver (see the module's docstring). A hint: any failure leaves the array as it was."""
    driver = _get_driver()
    if driver is None:
        return
    host = np.asarray(array)  # the managed buffer itself, not a copy
    try:
        driver.place(host.__array_interface__["data"][0], host.nbytes)
    except OSError:
        pass
