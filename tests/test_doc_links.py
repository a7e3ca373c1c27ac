"""Every relative link in docs/, the README and the benchmarks' READMEs resolves: the file
exists, and an anchor names a heading of the file it points into."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([*REPO.glob("docs/**/*.md"), REPO / "README.md",
                *REPO.glob("benchmarks/**/README.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    found = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def links(page: Path) -> list[str]:
    text = CODE.sub("", page.read_text())
    return [a or b for a, b in LINK.findall(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


NAMED = re.compile(r"`([A-Z][A-Za-z0-9]*)\.([_a-z][a-z0-9_]*)(?:\(\))?`")
SOURCES = sorted(p for folder in ("engine", "proto", "worker", "coordinator", "builders",
                                  "benchmarks") for p in (REPO / folder).rglob("*.py")
                 if not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def defines(name: str, attribute: str) -> bool:
    """A class (or a message of shoal.proto) called `name` with `attribute`, in one file."""
    proto = (REPO / "proto" / "shoal.proto").read_text()
    rpc = re.search(rf"rpc {name}\(\w+\) returns \((\w+)\)", proto)
    name = rpc.group(1) if rpc else name  # an RPC's reply, as `GetStats.problems`
    message = re.search(rf"(message|service) {name} \{{(.*?)\n\}}", proto, re.S)
    if message and re.search(rf"\b{attribute}\b", message.group(2)):
        return True
    for path in SOURCES:
        text = path.read_text()
        if re.search(rf"^\s*class {name}\b", text, re.M) and re.search(
                rf"def {attribute}\b|\b{attribute}\s*[:=]|self\.{attribute}\b", text):
            return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_class_member_the_docs_name_exists(page):
    missing = sorted({f"{a}.{b}" for a, b in NAMED.findall(page.read_text())
                      if not defines(a, b)})
    assert not missing, f"{page.relative_to(REPO)} names what the code no longer has: {missing}"
