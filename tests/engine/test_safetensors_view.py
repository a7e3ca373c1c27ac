import mlx.core as mx
import numpy as np
import pytest

from engine.errors import CorruptData
from engine.safetensors_view import placeholders, tensors_from_buffer


def test_tensors_from_a_buffer_equal_mlx_load(tmp_path):
    path = tmp_path / "e.safetensors"
    weights = {
        "up.weight": mx.random.normal((4, 8)),
        "down.weight": mx.random.normal((8, 4)).astype(mx.bfloat16),
        "gate.weight": mx.array(np.arange(12, dtype=np.uint32).reshape(3, 4)),
        "gate.scales": mx.random.normal((3,)).astype(mx.float16),
    }
    mx.save_safetensors(str(path), weights, metadata={"format": "shoal-expert"})
    buffer = bytearray(path.read_bytes())
    out = tensors_from_buffer(memoryview(buffer), origin=str(path))
    buffer[:] = bytes(len(buffer))  # the arrays own their memory: reusing the buffer is safe
    assert set(out) == set(weights)
    for name, array in weights.items():
        assert out[name].dtype == array.dtype and out[name].shape == array.shape
        assert mx.array_equal(out[name], array).item(), name
    zeros = placeholders(path)
    assert {k: (v.shape, v.dtype) for k, v in zeros.items()} == {
        k: (v.shape, v.dtype) for k, v in weights.items()
    }


def test_a_damaged_file_is_refused_with_its_name(tmp_path):
    path = tmp_path / "e.safetensors"
    mx.save_safetensors(str(path), {"w": mx.zeros((16, 16))})
    data = path.read_bytes()
    with pytest.raises(CorruptData, match="e.safetensors"):
        tensors_from_buffer(memoryview(data[:-10]), origin=str(path))
    with pytest.raises(CorruptData, match="header"):
        tensors_from_buffer(memoryview(data[:8] + b"{" * (len(data) - 8)), origin=str(path))
