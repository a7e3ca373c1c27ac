"""`shoal serve`'s dashboard: the page at `GET /` (static/, nothing fetched from elsewhere), the
JSON endpoints it reads (docs/dashboard.md), the live rebalance it can start; a sampler thread
reads the counters once a second, and dashboard_views.py builds what the endpoints answer."""

from __future__ import annotations

import copy
import threading
import time
import traceback
from collections import deque
from pathlib import Path

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from coordinator.dataplane.dispatch import Dispatcher, LayerStats
from coordinator.dataplane.link import WorkerLink
from coordinator.decoding.report import BREAKDOWN_PARTS
from coordinator.ops.heat_record import fetch_readings, record_heat
from coordinator.ops.ops_report import migration_report
from coordinator.ops.rebalancer import describe, migrate
from coordinator.server.answering import Guard, Service, authorized
from coordinator.server.dashboard_views import (
    Counters,
    coordinator_card,
    copy_layer_stats,
    drive_reads,
    heat_view,
    speed_sample,
    worker_cards,
)
from coordinator.server.metrics import Figures, Metrics
from engine.errors import InvalidInput, ShoalError, Unavailable
from engine.migration import Step
from proto import shoal_pb2

STATIC = Path(__file__).with_name("static")
SAMPLE_SECONDS = 1.0
HISTORY = 300  # samples kept (five minutes at one a second)
HEAT_SECONDS = 2.0  # the workers' heat is read at most this often
STATS_TIMEOUT = 1.0  # seconds a worker has to answer GetStats before its card goes without


class LiveRebalance:
    """One `shoal rebalance` at a time, run on its own thread from the dashboard: its plan
    (a dry run first, for the totals), then the steps, with progress as they go."""

    def __init__(self, model_dir: Path, secret: bytes) -> None:
        self.model_dir = model_dir
        self.secret = secret
        self._lock = threading.Lock()
        self._status: dict = {"state": "idle"}
        self._thread: threading.Thread | None = None

    def status(self) -> dict:
        with self._lock:
            return copy.deepcopy(self._status)  # a copy the thread cannot change

    def start(self, addresses: list[str]) -> dict:
        """Start a run over the workers at `addresses`; InvalidInput if one is running."""
        with self._lock:
            if self._status["state"] == "running":
                raise InvalidInput("a rebalance is already running")
            if not addresses:
                raise InvalidInput("no healthy worker to rebalance")
            self._status = {"state": "running", "started": time.time(), "finished": None,
                            "workers": addresses, "steps_done": 0, "steps_planned": None,
                            "bytes_sent": 0, "bytes_planned": None, "step": None,
                            "log": [], "error": None, "result": None}
            self._thread = threading.Thread(target=self._run, args=(addresses,),
                                            name="shoal rebalance", daemon=True)
            self._thread.start()
            return copy.deepcopy(self._status)

    def _update(self, **changes: object) -> None:
        with self._lock:
            self._status.update(changes)

    def _log(self, message: str) -> None:
        with self._lock:
            self._status["log"] = [*self._status["log"][-49:], message]

    def _event(self, kind: str, step: Step, size: int) -> None:
        with self._lock:
            s = self._status
            if kind == "step":
                s["step"] = step.describe()
            elif kind == "chunk":
                s["bytes_sent"] += size
            elif kind == "done":
                s["steps_done"] += 1

    def _run(self, addresses: list[str]) -> None:
        links = [WorkerLink(address, self.secret) for address in addresses]
        try:
            plan = migrate(self.model_dir, links, deploy=False, dry_run=True, progress=False,
                           log=self._log)
            self._update(steps_planned=len(plan.proposal.plan.steps),
                         bytes_planned=plan.proposal.plan.copy_bytes)
            report = migrate(self.model_dir, links, deploy=False, progress=False,
                             log=self._log, on_event=self._event)
            self._update(state="done", result=migration_report(report), lines=describe(report))
        except ShoalError as e:
            self._update(state="failed", error=str(e))
        except Exception as e:  # noqa: BLE001 (the page must hear of it; the log has the rest)
            traceback.print_exc()
            self._update(state="failed", error=f"{type(e).__name__}: {e}")
        finally:
            self._update(finished=time.time(), step=None)
            for link in links:
                link.close()


