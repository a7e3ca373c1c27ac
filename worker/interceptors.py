"""The worker's gRPC interceptors: the credential checked from a call's headers (a refusal
never waits for a body), a bound on calls from one host, and error messages bounded in size.
"""

from __future__ import annotations

import contextlib
import heapq
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from engine.auth import HEALTH_CHECK, METADATA_KEY, CredentialChecker
from engine.errors import MAX_MESSAGE, Unauthenticated, clip
from proto import HANDLER_KINDS
from worker.grpc_gate import Gate

# Liveness answers without the credential, deliberately: it tells only SERVING or NOT_SERVING
# (no more than the Bonjour advert does), and it keeps "alive but holding another secret"
# (unauthenticated) apart from "not answering" (unreachable). Every Shoal method needs it.
# The one-shot Check only: Health/Watch streams never end, so a peer without a credential
# could hold every call the worker serves at once (MAX_CALLS) with them.
UNAUTHENTICATED_METHODS = frozenset({HEALTH_CHECK})


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
# Liveness checks without a valid credential at once from one host, and how long a check may
# take to send its request: a check is answered at once, so these bound only a peer that opens
# checks and never finishes them, which would otherwise hold the worker's calls (MAX_CALLS).
# A coordinator's checks carry a credential and count as its other calls do.
CHECKS_PER_PEER = 8
CHECK_BODY_SECONDS = 2.0


class _Deadlines:
    """Calls `cancel` at a deadline, for many calls from one thread started once (a timer
    thread per check would need a new thread for every check the worker answers)."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._count = 0
        self._changed = threading.Condition()
        threading.Thread(target=self._run, name="check-deadlines", daemon=True).start()

    def add(self, seconds: float, cancel: Callable[[], None]) -> int:
        with self._changed:
            self._count += 1
            heapq.heappush(self._due, (time.monotonic() + seconds, self._count, cancel))
            self._changed.notify()
            return self._count

    def remove(self, key: int) -> None:
        with self._changed:
            self._due = [due for due in self._due if due[1] != key]
            heapq.heapify(self._due)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._changed.wait(self._due[0][0] - time.monotonic() if self._due else None)
                _, _, cancel = heapq.heappop(self._due)
            with contextlib.suppress(Exception):
                cancel()


class PeerLimit(grpc.ServerInterceptor):
    """At most MAX_CALLS_PER_PEER calls at once from one host (RESOURCE_EXHAUSTED beyond),
    so that one client, however many connections it opens, cannot take every thread of the
    worker from the others; the server's own cap bounds the total (worker/daemon.py). The
    liveness check has a small count of its own, and a deadline for its request."""

    def __init__(self, checker: CredentialChecker | None = None,
                 limit: int = MAX_CALLS_PER_PEER, gate: Gate | None = None) -> None:
        self.checker = checker
        self.gate = gate  # the front door, which relays every connection
        self.limit = limit
        self._calls: dict[tuple[str, bool], int] = {}  # (host, liveness check?) -> calls
        self._lock = threading.Lock()
        self._deadlines = _Deadlines()

    @contextlib.contextmanager
    def _slot(self, context: grpc.ServicerContext, *, check: bool = False) -> Iterator[None]:
        peer = context.peer()
        if self.gate is not None:
            self.gate.called(peer)
        key = (self.gate.host_of(peer) if self.gate else peer.rsplit(":", 1)[0], check)
        limit = CHECKS_PER_PEER if check else self.limit
        with self._lock:
            count = self._calls.get(key, 0)
            if count < limit:
                self._calls[key] = count + 1
        if count >= limit:
            what = "liveness checks" if check else "calls"
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{count} {what} from {key[0]} at once already; the limit is {limit}")
        try:
            yield
        finally:
            with self._lock:
                self._calls[key] -= 1

    def _credentialed(self, context: grpc.ServicerContext) -> bool:
        if self.checker is None:
            return False
        metadata = dict(context.invocation_metadata() or ())
        try:
            self.checker.check(metadata.get(METADATA_KEY), HEALTH_CHECK)
        except Unauthenticated:
            return False  # answered all the same, from the small share
        return True

    def _check(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """The liveness check as a streaming-request handler, so that it runs (and counts)
        from the call's headers: its request must follow within CHECK_BODY_SECONDS, or the
        call is cancelled."""
        behavior = handler.unary_unary

        def check(requests, context):
            with self._slot(context, check=not self._credentialed(context)):
                deadline = self._deadlines.add(CHECK_BODY_SECONDS, context.cancel)
                try:
                    request = next(requests, None)
                except grpc.RpcError:  # cancelled at the deadline: the slot is free again
                    return None
                finally:
                    self._deadlines.remove(deadline)
                if request is None:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a check without a request")
                return behavior(request, context)

        return grpc.stream_unary_rpc_method_handler(
            check, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        if handler_call_details.method in UNAUTHENTICATED_METHODS:
            return self._check(handler)
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
    except the liveness check (UNAUTHENTICATED_METHODS)."""

    def __init__(self, checker: CredentialChecker) -> None:
        self.checker = checker

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method in UNAUTHENTICATED_METHODS:
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        try:
            self.checker.check(metadata.get(METADATA_KEY), handler_call_details.method)
        except Unauthenticated as e:
            return _refusal(handler, str(e))
        return handler
