"""The gRPC servicer: check the credential, decode and validate, delegate, map errors.

No expert logic lives here; `Residency` owns it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from engine.auth import METADATA_KEY, CredentialChecker
from engine.errors import (
    MAX_MESSAGE,
    ShoalError,
    Unauthenticated,
    clip,
)
from engine.tensors import WireView, decode, dtype_name, to_numpy
from proto import (
    EXPERT_REPLY,
    EXPERT_REQUEST,
    HANDLER_KINDS,
    PROTOCOL_VERSION,
    shoal_pb2,
    shoal_pb2_grpc,
    status_for,
)
from worker.residency import Request, Residency, Timing
from worker.store import free_disk
from worker.transfer import ExpertFiles, FileState, TransferChunk

ACTIVATION_DTYPES = ("float32", "bfloat16", "float16")
# Liveness answers without the credential, deliberately: it tells only SERVING or NOT_SERVING
# (no more than the Bonjour advert does), and it keeps "alive but holding another secret"
# (unauthenticated) apart from "not answering" (unreachable). Every Shoal method needs it.
UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/",)

def decode_request(message: shoal_pb2.ExpertRequest, tensors: dict[str, WireView]) -> Request:
    """A Compute request (EXPERT_REQUEST.read) as checked numpy views of its bytes."""
    hidden = decode(tensors.get("hidden", WireView()), what="hidden", dtypes=ACTIVATION_DTYPES,
                    ndim=2)
    rows = decode(tensors.get("rows", WireView()), what="rows", dtypes=("int32",), ndim=1)
    experts = decode(tensors.get("experts", WireView()), what="experts", dtypes=("int32",),
                     ndim=1)
    return Request(message.layer, hidden, tensors["hidden"].dtype, rows, experts,
                   message.call_pairs)


class Refused(ShoalError):
    """A Compute message refused: the status code and message both transports answer with
    (the gRPC stream aborts with them, the expert lane sends them in an ERROR frame)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ComputeAnswers:
    """What a worker does with each Compute message, whichever transport brought it: the
    request's bytes in, its reply's bytes out (None for a prefetch hint alone)."""

    def __init__(self, residency: Residency) -> None:
        self.residency = residency

    def answer(self, data: bytes | bytearray) -> bytes | None:
        """Raises Refused with the code and message to answer a bad request with."""
        started = time.perf_counter()
        try:
            message, tensors = EXPERT_REQUEST.read(data, "request")
        except ShoalError as e:
            raise Refused(status_for(e), str(e)) from None
        if message.HasField("prefetch"):
            self.residency.prefetch(message.prefetch.layer, message.prefetch.experts)
        if "hidden" not in tensors:
            return None
        timing = Timing()
        try:
            request = decode_request(message, tensors)
            parsed = time.perf_counter()
            out = self.residency.compute(request, timing)
        except ShoalError as e:
            raise Refused(status_for(e), f"request {message.seq}: {e}") from None
        computed = time.perf_counter()
        output = to_numpy(out)
        done = time.perf_counter()  # the copy into the reply's bytes follows: in the wire
        return EXPERT_REPLY.write(
            shoal_pb2.ExpertReply(
                seq=message.seq,
                compute_seconds=done - started - timing.waited,
                inventory_version=self.residency.holdings.version,
                timing=shoal_pb2.WorkerTiming(
                    parse=parsed - started, matrix=timing.matrix,
                    bookkeeping=computed - parsed - timing.matrix - timing.waited,
                    reply=done - computed, waited=timing.waited),
            ),
            output=(output, dtype_name(out.dtype)),
        )

    def sent(self) -> None:
        """A reply was sent: its tokens count as served now (Holdings.asked)."""
        self.residency.holdings.settle()


