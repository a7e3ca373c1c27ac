"""`shoal deploy` and `shoal rebalance`: decide where experts should be, then move the files
there step by step while the cluster keeps serving (observe, plan in engine/rebalance_plan.py,
execute with migration_executor.Executor)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from coordinator.dataplane.link import WorkerLink
from coordinator.ops.heat_record import fetch_readings, name_workers, record_heat
from coordinator.ops.migration_executor import QUIET_SECONDS, Event, Execution, Executor
from engine.cache_policy import format_bytes
from engine.errors import CorruptData, InvalidInput, NotFound, ShoalError, Unavailable
from engine.manifest import MANIFEST_NAME, ExpertKey, Manifest, read_manifest, write_atomic
from engine.placement import WorkerCapacity
from engine.rebalance_plan import (
    GAIN_PER_MOVED,
    MIN_GAIN,
    LiveWorker,
    Proposal,
    drive_rate,
    propose,
    state_of,
    with_members,
)
from engine.sizes import top_k_of
from proto import CHUNK_BYTES, shoal_pb2

# The target is kept in OUT_DIR/migration.json until it is reached, so a run stopped at any
# step (a killed worker, a full disk, Ctrl-C, rot) is finished by running the command again:
# the steps are derived anew from what the workers then hold, and a partly sent file resumes.
MIGRATION_FILE = "migration.json"


def observe(links: Sequence[WorkerLink]) -> tuple[list[LiveWorker], dict[str, WorkerLink]]:
    """Every worker's inventory, fetched now (raises Unavailable for one that does not answer):
    what each reported, for planning, and its link by the same name, for executing."""
    inventories = [link.fetch_inventory() for link in links]
    names = name_workers([(inv.node_id, link.address)
                          for link, inv in zip(links, inventories, strict=True)])
    workers = [_live_worker(name, inv) for name, inv in zip(names, inventories, strict=True)]
    return workers, dict(zip(names, links, strict=True))


def _live_worker(name: str, inventory: shoal_pb2.Inventory) -> LiveWorker:
    return LiveWorker(
        name,
        serving=frozenset((h.layer, h.expert) for h in inventory.experts),
        draining=frozenset((h.layer, h.expert) for h in inventory.draining),
        memory_budget=inventory.memory_budget,
        free_disk=inventory.free_disk,
    )


def measured_speeds(workers: Sequence[LiveWorker], by_name: Mapping[str, WorkerLink],
                    members: Sequence[WorkerCapacity]) -> list[LiveWorker]:
    """The workers with their drives' read speeds: as the members say (by node id or
    address), else as measured from their drive counters (GetStats) once they have read."""
    out = []
    for w in workers:
        try:
            stats = by_name[w.name].fetch_stats()
        except ShoalError:
            out.append(w)
            continue
        rate = drive_rate((d.bytes_read, d.active_seconds) for d in stats.drives)
        out.append(replace(w, read_gbps=rate))
    aliases = {link.address: name for name, link in by_name.items()}
    return with_members(out, members, aliases)


def local_files(model_dir: Path, manifest: Manifest) -> dict[ExpertKey, Path]:
    """Expert files of this model in OUT_DIR's store folders, of the right size (the receiver
    checks the checksum)."""
    found: dict[ExpertKey, Path] = {}
    folders = sorted(p for p in Path(model_dir).iterdir() if (p / MANIFEST_NAME).is_file())
    for folder in folders:
        for e in manifest.experts:
            path = folder / e.file
            key = (e.layer, e.expert)
            if key not in found and path.is_file() and path.stat().st_size == e.bytes:
                found[key] = path
    return found


# ---------------------------------------------------------------------------------------
# The target of an unfinished run


def _target_path(model_dir: Path) -> Path:
    return Path(model_dir) / MIGRATION_FILE


def load_target(model_dir: Path, fingerprint: str) -> dict[ExpertKey, tuple[str, ...]] | None:
    path = _target_path(model_dir)
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        raise CorruptData(f"{path} is not valid JSON; delete it to plan afresh") from None
    if body.get("fingerprint") != fingerprint:
        return None
    return {(int(layer), int(expert)): tuple(names) for layer, expert, names in body["target"]}


def save_target(model_dir: Path, fingerprint: str, target: Mapping) -> None:
    body = {"fingerprint": fingerprint,
            "target": [[k[0], k[1], list(v)] for k, v in sorted(target.items())]}
    write_atomic(_target_path(model_dir), json.dumps(body).encode())


def clear_target(model_dir: Path) -> None:
    _target_path(model_dir).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------
# The commands


@dataclass
class Report:
    mode: str  # "deploy" or "rebalance"
    workers: list[str]
    proposal: Proposal
    sizes: dict[ExpertKey, int]
    state: dict[ExpertKey, dict[str, str]]
    execution: Execution | None = None  # None: a dry run


def migrate(
    model_dir: Path,
    links: Sequence[WorkerLink],
    *,
    deploy: bool,
    dry_run: bool = False,
    max_bytes: int | None = None,
    spare: float = 0.1,
    replan: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = lambda m: print(f"shoal: {m}", file=sys.stderr, flush=True),
    on_event: Event | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    quiet: float = QUIET_SECONDS,
    members: Sequence[WorkerCapacity] = (),
    drive_copies: int = 1,
) -> Report:
    """`shoal deploy` (deploy=True: place every expert, sending from OUT_DIR's files) or
    `shoal rebalance` (from the recorded heat, move and replicate experts between workers).
    With every worker's read speed known (`members`, or measured), a model beyond their
    memory is placed for streaming (engine/stream_placement.py), each cold expert on
    `drive_copies` members' drives."""
    manifest = read_manifest(Path(model_dir))
    if not links:
        raise Unavailable("no live worker to place experts on")
    workers, by_name = observe(links)
    workers = measured_speeds(workers, by_name, members)
    sizes = {(e.layer, e.expert): e.bytes for e in manifest.experts}
    # This machine's copies (if OUT_DIR still has its store folders) are the cheapest source.
    local = local_files(model_dir, manifest)
    if deploy and not local and not any(w.serving for w in workers):
        raise NotFound(f"{model_dir} holds no expert files to deploy (OUT_DIR/experts or "
                       "OUT_DIR/worker-K, as written by `shoal shard`)")
    record = record_heat(model_dir, manifest, fetch_readings(links))
    heat = record.total()
    if not deploy and not heat:
        raise InvalidInput("no heat recorded yet: the workers count the tokens routed to each "
                           "expert as they compute; generate some text first")
    state = state_of(workers, sizes, local)
    stored = None if replan else load_target(model_dir, manifest.fingerprint)
    proposal = propose(state, workers, sizes, heat, stored=stored, spare=spare,
                       max_bytes=max_bytes, deploy=deploy, top_k=top_k_of(manifest.config),
                       drive_copies=drive_copies)
    if proposal.resumed:
        log(f"finishing the interrupted run's target ({MIGRATION_FILE}; --replan plans afresh)")
    elif stored:
        log(f"{MIGRATION_FILE} names workers that are not live now: planning afresh")
    report = Report("deploy" if deploy else "rebalance", [w.name for w in workers], proposal,
                    sizes, state)
    if dry_run or not proposal.plan.steps:
        return report
    save_target(model_dir, manifest.fingerprint, proposal.target)
    executor = Executor(manifest, by_name, local, log=log, on_event=on_event,
                        chunk_bytes=chunk_bytes, quiet=quiet, progress=progress)
    report.execution = executor.run(proposal.plan, report.mode)
    if not proposal.plan.blocked:
        clear_target(model_dir)
    return report


def describe(report: Report, *, steps: int = 20) -> list[str]:
    """What a plan does, for --dry-run and after a run."""
    p = report.proposal
    plan = p.plan
    lines = [f"{report.mode} over {len(report.workers)} workers ({', '.join(report.workers)})"
             + (" [finishing an interrupted run]" if p.resumed else "")]
    if not plan.steps and not plan.blocked:
        why = ("every expert is served by a live worker (`shoal rebalance` moves them)"
               if report.mode == "deploy" else
               f"no placement found lowers the predicted imbalance enough for the bytes it "
               f"copies (by {MIN_GAIN:.0%}, and 1% more for each {1 / GAIN_PER_MOVED:g}% of "
               "the experts' bytes copied)")
        lines.append(f"nothing to do: {why}")
    moved: dict[str, list[int]] = {w: [0, 0, 0] for w in report.workers}  # in, bytes in, out
    for s in plan.steps:
        if s.kind == "copy":
            moved[s.worker][0] += 1
            moved[s.worker][1] += s.bytes
        elif s.kind == "delete":
            moved[s.worker][2] += 1
    lines.append(f"  copies {plan.count('copy')} ({format_bytes(plan.copy_bytes)}), "
                 f"keeps {plan.count('keep')}, drops {plan.count('delete')}; "
                 f"{len(plan.steps)} steps")
    for w, (n_in, b_in, n_out) in moved.items():
        held = sum(1 for names in p.target.values() if w in names)
        lines.append(f"  {w:<24} +{n_in} ({format_bytes(b_in)})  -{n_out}  -> {held} experts")
    replicas = sum(len(v) > 1 for v in p.target.values())
    now = "-" if p.imbalance_now is None else f"{p.imbalance_now:.2f}"
    what = ("busiest drive's reads / the ideal's, per layer" if p.measure == "reads" else
            "busiest worker / mean, per layer")
    lines.append(f"  predicted imbalance ({what}): {now} now, "
                 f"{p.imbalance_after:.2f} after; {replicas} experts with replicas")
    for key, why in sorted(plan.blocked.items()):
        lines.append(f"  left as is: expert {key[0]}/{key[1]}: {why}")
    shown = plan.steps[:steps]
    lines += [f"    {s.describe()}" for s in shown]
    if len(plan.steps) > len(shown):
        lines.append(f"    ... and {len(plan.steps) - len(shown)} more steps")
    e = report.execution
    if e is not None:
        rate = e.copied_bytes / e.seconds if e.seconds else 0.0
        lines.append(f"done: {e.steps_done} steps in {e.seconds:.1f} s, sent "
                     f"{format_bytes(e.copied_bytes)} ({format_bytes(rate)}/s)"
                     + (f", {format_bytes(e.resumed_bytes)} resumed" if e.resumed_bytes else ""))
    return lines
