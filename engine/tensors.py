"""Arrays <-> wire tensors (proto `Tensor`), with the dtype and shape checks both sides rely on;
the Compute stream's messages written and read without copying their tensors' bytes
(`join_message`, `split_message`); and wire bytes into MLX (`to_mlx`, which on CUDA also tells
the driver the GPU reads them).

No networking here: a tensor is anything with the proto Tensor's three fields, so engine/ does
not import gRPC."""

from __future__ import annotations

import ctypes
import functools
import math
import os
from collections.abc import Collection, Sequence
from typing import NamedTuple, Protocol

import mlx.core as mx
import numpy as np
from google.protobuf.message import DecodeError

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


# -- Messages whose tensors' bytes are copied once (by the sender), not five times.
#
# protobuf's Python API copies a bytes field at every step: into the message being built, into
# its serialization, into the parsed message, and again on every read of the field. A prompt
# pass moves megabytes per layer each way, and each copy lands in fresh memory that faults in
# page by page (docs/benchmarks.md). So the Compute stream's tensor fields are written and read
# here, in protobuf's own wire format (a field is a tag and a length, a Tensor its three fields),
# and every other field is left to protobuf: what `join_message` writes any protobuf parser
# reads, and `split_message` reads what any protobuf writer wrote (fields in any order, packed
# or not, unknown ones skipped).

_TENSOR_DTYPE, _TENSOR_SHAPE, _TENSOR_DATA = 1, 2, 3  # proto `Tensor`'s field numbers
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5  # protobuf wire types (3 and 4: groups, unused)
MAX_DIMS = 32  # a shape's dimensions at most: a packed shape of a million is refused unread


class WireView(NamedTuple):
    """A received Tensor field whose data is a view of the received message (a `WireTensor`)."""

    dtype: str = ""
    shape: tuple[int, ...] = ()
    data: memoryview | bytes = b""


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@functools.lru_cache(maxsize=256)
def _tensor_header(number: int, dtype_name_: str, shape: tuple[int, ...], nbytes: int) -> bytes:
    """Field `number`'s tag and length, then a Tensor's dtype, shape and data tag and length:
    all but the bytes (a decode step's shapes repeat, hence the cache)."""
    dtype = dtype_name_.encode()
    dims = b"".join(_varint(d) for d in shape)
    tensor = b"".join((
        _varint(_TENSOR_DTYPE << 3 | _LEN), _varint(len(dtype)), dtype,
        _varint(_TENSOR_SHAPE << 3 | _LEN), _varint(len(dims)), dims,
        _varint(_TENSOR_DATA << 3 | _LEN), _varint(nbytes),
    ))
    return _varint(number << 3 | _LEN) + _varint(len(tensor) + nbytes) + tensor


def join_message(head: bytes, *tensors: tuple[int, np.ndarray, str]) -> bytes:
    """A message's wire bytes: `head` (protobuf's serialization of its other fields), then each
    (field number, array in the wire's byte layout, dtype name) as a Tensor field, its bytes
    copied once, here."""
    pieces = [head]
    for number, array, dtype_name_ in tensors:
        array = np.ascontiguousarray(array)
        pieces.append(_tensor_header(number, dtype_name_, array.shape, array.nbytes))
        pieces.append(array.reshape(-1).view(np.uint8).data)
    return b"".join(pieces)


def _read_varint(data: bytes, at: int, end: int, what: str) -> tuple[int, int]:
    value = shift = 0
    while at < end and shift < 70:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
    raise InvalidInput(f"{what}: the message is cut short or malformed")


def _field(data: bytes, at: int, end: int, what: str) -> tuple[int, int, int, int]:
    """The field that starts at data[at]: (number, wire type, start of its value, its end)."""
    key = data[at]  # tags and lengths are mostly one byte: read those without a call
    key, at = (key, at + 1) if key < 0x80 else _read_varint(data, at, end, what)
    kind = key & 7
    if kind == _LEN:
        size = data[at] if at < end else 0x80
        size, at = (size, at + 1) if size < 0x80 else _read_varint(data, at, end, what)
        stop = at + size
    elif kind == _VARINT:
        stop = _read_varint(data, at, end, what)[1]
    elif kind == _FIXED64 or kind == _FIXED32:
        stop = at + (8 if kind == _FIXED64 else 4)
    else:
        raise InvalidInput(f"{what}: the message has a field of wire type {kind}")
    if stop > end or key >> 3 == 0:
        raise InvalidInput(f"{what}: the message is cut short or malformed")
    return key >> 3, kind, at, stop


