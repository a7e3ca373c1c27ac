import mlx.core as mx
import numpy as np
import pytest

from engine import tensors
from engine.tensors import dtype_name, from_numpy, to_mlx, to_numpy
from proto import shoal_pb2
from proto.wire import decode
from tests.wire import tensor_fields


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.int32])
def test_round_trip_is_bit_exact(dtype):
    array = (mx.random.normal((3, 5)) * 100).astype(dtype)
    name = dtype_name(dtype)
    wire = shoal_pb2.Tensor(**tensor_fields(to_numpy(array), name))
    back = from_numpy(decode(wire, what="x"), name)
    assert back.dtype == dtype
    assert mx.array_equal(back, array).item()


@pytest.mark.parametrize("one_buffer", [False, True])  # True: CUDA's way, staged in one buffer
def test_to_mlx_keeps_every_byte_of_every_segment_whatever_their_sizes(one_buffer, monkeypatch):
    monkeypatch.setattr(tensors, "_managed_memory", lambda: one_buffer)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 5)).astype(np.float32)  # 60 bytes: the next starts aligned
    b = rng.standard_normal((1, 5)).astype(np.float32)
    half = rng.standard_normal((3, 3)).astype(np.float32)
    bf16 = (mx.array(half).astype(mx.bfloat16)).view(mx.uint16)
    index = np.array([3, 0, 2, 1], dtype=np.int32)
    values, places, brain = to_mlx(([a, b], mx.float32), ([index], mx.int32),
                                   ([np.asarray(bf16)], mx.bfloat16))
    assert np.array_equal(np.asarray(values), np.concatenate([a, b]))
    assert np.array_equal(np.asarray(places), index)
    assert brain.dtype == mx.bfloat16 and brain.shape == (3, 3)
    assert mx.array_equal(brain, mx.array(half).astype(mx.bfloat16)).item()
    assert np.array_equal(np.asarray(values[places]), np.concatenate([a, b])[index])
    (single,) = to_mlx(([index], mx.int32))
    assert np.array_equal(np.asarray(single), index)
