"""engine/ is what both sides share and holds no networking: importing every engine module in a
fresh interpreter pulls in neither gRPC nor the coordinator's or the worker's code."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_engine_imports_neither_grpc_nor_either_side():
    modules = sorted(p.stem for p in (REPO / "engine").glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module('engine.' + name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('grpc', 'coordinator', 'worker', 'proto'))\n"
        "print(','.join(bad))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "", f"engine/ pulls in {run.stdout.strip()}"
