"""The wire contract: shoal.proto, its generated code (proto/generate.sh), and the few
settings both ends must agree on."""

PROTOCOL_VERSION = 1
# Prefill chunks can carry hundreds of MB of activations; gRPC's 4 MB default is far too small.
MESSAGE_LIMIT = 2**31 - 1
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MESSAGE_LIMIT),
    ("grpc.max_receive_message_length", MESSAGE_LIMIT),
]
