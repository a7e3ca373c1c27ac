"""engine/ is what both sides share and holds no networking: importing every engine module in a
fresh interpreter pulls in neither gRPC nor the coordinator's or the worker's code; and reading
a manifest needs none of the model machinery."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def imported_by(code: str, roots: tuple[str, ...]) -> str:
    """The modules under `roots` that a fresh interpreter holds after running `code`."""
    code += (
        "\nimport sys\n"
        f"print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in {roots!r})))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip()


def test_engine_imports_neither_grpc_nor_either_side():
    modules = sorted(p.stem for p in (REPO / "engine").glob("*.py") if p.stem != "__init__")
    code = f"import importlib\nfor name in {modules!r}: importlib.import_module('engine.' + name)"
    bad = imported_by(code, ("grpc", "coordinator", "worker", "proto"))
    assert bad == "", f"engine/ pulls in {bad}"


def test_reading_a_manifest_imports_neither_mlx_nor_mlx_lm_nor_tqdm():
    bad = imported_by("import engine.manifest", ("mlx", "mlx_lm", "tqdm"))
    assert bad == "", f"engine/manifest.py pulls in {bad}"
