"""Fixtures shared by the whole test suite: tiny random checkpoints built once per session,
the cluster secret, and real shoal-worker processes that are killed by PID at teardown."""

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from builders.synthetic import build_checkpoint
from coordinator.ops.local_processes import LocalWorker
from coordinator.ops.local_processes import start_worker as launch_worker
from engine.auth import create_secret
from engine.sharding import shard

TinyCheckpoint = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """A factory: tiny_checkpoint(family, quantize_bits=None, layout="mlx") -> checkpoint folder.

    Each combination is built once per session (seed 0) and shared by every test
    that asks for it, so treat the folder as read-only: copy it (shutil.copytree)
    before changing anything in it.
    """
    built: dict[tuple[str, int | None, str], Path] = {}

    def get(family: str, quantize_bits: int | None = None, layout: str = "mlx") -> Path:
        key = (family, quantize_bits, layout)
        if key not in built:
            bits = "f32" if quantize_bits is None else f"q{quantize_bits}"
            # mktemp gives a fresh numbered folder, so a build that failed half-way
            # (and was therefore not cached) never leaves files for the next attempt.
            out_dir = tmp_path_factory.mktemp(f"{family}-{layout}-{bits}")
            built[key] = build_checkpoint(
                out_dir, family, quantize_bits=quantize_bits, layout=layout
            )
        return built[key]

    return get


@pytest.fixture
def replicated_stores(tiny_checkpoint: TinyCheckpoint, tmp_path: Path) -> tuple[Path, list[Path]]:
    """qwen3_moe sharded for two workers, where the first holds every expert (a copy of the
    second's share as well): (the sharded folder, the two workers' stores). The second can be
    lost and its experts routed around."""
    sharded = tmp_path / "sharded"
    shard(tiny_checkpoint("qwen3_moe"), sharded, workers=2, progress=False)
    whole = tmp_path / "whole"
    shutil.copytree(sharded / "worker-0", whole)
    shutil.copytree(sharded / "worker-1", whole, dirs_exist_ok=True)
    return sharded, [whole, sharded / "worker-1"]


@pytest.fixture(scope="session", autouse=True)
def config_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Workers keep their node id in the config folder: never the real ~/.config in tests."""
    folder = tmp_path_factory.mktemp("config")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CONFIG_HOME", str(folder))
        yield folder


@pytest.fixture(scope="session")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_secret(tmp_path_factory.mktemp("secret") / "secret")


@pytest.fixture
def start_worker(
    secret_file: Path, tmp_path: Path
) -> Iterator[Callable[..., LocalWorker]]:
    """A factory: start_worker([store, ...], *extra_args, forked=False) -> LocalWorker; all
    are stopped. forked=True forks the worker from one that has imported it already (~0.2 s
    instead of ~2 s a start), for tests that start many."""
    started: list[LocalWorker] = []

    def start(stores: list[Path], *extra: str, forked: bool = False) -> LocalWorker:
        log = tmp_path / f"worker-{len(started)}.log"
        worker = launch_worker(stores, secret_file, log, extra, forked=forked)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium, which the browser tests drive with Playwright (no browser download;
    .ci/run installs it). Without it they fail, so that no run passes without them;
    SHOAL_ALLOW_NO_BROWSER=1 makes them skip instead, where it cannot be installed."""
    path = shutil.which("chromium")
    if path is None:
        missing = "Debian's chromium is missing: apt-get install -y chromium (.ci/run does)"
        if os.environ.get("SHOAL_ALLOW_NO_BROWSER") == "1":
            pytest.skip(missing)
        pytest.fail(f"{missing}, or set SHOAL_ALLOW_NO_BROWSER=1 to skip the browser tests",
                    pytrace=False)
    return path


def pytest_collection_modifyitems(config, items) -> None:
    """Integration tests start real processes: they carry the `processes` marker without each
    saying so (`-m "not processes"` runs the unit tests alone)."""
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.processes)
