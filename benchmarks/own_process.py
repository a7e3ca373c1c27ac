"""Figures from a benchmark run in a process of its own, started with the environment as the
user gave it (engine/process.py): mlx-lm's baselines, and Shoal with every store local."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks.records import REPO
from engine.process import environment_as_given


def own_process_env() -> dict[str, str]:
    """Such a process runs as the user would run mlx-lm: without the launch setting Shoal gives
    its own processes (engine/process.py), with this checkout importable."""
    env = environment_as_given()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def own_process_figures(what: str, command: Callable[[Path], list[str]]) -> dict:
    """Run `command(out)` in a process of its own, writing its figures as JSON to `out`; the
    figures, or {"error": ...} naming `what` with the output's tail."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        run = subprocess.run(command(out), capture_output=True, text=True, timeout=1800,
                             cwd=REPO, env=own_process_env())
        if run.returncode != 0 or not out.exists():
            tail = (run.stdout + run.stderr).strip()[-800:]
            return {"error": f"{what} failed with {run.returncode}: {tail}"}
        return json.loads(out.read_text())