def _tensor_view(data: bytes, view: memoryview, at: int, end: int, what: str) -> WireView:
    dtype, shape, body = b"", [], b""
    while at < end:
        number, kind, value, at = _field(data, at, end, what)
        if number == _TENSOR_DTYPE and kind == _LEN:
            dtype = data[value:at]
        elif number == _TENSOR_SHAPE and kind == _LEN:  # packed, as protobuf writes it
            while value < at and len(shape) <= MAX_DIMS:
                d, value = _read_varint(data, value, at, what)
                shape.append(d)
        elif number == _TENSOR_SHAPE and kind == _VARINT:  # one at a time: also valid
            shape.append(_read_varint(data, value, at, what)[0])
        elif number == _TENSOR_DATA and kind == _LEN:
            body = view[value:at]
        if len(shape) > MAX_DIMS:
            raise InvalidInput(f"{what}: a tensor has more than {MAX_DIMS} dimensions")
    try:
        name = dtype.decode()
    except UnicodeDecodeError:
        name = repr(dtype)
    return WireView(name, tuple(shape), body)


def split_message(
    data: bytes, tensor_fields: Collection[int], what: str = "message"
) -> tuple[bytes, dict[int, WireView]]:
    """A received message apart: the bytes of every field but `tensor_fields` (for protobuf
    to parse), and each tensor field present as a WireView of `data` (its bytes not copied)."""
    view = memoryview(data)
    head, tensors = [], {}
    at, end = 0, len(data)
    while at < end:
        start = at
        number, kind, value, at = _field(data, at, end, what)
        if number in tensor_fields and kind == _LEN:
            if number in tensors:
                raise InvalidInput(f"{what}: tensor field {number} appears twice")
            tensors[number] = _tensor_view(data, view, value, at, what)
        else:
            head.append(data[start:at])
    return b"".join(head), tensors


class TensorMessage:
    """A proto message type whose Tensor fields `names` travel as `join_message` writes them
    and `split_message` reads them; protobuf writes and parses the rest."""

    def __init__(self, kind: type, *names: str) -> None:
        fields = kind.DESCRIPTOR.fields_by_name
        self.kind = kind
        self.numbers = {name: fields[name].number for name in names}
        self._names = {number: name for name, number in self.numbers.items()}

    def write(self, message, **tensors: tuple[np.ndarray, str]) -> bytes:
        """`message` (its tensor fields unset) with each name=(array, dtype name) as a Tensor."""
        return join_message(message.SerializeToString(),
                            *((self.numbers[name], array, dtype)
                              for name, (array, dtype) in tensors.items()))

    def read(self, data: bytes, what: str) -> tuple[object, dict[str, WireView]]:
        """The message without its tensor fields, and each tensor field present by name;
        InvalidInput naming `what` if the bytes are not such a message."""
        head, views = split_message(data, self._names, what)
        try:
            message = self.kind.FromString(head)
        except DecodeError:
            raise InvalidInput(f"{what}: not a valid {self.kind.__name__} message") from None
        return message, {self._names[number]: view for number, view in views.items()}


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


# -- On MLX's CUDA backend: let the GPU read an array just made from wire bytes where it lies.
#
# MLX makes an array from host memory in CUDA managed memory, and the GPU's first read of such a
# buffer migrates its pages by faults: on the H200 machine (MLX 0.32.4, `python -m
# benchmarks.host_arrays`, docs/measurements/h200-host-arrays.json) a kernel on a 4 or 16 KB
# array fresh from host bytes took 132 and 160 us against 25 us on a resident array, and 26-27 us
# once the driver was told that the GPU reads it (SetAccessedBy: the GPU maps the pages instead
# of faulting them over). That is paid once per MoE layer on each end of a link (the worker's
# request, the coordinator's replies): decode +5 to +12% there (docs/benchmarks.md). Advice moves
# no data and changes no bits; where the driver library or a call is missing, nothing is done.
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
