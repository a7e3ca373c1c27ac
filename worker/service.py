"""The gRPC servicer of the expert service: validate, delegate, map errors. Compute's messages
are answered by the same `ComputeAnswers` as the lane's (worker/compute_answers.py); no expert
logic lives here (`Residency` owns it), and the interceptors are worker/interceptors.py's."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc

from engine.errors import ShoalError
from proto import PROTOCOL_VERSION, shoal_pb2, shoal_pb2_grpc, status_for
from worker.compute_answers import ComputeAnswers, Refused
from worker.residency import Residency
from worker.store import free_disk
from worker.transfer import ExpertFiles, FileState, TransferChunk


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
            streaming=self.residency.streaming,
            read_bps=int((self.residency.reader.read_bps or 0)
                         * len(self.residency.scan.folders)),
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
