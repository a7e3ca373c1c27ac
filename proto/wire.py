"""The Compute messages' codec: ExpertRequest / ExpertReply in protobuf's own wire format with
each tensor's bytes copied once, and a received tensor checked against what its reader expects
(`decode`); both transports (gRPC stream, expert lane) carry exactly these bytes."""

from __future__ import annotations

import functools
import math
from collections.abc import Collection
from typing import NamedTuple

import numpy as np
from google.protobuf.message import DecodeError

from engine.errors import MAX_ECHO, InvalidInput, clip
from engine.tensors import WIRE_DTYPES, WireTensor

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
        if number in tensor_fields:
            if kind != _LEN:  # protobuf would keep it as an unknown field: read as absent
                raise InvalidInput(f"{what}: tensor field {number} has wire type {kind}, not "
                                   "a length-delimited Tensor")
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
    if tensor.dtype not in WIRE_DTYPES:
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
    np_dtype = WIRE_DTYPES[tensor.dtype][0]
    expected = math.prod(shape) * np_dtype.itemsize  # Python ints: no overflow
    data = tensor.data  # each read of a bytes field makes a new copy: read it once
    if len(data) != expected:
        raise InvalidInput(
            f"{what}: {clip(str(shape), 80)} of {tensor.dtype} needs {expected} bytes, "
            f"got {len(data)}"
        )
    return np.frombuffer(data, dtype=np_dtype).reshape(shape)
