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