class ExpertServicer(shoal_pb2_grpc.ExpertServiceServicer):
    def __init__(self, residency: Residency, node_id: str, memory_budget: int = 0,
                 lane_port: int = 0) -> None:
        self.residency = residency
        self.node_id = node_id
        self.memory_budget = memory_budget
        self.lane_port = lane_port
        self.answers = ComputeAnswers(residency)
        self.files = ExpertFiles(residency, residency.scan.folders, residency.scan.manifest)

    def GetInventory(self, request, context):  # noqa: N802 (gRPC's name)
        manifest = self.residency.scan.manifest
        return shoal_pb2.Inventory(
            node_id=self.node_id,
            fingerprint=manifest.fingerprint,
            model_type=manifest.model_type,
            protocol_version=PROTOCOL_VERSION,
            experts=[shoal_pb2.HeldExpert(layer=lay, expert=e) for lay, e in self.residency.held()],
            problems=self.residency.snapshot().problems,
            memory_budget=self.memory_budget,
            free_disk=free_disk(self.residency.scan.folders),
            inventory_version=self.residency.holdings.version,
            draining=[shoal_pb2.HeldExpert(layer=lay, expert=e)
                      for lay, e in self.residency.holdings.draining()],
            lane_port=self.lane_port,
        )

    def Compute(self, request_iterator, context) -> Iterator[bytes]:  # noqa: N802
        # Messages arrive and leave as bytes (proto.add_expert_service): see EXPERT_REQUEST.
        for data in request_iterator:
            try:
                reply = self.answers.answer(data)
            except Refused as e:
                context.abort(e.code, str(e))
            if reply is not None:
                yield reply
                self.answers.sent()

    def GetStats(self, request, context):  # noqa: N802
        snap = self.residency.snapshot()
        return shoal_pb2.WorkerStats(
            node_id=self.node_id,
            memory_budget=snap.budget,
            expert_bytes=snap.expert_bytes,
            resident_bytes=snap.resident_bytes,
            resident_experts=snap.resident_experts,
            held_experts=snap.held_experts,
            read_buffer_bytes=snap.buffer_bytes,
            drives=[
                shoal_pb2.DriveStats(
                    folder=str(d.folder), bytes_read=d.bytes_read, reads=d.reads,
                    active_seconds=d.active_seconds, failed=d.failed or "",
                )
                for d in snap.drives
            ],
            problems=snap.problems,
            **vars(snap.counters),
        )


    def GetHeat(self, request, context):  # noqa: N802
        holdings = self.residency.holdings
        return shoal_pb2.HeatReport(
            node_id=self.node_id,
            boot_id=holdings.boot_id,
            experts=[shoal_pb2.ExpertHeat(layer=layer, expert=expert, tokens=count)
                     for (layer, expert), count in sorted(holdings.tokens().items())],
        )

    def ExpertFileStatus(self, request, context):  # noqa: N802
        return self._answer(context, lambda: self.files.status((request.layer, request.expert)))

    def PushExpert(self, request_iterator, context):  # noqa: N802
        chunks = (TransferChunk(c.layer, c.expert, c.offset, c.data, c.total_bytes, c.sha256)
                  for c in request_iterator)
        return self._answer(context, lambda: self.files.receive(chunks))

    def ReadExpert(self, request, context):  # noqa: N802
        try:
            for c in self.files.read((request.layer, request.expert), request.offset):
                yield shoal_pb2.ExpertChunk(layer=c.layer, expert=c.expert, offset=c.offset,
                                            data=c.data, total_bytes=c.total_bytes,
                                            sha256=c.sha256)
        except ShoalError as e:
            context.abort(status_for(e), str(e))

    def DropExpert(self, request, context):  # noqa: N802
        key = (request.layer, request.expert)
        phases = {
            shoal_pb2.DropRequest.DRAIN: lambda: self.files.drain(key),
            shoal_pb2.DropRequest.KEEP: lambda: self.files.keep(key),
            shoal_pb2.DropRequest.DELETE: lambda: self.files.delete(key, request.quiet_seconds),
        }
        if request.phase not in phases:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "DropExpert needs a phase")
        return self._answer(context, phases[request.phase])

    @staticmethod
    def _answer(context, call: Callable[[], FileState]) -> shoal_pb2.ExpertFileState:
        try:
            s = call()
        except ShoalError as e:
            context.abort(status_for(e), str(e))
        return shoal_pb2.ExpertFileState(
            layer=s.key[0], expert=s.key[1],
            state=shoal_pb2.ExpertFileState.State.Value(s.state.upper()),
            partial_bytes=s.partial_bytes, idle_seconds=s.idle_seconds,
            inventory_version=s.inventory_version,
        )


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
