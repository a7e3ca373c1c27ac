"""Every benchmark module imports: a name moved between the harness's modules fails here, not on
the GPU machine in the middle of a measuring call."""

import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODULES = sorted(".".join(p.relative_to(REPO).with_suffix("").parts)
                 for p in (REPO / "benchmarks").rglob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("module", MODULES)
def test_the_module_imports(module):
    importlib.import_module(module)
