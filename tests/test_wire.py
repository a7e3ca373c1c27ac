"""The Compute messages' codec (proto/wire.py): what it writes protobuf reads and the other
way round, tensors read as views, and malformed bytes refused naming the problem."""

import mlx.core as mx
import numpy as np
import pytest

from engine.errors import InvalidInput
from engine.tensors import dtype_name, to_numpy
from proto import EXPERT_REPLY, EXPERT_REQUEST, shoal_pb2
from proto.wire import decode, join_message, split_message
from tests.wire import tensor_fields


def test_decode_refuses_wrong_dtype_rank_and_size():
    tensor = shoal_pb2.Tensor(**tensor_fields(np.zeros((2, 3), np.float32), "float32"))
    with pytest.raises(InvalidInput, match="not one of int32"):
        decode(tensor, what="rows", dtypes=("int32",))
    with pytest.raises(InvalidInput, match="expected 1 dimensions"):
        decode(tensor, what="rows", ndim=1)
    tensor.data = tensor.data[:-4]
    with pytest.raises(InvalidInput, match="needs 24 bytes, got 20"):
        decode(tensor, what="hidden")
    tensor.dtype = "complex64"
    with pytest.raises(InvalidInput, match="unknown dtype"):
        decode(tensor, what="hidden")
    with pytest.raises(InvalidInput, match="cannot travel"):
        dtype_name(mx.uint8)


def _request_parts(rows: int, pairs: int, dtype: str = "float32"):
    rng = np.random.default_rng(rows)
    hidden = rng.standard_normal((rows, 300)).astype(np.float32)
    if dtype == "bfloat16":
        hidden = to_numpy(mx.array(hidden).astype(mx.bfloat16))
    index = rng.integers(0, rows, pairs).astype(np.int32)
    experts = rng.integers(0, 256, pairs).astype(np.int32)
    return hidden, index, experts


@pytest.mark.parametrize("rows, pairs, dtype", [(1, 4, "float32"), (200, 1600, "bfloat16"),
                                                (3, 0, "float32")])
def test_shoals_writer_gives_what_protobuf_writes_and_reads_what_protobuf_wrote(
        rows, pairs, dtype):
    hidden, index, experts = _request_parts(rows, pairs, dtype)
    fields = {"seq": 2**40 + 3, "layer": 61, "call_pairs": 130,
              "prefetch": shoal_pb2.PrefetchHint(layer=62, experts=[5, 300])}
    ours = EXPERT_REQUEST.write(shoal_pb2.ExpertRequest(**fields), hidden=(hidden, dtype),
                                rows=(index, "int32"), experts=(experts, "int32"))
    theirs = shoal_pb2.ExpertRequest(
        **fields, hidden=tensor_fields(hidden, dtype), rows=tensor_fields(index, "int32"),
        experts=tensor_fields(experts, "int32"))
    assert shoal_pb2.ExpertRequest.FromString(ours) == theirs  # protobuf reads ours
    for data in (ours, theirs.SerializeToString()):  # ours reads protobuf's (tensors first)
        message, tensors = EXPERT_REQUEST.read(data, "request")
        assert message == shoal_pb2.ExpertRequest(**fields)  # everything but the tensors
        assert sorted(tensors) == ["experts", "hidden", "rows"]
        assert tensors["hidden"].dtype == dtype and tensors["hidden"].shape == hidden.shape
        for name, array in (("hidden", hidden), ("rows", index), ("experts", experts)):
            assert np.array_equal(decode(tensors[name], what=name), array)


def test_a_read_tensor_is_a_view_of_the_received_bytes_not_a_copy():
    output = np.arange(4096, dtype=np.float32).reshape(8, 512)
    data = EXPERT_REPLY.write(shoal_pb2.ExpertReply(seq=9), output=(output, "float32"))
    message, tensors = EXPERT_REPLY.read(data, "reply")
    assert message.seq == 9
    view = tensors["output"].data
    assert isinstance(view, memoryview) and view.obj is data
    assert np.array_equal(decode(tensors["output"], what="output"), output)


def test_the_reader_takes_any_valid_encoding_and_skips_fields_it_does_not_know():
    # shape one varint at a time (valid protobuf, not what protobuf writes), an unknown
    # field inside the Tensor and one outside, fixed-width fields among them
    inner = (b"\x0a\x05int32" + b"\x10\x02" + b"\x10\x01"  # dtype, then shape 2, then 1
             + b"\x25\x00\x00\x80\x3f"  # field 4, fixed32: unknown
             + b"\x1a\x08" + np.array([4, 5], np.int32).tobytes())
    data = (b"\x08\x07"  # seq = 7
            + b"\x1a" + bytes([len(inner)]) + inner  # hidden
            + b"\xf9\x01" + b"\x00" * 8)  # field 31, fixed64: unknown
    head, tensors = split_message(data, {3})
    assert shoal_pb2.ExpertRequest.FromString(head).seq == 7
    hidden = tensors[3]
    assert (hidden.dtype, hidden.shape) == ("int32", (2, 1))
    assert decode(hidden, what="hidden").tolist() == [[4], [5]]
    assert split_message(b"", {3}) == (b"", {})


@pytest.mark.parametrize("data, problem", [
    (b"\x08", "cut short"),  # a varint field without its value
    (b"\x1a\x05\x0a\x01", "cut short"),  # a length beyond the end
    (b"\x08" + b"\xff" * 11, "cut short"),  # a varint longer than any
    (b"\x0b\x0c", "wire type 3"),  # a group: not in proto3
    (b"\x1a\x00\x1a\x00", "appears twice"),
    (b"\x08\x07\x18\x05", "tensor field 3 has wire type 0"),  # `hidden` as a varint
    (b"\x1a\x24\x12\x22" + b"\x01" * 34, "more than 32 dimensions"),
    (b"\x00\x01", "malformed"),  # field number 0
])
def test_the_reader_refuses_what_is_not_a_message_and_says_why(data, problem):
    with pytest.raises(InvalidInput, match=problem):
        split_message(data, {3}, what="request")


def test_a_head_protobuf_cannot_parse_is_refused_naming_the_message():
    # well framed, but `timing` (field 5) holds a group, which protobuf refuses
    with pytest.raises(InvalidInput, match="reply: not a valid ExpertReply"):
        EXPERT_REPLY.read(b"\x2a\x01\x0b", "reply")


def test_join_message_copies_a_view_that_is_not_contiguous():
    matrix = np.arange(24, dtype=np.int32).reshape(4, 6)
    data = join_message(b"", (3, matrix[:, ::2], "int32"))
    _, tensors = split_message(data, {3})
    assert decode(tensors[3], what="x").tolist() == matrix[:, ::2].tolist()
