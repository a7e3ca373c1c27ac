"""Every import of the project's own code made inside a function resolves: a name moved
elsewhere fails here, not when that function first runs (the scaling benchmark broke so); and
in the product such imports stay in the CLI, each marked `# lazy:` with its reason."""

import ast
import importlib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("coordinator", "worker", "engine", "proto", "builders")
OWN = (*PRODUCT, "benchmarks", "tests")
# where a command's start must stay fast: the shoal command's modules and the worker's
LAZY_ALLOWED = ("coordinator/cli/", "worker/daemon.py")


@dataclass(frozen=True)
class LocalImport:
    path: str  # relative to the repository
    line: int
    module: str  # absolute dotted name
    names: tuple[str, ...]  # those taken from it; () for `import X`
    marked: bool  # a `# lazy:` comment on or right above its block

    def __str__(self) -> str:
        taken = f" import {', '.join(self.names)}" if self.names else ""
        return f"{self.path}:{self.line}: from {self.module}{taken}"


def package_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts if path.name == "__init__.py" else parts[:-1])


def absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def local_imports(path: Path, root: Path = REPO) -> list[LocalImport]:
    """The imports of OWN packages inside any function of the file at `path`; `marked` when
    the line above their run of imports says `# lazy:`."""
    source = path.read_text()
    lines = ["", *source.splitlines()]  # lines[n] is line n
    where, package = path.relative_to(root).as_posix(), package_of(path, root)
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        previous, block = None, 0
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                follows = isinstance(previous, (ast.Import, ast.ImportFrom)) and \
                    previous.end_lineno == child.lineno - 1
                block = block if follows else child.lineno
            previous = child
            if not in_function or not isinstance(child, (ast.Import, ast.ImportFrom)):
                visit(child, in_function or isinstance(child, (ast.FunctionDef,
                                                                 ast.AsyncFunctionDef)))
                continue
            marked = lines[block - 1].strip().startswith("# lazy:")
            if isinstance(child, ast.ImportFrom):
                module = absolute(child, package)
                taken = [(module, tuple(alias.name for alias in child.names))]
            else:
                taken = [(alias.name, ()) for alias in child.names]
            found.extend(LocalImport(where, child.lineno, module, names, marked)
                         for module, names in taken if module.split(".")[0] in OWN)

    visit(ast.parse(source, filename=str(path)), False)
    return found


def files() -> list[Path]:
    return sorted(path for top in OWN for path in (REPO / top).rglob("*.py")
                  if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def unresolved(found: LocalImport) -> str | None:
    """Why the import would fail when its function runs, or None when it resolves."""
    try:
        module = importlib.import_module(found.module)
    except ImportError as e:
        return f"{found}: {e}"
    for name in found.names:
        if name == "*" or hasattr(module, name):
            continue
        try:  # a submodule not imported yet (`from worker import daemon`)
            importlib.import_module(f"{found.module}.{name}")
        except ImportError:
            return f"{found}: {found.module} has no {name!r}"
    return None


WITH_LOCAL_IMPORTS = [path for path in files() if local_imports(path)]


@pytest.mark.parametrize("path", WITH_LOCAL_IMPORTS,
                         ids=[p.relative_to(REPO).as_posix() for p in WITH_LOCAL_IMPORTS])
def test_each_function_local_import_of_the_project_resolves(path: Path):
    problems = [p for p in map(unresolved, local_imports(path)) if p is not None]
    assert not problems, "\n".join(problems)


def test_in_the_product_only_the_commands_import_lazily_and_say_why():
    product = [found for path in files() if path.relative_to(REPO).parts[0] in PRODUCT
               for found in local_imports(path)]
    elsewhere = [str(f) for f in product if not f.path.startswith(LAZY_ALLOWED)]
    unmarked = [str(f) for f in product if f.path.startswith(LAZY_ALLOWED) and not f.marked]
    assert not elsewhere, "import at the top of the module instead:\n" + "\n".join(elsewhere)
    assert not unmarked, "say why it is lazy (`# lazy: start-up`):\n" + "\n".join(unmarked)
    # the walk sees the commands' lazy imports (it would pass vacuously otherwise)
    assert any(f.path == "coordinator/cli/generate_command.py" for f in product)


def test_the_walk_finds_an_import_in_a_function_and_resolves_its_names(tmp_path: Path):
    # the bench split's break: bench_root moved from benchmarks/bench.py to checkpoints.py
    probe = tmp_path / "benchmarks" / "probe.py"
    probe.parent.mkdir()
    probe.write_text("def f():\n    from benchmarks.bench import bench_root\n\n"
                     "    # lazy: start-up\n    from benchmarks.checkpoints import bench_root\n"
                     "    return bench_root\n")
    broken, moved = local_imports(probe, tmp_path)
    assert (broken.line, broken.module, broken.names) == (2, "benchmarks.bench", ("bench_root",))
    assert "has no 'bench_root'" in unresolved(broken)
    assert not broken.marked and moved.marked
    assert unresolved(moved) is None
