"""Running a migration plan's steps against live workers over gRPC, the coordinator's side of
worker/transfer.py; what to do is decided in engine/migration.py and engine/rebalance_plan.py,
this module only talks to the workers."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from tqdm import tqdm

from coordinator.dataplane.link import CONNECT_TIMEOUT, WorkerLink
from coordinator.dataplane.link_errors import error_for
from engine.errors import CorruptData, InvalidInput, NotFound, ShoalError, Unavailable
from engine.manifest import ExpertKey, Manifest
from engine.migration import LOCAL, MigrationPlan, Step
from engine.rebalance_plan import copy_sources, wait_before_delete
from proto import CHUNK_BYTES, shoal_pb2

QUIET_SECONDS = 1.0  # a drained copy is deleted once nobody asked for it for this long
DELETE_TIMEOUT = 60.0
SLOWEST_CHECK = 20e6  # bytes/s a worker's check of a file on disk is allowed (a slow USB disk)
_FILE_STATE = shoal_pb2.ExpertFileState


Event = Callable[[str, Step, int], None]  # ("step" | "resume" | "chunk" | "done", step, bytes)


@dataclass
class Execution:
    steps_done: int = 0
    copied_bytes: int = 0  # bytes sent over the network
    resumed_bytes: int = 0  # bytes of partial files a copy did not need to send again
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    rot: list[str] = field(default_factory=list)  # copies found rotted on disk, and where


class _SourceFailed(Exception):
    pass


# Copies are streamed in chunks (from this machine's files, or relayed from a worker that holds
# the expert) and verified by the receiver before it serves them; a copy is drained, then
# deleted, only once another worker serves a verified one, and right before a deletion the copy
# kept is hashed again on its worker's disk, so a copy that rotted since its worker started is
# caught and the one about to be deleted is kept instead.
class Executor:
    """Runs a plan's steps against live workers (their links, by the names the plan uses),
    one at a time, in order."""

    def __init__(
        self,
        manifest: Manifest,
        links: Mapping[str, WorkerLink],
        local: Mapping[ExpertKey, Path],
        *,
        log: Callable[[str], None],
        on_event: Event | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        quiet: float = QUIET_SECONDS,
        progress: bool = True,
    ) -> None:
        self.files = {(e.layer, e.expert): e for e in manifest.experts}
        self.links = dict(links)
        self.local = local
        self.log = log
        self.on_event = on_event or (lambda *_: None)
        self.chunk_bytes = chunk_bytes
        self.quiet = quiet
        self.progress = progress
        self.done = Execution()
        self._drained: dict[tuple[ExpertKey, str], float] = {}  # when this run drained a copy
        # One handler per kind of step (engine/migration.py's KINDS), in the order they run.
        self._handlers: dict[str, Callable[[Step], None]] = {
            "copy": self._copy,
            "verify": self._verify,
            "keep": self._keep,
            "drain": self._drain,
            "delete": self._delete,
        }

    def run(self, plan: MigrationPlan, what: str) -> Execution:
        started = time.perf_counter()
        total = plan.copy_bytes
        self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=what,
                        disable=None if self.progress and total else True,  # None: off a terminal
                        file=sys.stderr)
        with self.bar:
            for index, step in enumerate(plan.steps):
                self.on_event("step", step, 0)
                try:
                    self._run_step(step)
                except ShoalError as e:
                    after = ("Run the command again once the rot is understood: it sends a "
                             "fresh copy from an intact one" if self.done.rot else
                             "Every expert still has a verified copy; run the command again "
                             "to finish")
                    raise type(e)(
                        f"stopped at step {index + 1} of {len(plan.steps)} ({step.describe()}): "
                        f"{e}. {after}"
                    ) from None
                self.done.steps_done += 1
                self.done.counts[step.kind] = self.done.counts.get(step.kind, 0) + 1
                self.on_event("done", step, 0)
        self.done.seconds = time.perf_counter() - started
        return self.done

    def _run_step(self, step: Step) -> None:
        handler = self._handlers.get(step.kind)
        if handler is None:
            raise InvalidInput(f"unknown step {step.kind!r}")
        handler(step)

    # -- the steps ------------------------------------------------------------------------

    def _status(self, worker: str, key: ExpertKey) -> shoal_pb2.ExpertFileState:
        request = shoal_pb2.ExpertFileRequest(layer=key[0], expert=key[1])
        return self.links[worker].call("ExpertFileStatus", request)

    def _drop(self, worker: str, key: ExpertKey, phase: int) -> shoal_pb2.ExpertFileState:
        request = shoal_pb2.DropRequest(layer=key[0], expert=key[1], phase=phase,
                                        quiet_seconds=self.quiet)
        timeout = CONNECT_TIMEOUT
        if phase == shoal_pb2.DropRequest.KEEP:  # the worker hashes the file first
            timeout += self.files[key].bytes / SLOWEST_CHECK
        return self.links[worker].call("DropExpert", request, timeout=timeout)

    def _copy(self, step: Step) -> None:
        status = self._status(step.worker, step.key)
        if status.state == _FILE_STATE.DRAINING:
            self._drop(step.worker, step.key, shoal_pb2.DropRequest.KEEP)
        if status.state in (_FILE_STATE.SERVING, _FILE_STATE.DRAINING):
            self.bar.update(step.bytes)
            return
        offset = status.partial_bytes if status.state == _FILE_STATE.PARTIAL else 0
        if offset:
            self.on_event("resume", step, offset)
            self.log(f"resuming expert {step.key[0]}/{step.key[1]} on {step.worker} at byte "
                     f"{offset} of {step.bytes}")
            self.done.resumed_bytes += offset
            self.bar.update(offset)
        for source in copy_sources(step, self.links, local=step.key in self.local):
            try:
                reply = self._push(step, source, offset)
            except (_SourceFailed, CorruptData) as e:  # CorruptData: the receiver's check
                self.log(f"warning: {source} could not send expert {step.key[0]}/{step.key[1]}: "
                         f"{e}; trying another copy")
                if isinstance(e, CorruptData) and source != LOCAL:
                    self._check_source(source, step.key)
                offset = self._status(step.worker, step.key).partial_bytes
                continue
            if reply.state == _FILE_STATE.SERVING:
                return
            raise ShoalError(f"{step.worker} has {reply.partial_bytes} of {step.bytes} bytes")
        raise Unavailable(f"no copy of expert {step.key[0]}/{step.key[1]} could be sent")

    def _check_source(self, source: str, key: ExpertKey) -> None:
        """The bytes a worker sent failed the receiver's check: have it hash its own file (a
        serving copy's KEEP), so that a copy that rotted there is reported and no longer
        served, not sent again."""
        try:
            if self._status(source, key).state == _FILE_STATE.SERVING:
                self._drop(source, key, shoal_pb2.DropRequest.KEEP)
        except CorruptData as e:
            self.done.rot.append(f"{source}: {e}")
            self.log(f"warning: the copy on {source} rotted on disk: {e}")
        except ShoalError:
            pass  # unreachable now: the next run looks again

    def _push(self, step: Step, source: str, offset: int) -> shoal_pb2.ExpertFileState:
        entry = self.files[step.key]
        failure: list[BaseException] = []

        def chunks() -> Iterator[shoal_pb2.ExpertChunk]:
            # The first chunk names the file and where this push starts, even with no bytes
            # (a partial file that is complete only needs its check and rename).
            yield shoal_pb2.ExpertChunk(layer=step.key[0], expert=step.key[1], offset=offset,
                                        total_bytes=entry.bytes, sha256=entry.sha256)
            sent = offset
            try:
                for data in self._read(source, step.key, offset):
                    yield shoal_pb2.ExpertChunk(layer=step.key[0], expert=step.key[1],
                                                offset=sent, data=data)
                    sent += len(data)
                    self.done.copied_bytes += len(data)
                    self.bar.update(len(data))
                    self.on_event("chunk", step, sent)
            except (ShoalError, OSError) as e:
                failure.append(e)

        reply = self.links[step.worker].call("PushExpert", chunks(), timeout=None)
        if failure:
            raise _SourceFailed(str(failure[0]))
        return reply

    def _read(self, source: str, key: ExpertKey, offset: int) -> Iterator[bytes]:
        if source == LOCAL:
            with open(self.local[key], "rb") as f:
                f.seek(offset)
                while block := f.read(self.chunk_bytes):
                    yield block
            return
        link = self.links[source]
        request = shoal_pb2.ExpertFileRequest(layer=key[0], expert=key[1], offset=offset)
        stream = link.call("ReadExpert", request, timeout=None)
        try:
            for chunk in stream:
                for start in range(0, len(chunk.data), self.chunk_bytes):
                    yield chunk.data[start:start + self.chunk_bytes]
        except grpc.RpcError as e:
            raise error_for(e, link.address) from None
        finally:
            stream.cancel()  # the push stopped early (its receiver failed): stop reading too

    def _verify(self, step: Step) -> None:
        status = self._status(step.worker, step.key)
        if status.state != _FILE_STATE.SERVING:
            state = _FILE_STATE.State.Name(status.state).lower()
            raise CorruptData(f"after its copy, expert {step.key[0]}/{step.key[1]} is {state} "
                              f"on {step.worker}, not served")

    def _keep(self, step: Step) -> None:
        self._drop(step.worker, step.key, shoal_pb2.DropRequest.KEEP)

    def _served_elsewhere(self, step: Step) -> None:
        """Ask the other workers, now, whether one serves a verified copy."""
        for name in sorted(self.links):
            if name == step.worker:
                continue
            try:
                if self._status(name, step.key).state == _FILE_STATE.SERVING:
                    return
            except ShoalError:
                continue
        raise Unavailable(f"no other live worker serves expert {step.key[0]}/{step.key[1]} "
                          f"now, so the copy on {step.worker} is kept")

    def _intact_elsewhere(self, step: Step) -> None:
        """Make sure, right now, that another worker serves a copy that is intact on its disk:
        each serving copy is asked to `keep`, which hashes its file against the manifest. A
        rotted copy is reported (and no longer served there) and the next one is tried; with
        none intact, the copy on `step.worker` is kept and served again, and CorruptData
        stops the run."""
        rotted = []
        for name in sorted(self.links):
            if name == step.worker:
                continue
            try:
                if self._status(name, step.key).state != _FILE_STATE.SERVING:
                    continue
                self._drop(name, step.key, shoal_pb2.DropRequest.KEEP)
                return
            except CorruptData as e:
                rotted.append(f"{name}: {e}")
                self.done.rot.append(f"{name}: {e}")
                self.log(f"warning: the copy on {name} rotted on disk: {e}")
            except ShoalError:
                continue
        what = f"expert {step.key[0]}/{step.key[1]}"
        if not rotted:
            raise Unavailable(f"no other live worker serves {what} now, so the copy on "
                              f"{step.worker} is kept")
        try:
            self._drop(step.worker, step.key, shoal_pb2.DropRequest.KEEP)
        except CorruptData as e:
            raise CorruptData(f"every copy of {what} rotted on disk ({'; '.join(rotted)}; "
                              f"{step.worker}: {e}); restore it with `shoal deploy`") from None
        raise CorruptData(f"every other copy of {what} rotted on disk ({'; '.join(rotted)}); "
                          f"the copy on {step.worker} was checked intact and is served again, "
                          "not deleted")

    def _drain(self, step: Step) -> None:
        self._served_elsewhere(step)
        self._drop(step.worker, step.key, shoal_pb2.DropRequest.DRAIN)
        self._drained[(step.key, step.worker)] = time.monotonic()

    def _delete(self, step: Step) -> None:
        deadline = time.monotonic() + DELETE_TIMEOUT
        while True:
            status = self._status(step.worker, step.key)
            if status.state in (_FILE_STATE.ABSENT, _FILE_STATE.PARTIAL):
                return
            if status.state == _FILE_STATE.SERVING:  # the worker restarted since it was drained
                self._drain(step)
            drained = self._drained.get((step.key, step.worker))
            time.sleep(wait_before_delete(self.quiet, status.idle_seconds, drained,
                                          time.monotonic(), DELETE_TIMEOUT))
            self._intact_elsewhere(step)
            try:
                self._drop(step.worker, step.key, shoal_pb2.DropRequest.DELETE)
                return
            except (InvalidInput, NotFound, Unavailable):
                raise
            except ShoalError as e:  # still in use: asked for again meanwhile
                if time.monotonic() > deadline:
                    raise ShoalError(f"gave up waiting to delete it: {e}") from None
                time.sleep(min(0.2, self.quiet / 2))


