"""The wire contract: shoal.proto, its generated code (proto/generate.sh), and the few
settings both ends must agree on."""

import grpc

from engine.errors import CorruptData, InvalidInput, Moved, NotFound, Unauthenticated, Unavailable

PROTOCOL_VERSION = 1
# Prefill chunks can carry hundreds of MB of activations; gRPC's 4 MB default is far too small.
MESSAGE_LIMIT = 2**31 - 1
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MESSAGE_LIMIT),
    ("grpc.max_receive_message_length", MESSAGE_LIMIT),
]

# Shoal's errors on the wire: a worker answers each with its status code and the same message,
# and the coordinator turns the code back into the same error. One table, read both ways.
ERROR_CODES = (
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Moved, grpc.StatusCode.ABORTED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (CorruptData, grpc.StatusCode.DATA_LOSS),
)


def status_for(error: Exception) -> grpc.StatusCode:
    """The status code a worker answers a ShoalError with (FAILED_PRECONDITION otherwise)."""
    return next((code for kind, code in ERROR_CODES if isinstance(error, kind)),
                grpc.StatusCode.FAILED_PRECONDITION)


def error_class_for(code: grpc.StatusCode) -> type | None:
    """The ShoalError class a status code stands for; None for codes Shoal does not send."""
    return next((kind for kind, known in ERROR_CODES if known == code), None)
