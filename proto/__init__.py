"""The wire contract: shoal.proto, its generated code (proto/generate.sh), and the few
settings both ends must agree on."""

import grpc
from google.protobuf import message_factory

from engine.errors import CorruptData, InvalidInput, Moved, NotFound, Unauthenticated, Unavailable
from engine.tls import NAME, Identity, door_proxy
from proto import shoal_pb2
from proto.wire import TensorMessage

PROTOCOL_VERSION = 1
# Prefill chunks can carry hundreds of MB of activations; gRPC's 4 MB default is far too small.
MESSAGE_LIMIT = 2**31 - 1
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MESSAGE_LIMIT),
    ("grpc.max_receive_message_length", MESSAGE_LIMIT),
]
# What a worker reads from one message at most: a 2048-token prompt chunk of a 7168-wide
# model in float32 is 59 MB; anything far larger is refused before it is held in memory.
REQUEST_LIMIT = 256 << 20
# Bytes of an expert file one ExpertChunk carries (PushExpert, ReadExpert; the last may be
# shorter): the size both senders, the coordinator's and a worker's, cut a file into.
CHUNK_BYTES = 1 << 20
# as the expert lane gives a connection to prove itself (worker/lane_server.py)
HANDSHAKE_SECONDS = 5
IDLE_SECONDS = 30  # a connection with no call in progress for this long is closed
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MESSAGE_LIMIT),
    ("grpc.max_receive_message_length", REQUEST_LIMIT),
    # coordinators ping idle links (coordinator/dataplane/link.py KEEPALIVE): allow it
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    # A connection must finish its TLS handshake within this (gRPC's default is 120 s): idle
    # connections from a peer without the cluster's identity are closed before they add up
    # to the process's file limit and lock coordinators out.
    ("grpc.server_handshake_timeout_ms", HANDSHAKE_SECONDS * 1000),
    # After the handshake too: a connection that holds no call is closed (GOAWAY), so idle
    # ones cannot add up either; a coordinator's channel connects again at its next call.
    ("grpc.max_connection_idle_ms", IDLE_SECONDS * 1000),
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


# Links are TLS, both ends presenting the cluster's certificate (engine/tls.py). Workers are
# reached by IP address or .local name, so the client checks the name the certificate holds.
TLS_CHANNEL_OPTIONS = [("grpc.ssl_target_name_override", NAME)]


def secure_channel(address: str, identity: Identity, options: list, *,
                   door: bool = True) -> grpc.Channel:
    """A channel to a worker that shows its front door the cluster's pass on each connection
    (worker/grpc_gate.py), then proves the cluster's certificate; `door=False` for a bare gRPC
    server with the cluster's certificate and no front door (which the pass would confuse)."""
    credentials = grpc.ssl_channel_credentials(
        root_certificates=identity.authority, private_key=identity.key,
        certificate_chain=identity.certificate)
    shown = door and "%" not in address
    proxy = [("grpc.http_proxy", door_proxy(address, identity))] if shown else []
    return grpc.secure_channel(address, credentials,
                               options=[*options, *proxy, *TLS_CHANNEL_OPTIONS])


def server_credentials(identity: Identity) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(identity.key, identity.certificate)],
                                       root_certificates=identity.authority,
                                       require_client_auth=True)


# The Compute stream's messages carry megabytes of tensors in a prompt pass: they cross gRPC as
# bytes both ways (no serializer), written and read by these two (proto/wire.py), which copy
# a tensor's bytes once (the sender's join; gRPC's own copies aside) where protobuf's Python API
# copies them five times over the two ends. What they write is ordinary protobuf: any client of
# shoal.proto can call Compute.
EXPERT_REQUEST = TensorMessage(shoal_pb2.ExpertRequest, "hidden", "rows", "experts")
EXPERT_REPLY = TensorMessage(shoal_pb2.ExpertReply, "output")
SERVICE = shoal_pb2.DESCRIPTOR.services_by_name["ExpertService"]
COMPUTE = f"/{SERVICE.full_name}/Compute"
HANDLER_KINDS = {  # (client streams, server streams) -> gRPC's handler of that kind
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_expert_service(servicer: object, server: grpc.Server) -> None:
    """Serve `servicer`'s ExpertService methods on `server`, as shoal_pb2_grpc's generated
    registration does, except that Compute takes and yields bytes (EXPERT_REQUEST/REPLY)."""
    handlers = {}
    for method in SERVICE.methods:
        make = HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        behaviour = getattr(servicer, method.name)
        if method.name == "Compute":
            handlers[method.name] = make(behaviour)
            continue
        handlers[method.name] = make(
            behaviour,
            request_deserializer=message_factory.GetMessageClass(method.input_type).FromString,
            response_serializer=message_factory.GetMessageClass(
                method.output_type).SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
