"""The worker's gRPC interceptors: the credential checked from a call's headers (a refusal
never waits for a body), a bound on calls from one host, and error messages bounded in size.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import grpc

from engine.auth import METADATA_KEY, CredentialChecker
from engine.errors import MAX_MESSAGE, Unauthenticated, clip
from proto import HANDLER_KINDS

# Liveness answers without the credential, deliberately: it tells only SERVING or NOT_SERVING
# (no more than the Bonjour advert does), and it keeps "alive but holding another secret"
# (unauthenticated) apart from "not answering" (unreachable). Every Shoal method needs it.
UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/",)


def _same_kind(handler: grpc.RpcMethodHandler, behavior: Callable) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind and (de)serializers as `handler` running
    `behavior`."""
    make = HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    return make(behavior, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def _behavior(handler: grpc.RpcMethodHandler) -> Callable:
    return (handler.unary_unary or handler.unary_stream or handler.stream_unary
            or handler.stream_stream)


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler that refuses the call at once, from its headers: always of a streaming-
    request kind, so that the server never waits for a body (a unary handler would first
    read it, and a caller that never sends one would hold a thread for as long as it likes).
    The client cannot tell: the wire is the same, and the call ends before any message."""

    def refuse(request_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    return grpc.stream_unary_rpc_method_handler(refuse)


MAX_CALLS_PER_PEER = 24  # calls at once from one host: enough for a coordinator and tools


class PeerLimit(grpc.ServerInterceptor):
    """At most MAX_CALLS_PER_PEER calls at once from one host (RESOURCE_EXHAUSTED beyond),
    so that one client, however many connections it opens, cannot take every thread of the
    worker from the others; the server's own cap bounds the total (worker/daemon.py)."""

    def __init__(self, limit: int = MAX_CALLS_PER_PEER) -> None:
        self.limit = limit
        self._calls: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _slot(self, context: grpc.ServicerContext) -> Iterator[None]:
        host = context.peer().rsplit(":", 1)[0]
        with self._lock:
            count = self._calls.get(host, 0)
            if count < self.limit:
                self._calls[host] = count + 1
        if count >= self.limit:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{count} calls from {host} at once already; the limit is {self.limit}")
        try:
            yield
        finally:
            with self._lock:
                self._calls[host] -= 1

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(UNAUTHENTICATED_PREFIXES):
            return handler  # liveness checks are short and must always answer
        behavior = _behavior(handler)
        if handler.response_streaming:
            def limited(request, context):
                with self._slot(context):
                    yield from behavior(request, context)
        else:
            def limited(request, context):
                with self._slot(context):
                    return behavior(request, context)
        return _same_kind(handler, limited)


class _BoundedContext:
    """A handler's context whose error messages are cut to MAX_MESSAGE characters."""

    def __init__(self, context: grpc.ServicerContext) -> None:
        self._context = context

    def __getattr__(self, name: str):
        return getattr(self._context, name)

    def abort(self, code: grpc.StatusCode, details: str):
        self._context.abort(code, clip(details, MAX_MESSAGE))

    def set_details(self, details: str) -> None:
        self._context.set_details(clip(details, MAX_MESSAGE))


class BoundedErrors(grpc.ServerInterceptor):
    """Every error message a handler sends is at most MAX_MESSAGE characters: a message that
    quotes what a client sent (a 64 KiB dtype name) must not outgrow the metadata limit of
    the client reading it, which then saw a transport error instead of the refusal."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        behavior = _behavior(handler)
        return _same_kind(handler, lambda request, context: behavior(
            request, _BoundedContext(context)))


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose `shoal-auth` credential does not prove the cluster secret,
    except the liveness checks (UNAUTHENTICATED_PREFIXES)."""

    def __init__(self, checker: CredentialChecker) -> None:
        self.checker = checker

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(UNAUTHENTICATED_PREFIXES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        try:
            self.checker.check(metadata.get(METADATA_KEY), handler_call_details.method)
        except Unauthenticated as e:
            return _refusal(handler, str(e))
        return handler
