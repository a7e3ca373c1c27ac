"""`shoal shard` through the real command: a finished split is never written again without
--force (the cluster has changed its stores since), a store a live worker serves is never
written at all, a worker does not start on a store being written, an interrupted split is
finished by the same command, and a full disk ends with one `shoal: error:` line."""

import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from engine.manifest import MANIFEST_NAME, read_manifest
from engine.store_lock import claim_for_writing, release

REPO = Path(__file__).resolve().parents[2]


def shoal(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def expert_files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.glob("worker-*/L*/E*.safetensors"))


@pytest.fixture
def split(tiny_checkpoint, tmp_path) -> tuple[Path, Path]:
    source, out = tiny_checkpoint("qwen3_moe"), tmp_path / "out"
    run = shoal("shard", str(source), str(out), "--workers", "2", "--quiet")
    assert run.returncode == 0, run.stderr
    return source, out


def test_a_finished_split_is_refused_naming_its_stores_and_force_replaces_it(split):
    source, out = split
    planned = expert_files(out)
    # What `shoal rebalance` leaves: an expert of worker-1 copied into worker-0.
    moved = next(p for p in planned if p.startswith("worker-1/"))
    copy = out / "worker-0" / moved.removeprefix("worker-1/")
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_bytes((out / moved).read_bytes())

    again = shoal("shard", str(source), str(out), "--workers", "2", "--quiet")
    assert again.returncode == 2
    assert again.stderr.startswith("shoal: error:") and "Traceback" not in again.stderr
    assert "already holds a finished split" in again.stderr
    assert "worker-0/, worker-1/" in again.stderr and "--force" in again.stderr
    assert copy.exists()  # nothing was written

    forced = shoal("shard", str(source), str(out), "--workers", "2", "--quiet", "--force")
    assert forced.returncode == 0, forced.stderr
    assert not copy.exists()  # the copy nobody planned is gone with the old split
    assert expert_files(out) == planned
    manifest = read_manifest(out)
    assert len(expert_files(out)) == len(manifest.experts)


@pytest.mark.slow
def test_shard_never_writes_into_a_store_a_live_worker_serves(split, start_worker):
    source, out = split
    worker = start_worker([out / "worker-0"], "--no-advertise")
    before = {p: (out / p).stat().st_mtime_ns for p in expert_files(out)}
    run = shoal("shard", str(source), str(out), "--workers", "2", "--quiet", "--force")
    assert run.returncode == 2
    assert "shoal: error: a running shoal-worker serves" in run.stderr
    assert str(out / "worker-0") in run.stderr and str(out / "worker-1") not in run.stderr
    assert {p: (out / p).stat().st_mtime_ns for p in expert_files(out)} == before
    assert worker.proc.poll() is None
    worker.stop()
    # Once the worker has stopped, the same command goes ahead.
    assert shoal("shard", str(source), str(out), "--workers", "2", "--quiet",
                 "--force").returncode == 0


def test_a_worker_does_not_start_on_a_store_shard_is_writing(split, secret_file):
    _, out = split
    held = claim_for_writing([out / "worker-0"])  # as `shoal shard` holds it while writing
    try:
        run = subprocess.run(
            [sys.executable, "-m", "worker.daemon", "--store", str(out / "worker-0"),
             "--secret-file", str(secret_file), "--no-advertise", "--port", "0"],
            capture_output=True, text=True, timeout=60, cwd=REPO)
    finally:
        release(held)
    assert run.returncode == 2
    assert f"`shoal shard` is writing {out / 'worker-0'} now" in run.stderr
    assert "serving" not in run.stdout


def test_an_interrupted_split_is_finished_by_the_same_command(split):
    source, out = split
    (out / MANIFEST_NAME).unlink()  # cut short before its last write
    run = shoal("shard", str(source), str(out), "--workers", "2", "--quiet")
    assert run.returncode == 0, run.stderr
    assert (out / MANIFEST_NAME).exists()


def test_a_full_disk_ends_the_split_with_an_error_line_and_loses_nothing(tiny_checkpoint,
                                                                          tmp_path):
    source = tiny_checkpoint("qwen3_moe")
    whole = shoal("shard", str(source), str(tmp_path / "whole"), "--workers", "2", "--quiet")
    assert whole.returncode == 0, whole.stderr
    size = sum(p.stat().st_size for p in (tmp_path / "whole").rglob("*") if p.is_file())
    source_files = {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()}
    mount = tmp_path / f"small-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    # A filesystem with room for about half the split.
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size // 2}", "tmpfs",
                              str(mount)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        out = mount / "out"
        run = shoal("shard", str(source), str(out), "--workers", "2", "--quiet")
        assert run.returncode == 2, run.stdout + run.stderr
        assert "Traceback" not in run.stderr
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("shoal: error: cannot write ")
        assert "the drive is full" in lines[0] and "run the same command again" in lines[0]
        assert not (out / MANIFEST_NAME).exists()  # never served half-written
        assert not list(out.rglob(".*.partial.safetensors"))  # no partial file left
    finally:
        subprocess.run(["umount", str(mount)], check=True, timeout=30)
    assert {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()} == source_files


def test_progress_written_to_a_file_is_lines_not_a_redrawn_bar(tiny_checkpoint, tmp_path):
    """Off a terminal (a log, CI) a progress bar's redraws would pile up on one line."""
    run = shoal("shard", str(tiny_checkpoint("qwen3_moe")), str(tmp_path / "out"),
                "--workers", "2")
    assert run.returncode == 0, run.stderr
    assert "\r" not in run.stderr and "\r" not in run.stdout
    assert all(line.strip() for line in run.stderr.splitlines())


def test_shard_prints_the_next_step_and_it_runs(tiny_checkpoint, tmp_path):
    out = tmp_path / "one"
    run = shoal("shard", str(tiny_checkpoint("qwen3_moe")), str(out), "--quiet")
    assert run.returncode == 0, run.stderr
    line = next(t for t in run.stdout.splitlines() if t.startswith("next: shoal generate"))
    command = shlex.split(line.removeprefix("next: ").partition(" (")[0])
    assert command[:2] == ["shoal", "generate"]
    answer = shoal(*command[1:], "--max-tokens", "3")
    assert answer.returncode == 0, answer.stderr
    split = shoal("shard", str(tiny_checkpoint("qwen3_moe")), str(tmp_path / "two"),
                  "--workers", "2", "--quiet")
    assert f"shoal-worker --store {tmp_path / 'two' / 'worker-K'}" in split.stdout
