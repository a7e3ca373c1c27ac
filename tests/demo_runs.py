"""A run of `shoal demo` as the tests keep it (conftest's demo_first_run), and the check that
none of its workers is left running."""

import subprocess
from dataclasses import dataclass
from pathlib import Path


def demo_workers_running(cache: Path) -> list[str]:
    """`ps` lines of shoal-worker processes serving stores under `cache`."""
    run = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, timeout=30)
    return [line for line in run.stdout.splitlines()
            if "worker.daemon" in line and str(cache) in line]


@dataclass(frozen=True)
class DemoRun:
    cache: Path  # the run's $SHOAL_CACHE: the demo's models, built by the run
    run: subprocess.CompletedProcess  # `shoal demo --max-tokens 24` on an empty cache
    left_running: list[str]  # demo_workers_running(cache) right after it ended