class Dashboard:
    """The dashboard of one `shoal serve`: its state, its sampler thread, its routes."""

    def __init__(self, service: Service, model_dir: Path, secret: bytes,
                 dispatcher: Dispatcher | None = None, *,
                 sample_seconds: float = SAMPLE_SECONDS) -> None:
        self.service = service
        self.model_dir = Path(model_dir)
        self.secret = secret
        self.dispatcher = dispatcher
        self.sample_seconds = sample_seconds
        self.metrics = Metrics(self.figures)
        if dispatcher is not None:
            dispatcher.on_worker_timing = self.metrics.observe_worker
        self.rebalance = LiveRebalance(self.model_dir, secret)
        self._lock = threading.Lock()
        self._samples: deque[dict] = deque(maxlen=HISTORY)
        self._last = self._counters()
        self._stats: dict[str, shoal_pb2.WorkerStats] = {}
        self._reads: dict[str, tuple[float, int]] = {}  # address -> (time, drive reads)
        self._reads_per_s: dict[str, float] = {}
        self._since: dict[str, tuple[str, float]] = {}  # member key -> (state, since)
        self._links: dict[str, WorkerLink] = {}  # the dashboard's own, by address
        self._links_lock = threading.Lock()
        self._heat: tuple[float, dict] | None = None
        self._heat_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shoal dashboard", daemon=True)
        self._thread.start()

    # reading -------------------------------------------------------------------------

    def _counters(self) -> Counters:
        engine = self.service.engine
        stats = engine.stats
        decode = (copy_layer_stats(self.dispatcher.stats.decode) if self.dispatcher is not None
                  else LayerStats())
        return Counters(time.monotonic(), time.time(), stats.decode_steps, stats.decode_rows,
                        decode, engine.in_flight)

    def _link(self, address: str) -> WorkerLink:
        with self._links_lock:
            link = self._links.get(address)
            if link is None:
                link = self._links[address] = WorkerLink(address, self.secret)
            return link

    def _run(self) -> None:
        while not self._stop.wait(self.sample_seconds):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 (a bug here must not end the sampling)
                traceback.print_exc()

    def sample(self) -> None:
        """One tick: a speed sample, the members' states, each healthy worker's stats."""
        counters = self._counters()
        sample = speed_sample(self._last, counters)
        self._last = counters
        members = self.service.membership.snapshot()
        now = time.time()
        stats, reads_per_s = {}, {}
        for m in members:
            if m.state != "healthy":
                continue
            try:
                reading = self._link(m.address).fetch_stats(timeout=STATS_TIMEOUT)
            except ShoalError:
                continue
            stats[m.address] = reading
            reads = drive_reads(reading)
            before = self._reads.get(m.address)
            if before is not None and reads >= before[1] and now > before[0]:
                reads_per_s[m.address] = (reads - before[1]) / (now - before[0])
            self._reads[m.address] = (now, reads)
        addresses = {m.address for m in members}
        with self._links_lock:
            for address in [a for a in self._links if a not in addresses]:
                self._links.pop(address).close()
        with self._lock:
            self._samples.append(sample)
            self._stats, self._reads_per_s = stats, reads_per_s
            keys = {m.key for m in members}
            self._since = {k: v for k, v in self._since.items() if k in keys}
            for m in members:
                if self._since.get(m.key, ("",))[0] != m.state:
                    self._since[m.key] = (m.state, now)

    def figures(self) -> Figures:
        with self._lock:
            last = self._samples[-1] if self._samples else {}
            stats = dict(self._stats)
        engine = self.service.engine
        return Figures(engine.stats, engine.in_flight, last.get("batch_width", 0.0),
                       last.get("decode_tps", 0.0), self.service.membership.snapshot(), stats,
                       self.rebalance.status(), engine.latencies.histograms(),
                       engine.prompt_cache, engine.drafting_stats())

    # the views -----------------------------------------------------------------------

    def cluster(self) -> dict:
        s = self.service
        members = s.membership.snapshot()
        with self._lock:
            stats, reads = dict(self._stats), dict(self._reads_per_s)
            since = {key: at for key, (_, at) in self._since.items()}
        engine = s.engine
        return {
            "cluster": s.membership.cluster,
            "coordinator": coordinator_card(
                model=s.model_id, manifest=s.manifest, context=s.context,
                max_batch=engine.max_batch, in_flight=engine.in_flight, problem=s.health(),
                started=s.started, batching=engine.stats.as_json(),
                prompt_cache=engine.prompt_cache, latency=engine.latencies.summary(),
                drafting=engine.drafting_stats()),
            "workers": worker_cards(members, stats, reads, since),
        }

    def speed(self, since: float | None = None) -> dict:
        with self._lock:
            samples = [x for x in self._samples if since is None or x["t"] > since]
        return {"interval": self.sample_seconds, "history": HISTORY, "samples": samples,
                "parts": [[part, label] for part, label in BREAKDOWN_PARTS]}

    def heat(self) -> dict:
        """The heat as `shoal heat` records it (the workers' counts folded into
        OUT_DIR/heat.msgpack), read again when the last reading is HEAT_SECONDS old."""
        with self._heat_lock:
            if self._heat is not None and time.monotonic() - self._heat[0] < HEAT_SECONDS:
                return self._heat[1]
            s = self.service
            # the live members, the coordinator's own experts (--local-store) among them
            _, links, holdings = s.membership.live()
            try:
                record = record_heat(self.model_dir, s.manifest, fetch_readings(links))
            except Unavailable:  # a worker lost while it was read: the last view stands
                if self._heat is None:
                    raise
                return self._heat[1]
            view = heat_view(record, s.manifest, [
                (link.node_id, link.address, held)
                for link, held in zip(links, holdings, strict=True)])
            self._heat = (time.monotonic(), view)
            return view

    def rebalance_plan(self) -> dict:
        """`shoal rebalance --dry-run --json` over the healthy workers, with its text."""
        links = [self._link(m.address) for m in self.service.membership.snapshot()
                 if m.state == "healthy"]
        try:
            report = migrate(self.model_dir, links, deploy=False, dry_run=True, progress=False,
                             log=lambda message: None)
        except (InvalidInput, Unavailable) as e:  # no heat yet, or a worker just lost: the
            return {"plan": None, "reason": str(e)}  # cluster's state, not the request's error
        return {"plan": migration_report(report), "lines": describe(report)}

    def start_rebalance(self) -> dict:
        addresses = [m.address for m in self.service.membership.snapshot()
                     if m.state == "healthy"]
        return self.rebalance.start(addresses)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5 * self.sample_seconds + STATS_TIMEOUT)
        with self._links_lock:
            for link in self._links.values():
                link.close()
            self._links.clear()

    # the routes ----------------------------------------------------------------------

    def routes(self, guard: Guard) -> list[BaseRoute]:
        """The page and its files (no key: they hold no data), the key check, and the JSON
        endpoints and /metrics behind `guard` (the API key, as the OpenAI routes)."""

        async def page(request: Request) -> Response:
            return FileResponse(STATIC / "dashboard.html", headers=_NO_STORE)

        async def auth(request: Request) -> Response:
            return _json({"key_required": self.service.api_key is not None,
                          "authorized": authorized(self.service, request)})

        async def cluster(request: Request) -> Response:
            return _json(await run_in_threadpool(self.cluster))

        async def speed(request: Request) -> Response:
            since = request.query_params.get("since")
            try:
                after = float(since) if since is not None else None
            except ValueError:
                raise InvalidInput(f"'since' must be a time in seconds, got {since!r}") from None
            return _json(self.speed(after))

        async def heat(request: Request) -> Response:
            return _json(await run_in_threadpool(self.heat))

        async def rebalance(request: Request) -> Response:
            if request.method == "GET":
                return _json(self.rebalance.status())
            # A page of another site can send a form-encoded POST to loopback without asking;
            # a JSON body it cannot, without a preflight that this server never answers.
            if request.headers.get("content-type", "").split(";")[0] != "application/json":
                raise InvalidInput("start a rebalance with a JSON body ({}) and "
                                   "Content-Type: application/json")
            return _json(await run_in_threadpool(self.start_rebalance), 202)

        async def plan(request: Request) -> Response:
            return _json(await run_in_threadpool(self.rebalance_plan))

        return [
            Route("/", page, methods=["GET"]),
            Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
            Route("/api/auth", auth, methods=["GET"]),
            Route("/api/cluster", guard(cluster), methods=["GET"]),
            Route("/api/speed", guard(speed), methods=["GET"]),
            Route("/api/heat", guard(heat), methods=["GET"]),
            Route("/api/rebalance/plan", guard(plan), methods=["GET"]),
            Route("/api/rebalance", guard(rebalance), methods=["GET", "POST"]),
            Route("/metrics", guard(self.metrics.endpoint), methods=["GET"]),
        ]


_NO_STORE = {"Cache-Control": "no-store"}


def _json(body: dict, status: int = 200) -> JSONResponse:
    return JSONResponse(body, status, headers=_NO_STORE)
