"""Compute messages as any other client of shoal.proto would write them: with protobuf's own
API, not Shoal's writer (proto/wire.py: join_message), so that tests see the worker read
both."""

import numpy as np


def tensor_fields(array: np.ndarray, dtype: str) -> dict:
    """The fields of a proto Tensor holding `array` (in the wire's byte layout for `dtype`), to
    give a message's tensor field: `ExpertRequest(hidden=tensor_fields(...))`."""
    return {"dtype": dtype, "shape": array.shape, "data": array.tobytes()}
