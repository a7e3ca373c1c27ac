"""Every environment variable the product reads is named in the README, where a user looks
(SHOAL_CACHE was once documented only in `shoal demo --help`)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("coordinator", "worker", "engine", "builders", "benchmarks", "scripts")
# Set by Shoal for its own child processes or test tooling, never by a user.
INTERNAL = {"SHOAL_CUDA_GRAPHS_DEFAULTED", "SHOAL_VARIANT_WORKER_ENV",
            "SHOAL_WIRE_DIRECTIONS_DIR", "SHOAL_FAMILIES_REPORT"}


def test_the_readme_names_every_variable_a_user_may_set():
    read = set()
    for folder in PRODUCT:
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".sh"):
                read |= set(re.findall(r"\bSHOAL_[A-Z_]+\b", path.read_text()))
    assert "SHOAL_CACHE" in read and "SHOAL_SECRET_FILE" in read  # the scan finds them
    readme = (REPO / "README.md").read_text()
    assert sorted(v for v in read - INTERNAL if v not in readme) == []
    assert INTERNAL <= read, "an internal variable is gone: drop it from INTERNAL"


def test_the_quick_start_is_two_commands_and_says_where_shoal_lives():
    readme = (REPO / "README.md").read_text()
    quick = readme.split("## Quick start")[1].split("\n## ")[0]
    blocks = re.findall(r"```\n(.*?)\n```", quick, re.S)
    assert blocks == ["bash scripts/setup.sh && .venv/bin/shoal demo",
                      "bash scripts/setup.sh && .venv/bin/pytest"]
    assert "source .venv/bin/activate" in quick  # the bare `shoal` below needs it
    assert (REPO / "scripts" / "setup.sh").is_file()


def test_workers_the_readme_starts_on_one_machine_do_not_collide():
    readme = (REPO / "README.md").read_text()
    one_machine = readme.split("both on one machine")[1].split("# on the coordinator")[0]
    workers = [line for line in one_machine.splitlines() if "shoal-worker" in line]
    ports = [int(re.search(r"--port (\d+)", w)[1]) for w in workers]
    names = [re.search(r"--node-id (\S+)", w)[1] for w in workers]
    assert len(workers) == 2 and len(set(names)) == 2
    assert abs(ports[0] - ports[1]) > 1  # each worker's lane takes its port + 1
