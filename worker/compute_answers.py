"""What a Compute message gets, whichever transport brought it (the expert lane's
worker/lane_server.py, gRPC's worker/service.py): the request's bytes in, the reply's bytes
out, or a refusal (`Refused`) with the status code and message both transports answer with."""

from __future__ import annotations

import errno
import os
import time

import grpc

from engine.errors import ShoalError
from engine.tensors import dtype_name, to_numpy
from proto import EXPERT_REPLY, EXPERT_REQUEST, shoal_pb2, status_for
from proto.wire import WireView, decode
from worker.residency import Request, Residency, Timing

ACTIVATION_DTYPES = ("float32", "bfloat16", "float16")


def decode_request(message: shoal_pb2.ExpertRequest, tensors: dict[str, WireView]) -> Request:
    """A Compute request (EXPERT_REQUEST.read) as checked numpy views of its bytes."""
    hidden = decode(tensors.get("hidden", WireView()), what="hidden", dtypes=ACTIVATION_DTYPES,
                    ndim=2)
    rows = decode(tensors.get("rows", WireView()), what="rows", dtypes=("int32",), ndim=1)
    experts = decode(tensors.get("experts", WireView()), what="experts", dtypes=("int32",),
                     ndim=1)
    return Request(message.layer, hidden, tensors["hidden"].dtype, rows, experts,
                   message.call_pairs)


AT_THREAD_LIMIT = ("busy: this worker is at its thread limit (its process may start no more "
                   "threads), ask another copy or later")


def at_thread_limit(error: BaseException) -> bool:
    """Whether `error` is the OS refusing a new thread (EAGAIN): MLX starts one on a thread's
    first compute, Python's threading says "can't start new thread"."""
    text = str(error)
    return getattr(error, "errno", None) == errno.EAGAIN or "can't start new thread" in text \
        or os.strerror(errno.EAGAIN) in text


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
        except (RuntimeError, OSError) as e:
            if not at_thread_limit(e):
                raise
            raise Refused(grpc.StatusCode.UNAVAILABLE, AT_THREAD_LIMIT) from None
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
                    bookkeeping=computed - parsed - timing.matrix - timing.waited
                    - timing.reads,
                    reply=done - computed, waited=timing.waited, reads=timing.reads),
            ),
            output=(output, dtype_name(out.dtype)),
        )

    def sent(self) -> None:
        """A reply was sent: its tokens count as served now (Holdings.asked)."""
        self.residency.holdings.settle()
