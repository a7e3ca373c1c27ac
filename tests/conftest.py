"""Fixtures shared by the whole test suite: tiny random checkpoints and the demo's models built
once per session, the cluster secret, and real shoal-worker processes stopped at teardown.
Reuse them (the list at the end of this file says which to take when) to keep the suite fast."""

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from builders.synthetic import build_checkpoint
from coordinator.ops.local_processes import LocalWorker
from coordinator.ops.local_processes import start_worker as launch_worker
from engine.auth import create_secret
from engine.sharding import shard
from tests.demo_runs import DemoRun, demo_workers_running
from tests.xdist_groups import SharedFixtureScheduling, groups_folder, write_groups

TinyCheckpoint = Callable[..., Path]

# pytest keeps the test modules it rewrites (assert messages) in __pycache__ only where Python
# writes bytecode: where PYTHONDONTWRITEBYTECODE is set (CI), each xdist worker would rewrite
# all of them again, every run.
sys.dont_write_bytecode = False


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
    """A factory: start_worker([store, ...], *extra_args, forked=True) -> LocalWorker; all
    are stopped. Forked from a process that has imported shoal-worker once: the daemon's own
    main() in a process of its own, started in ~0.2 s instead of ~2 s of imports (more on a
    busy machine). It sees the environment of the first fork, so a test that gives the worker
    environment of its own, or checks the command itself, passes forked=False."""
    started: list[LocalWorker] = []

    def start(stores: list[Path], *extra: str, forked: bool = True) -> LocalWorker:
        log = tmp_path / f"worker-{len(started)}.log"
        worker = launch_worker(stores, secret_file, log, extra, forked=forked)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def demo_first_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """`shoal demo` as a newcomer's first run: it builds the demo's models from SmolLM2's
    weights (a few GB written, most of a minute) into a fresh cache, once per session.
    test_demo checks the run; the others take its models through `demo_cache`."""
    cache = tmp_path_factory.mktemp("demo-cache")
    run = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "demo", "--max-tokens", "24"],
        capture_output=True, text=True, timeout=900, cwd=REPO,
        env={**os.environ, "SHOAL_CACHE": str(cache)})
    return DemoRun(cache, run, demo_workers_running(cache))


@pytest.fixture(scope="session")
def demo_cache(demo_first_run: DemoRun) -> Path:
    """A $SHOAL_CACHE holding the demo's models as `shoal demo` built them (the dense
    SmolLM2, its 16-expert top-4 MoE, that MoE sharded for two workers, the demo's secret).
    Point SHOAL_CACHE at it (monkeypatch.setenv, or a subprocess's env) to use them without
    building; add models under names of your own, never change the ones in it."""
    if demo_first_run.run.returncode != 0:
        pytest.fail(f"shoal demo failed: {demo_first_run.run.stderr[-3000:]}", pytrace=False)
    return demo_first_run.cache


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
    saying so (`-m "not processes"` runs the unit tests alone). On an xdist worker: which
    tests share fixtures, for the controller (tests/xdist_groups.py)."""
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.processes)
    write_groups(config, items)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """pytest-xdist's controller, starting a worker: where to write the groups it collects."""
    node.workerinput["shoal_groups"] = str(groups_folder(node.config))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` (pyproject's addopts) with the groups of tests/xdist_groups.py."""
    if config.getvalue("dist") == "loadgroup":
        return SharedFixtureScheduling(config, log)
    return None


def pytest_unconfigure(config) -> None:
    if folder := getattr(config, "shoal_groups", None):
        shutil.rmtree(folder, ignore_errors=True)


# Which shared fixture to take (each saves a build or a process start per test):
# - tiny_checkpoint(family, bits, layout): a tiny random checkpoint, built once per session;
#   read-only (copy it before changing it). Shard it (engine.sharding.shard) per test.
# - replicated_stores: qwen3_moe over two stores where the first holds every expert.
# - start_worker([store], *args): a real worker, forked (no imports paid again), stopped after
#   the test; forked=False for a worker that needs its own environment or the command itself.
#   Module fixtures that start a cluster: coordinator.ops.local_processes.start_workers(...,
#   forked=True), then stop_workers. A worker a test kills or restarts is the test's own.
# - demo_cache: the demo's real SmolLM2 models, built once (a minute and a few GB); point
#   SHOAL_CACHE at it. demo_first_run: the `shoal demo` run that built them.
# - secret_file, config_home (autouse), chromium: as their docstrings say.
# Wait for a condition with a bound (poll it), never for a fixed time; assert bounds that
# hold on a busy machine, and leave speed ratios to benchmarks/.
