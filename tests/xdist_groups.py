"""How pytest-xdist spreads the suite (tests/conftest.py's hooks): tests that share a module's or
a package's fixtures, or an xdist_group mark, run on one worker; every other test on its own.
The workers write the groups they collect to a folder that the controller's scheduler reads."""

import json
import os
import tempfile
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

# explicit groups: the demo's stores (a store is served by one worker process at a time)
DEMO_CACHE = "demo-cache"
ROOT = ("", "tests")  # node ids of the root folder and tests/conftest.py


def group_of(item: pytest.Item) -> str | None:
    """The group `item` runs in (None: any worker, alone): its xdist_group mark, else the
    broadest module or package (or their conftest) whose non-function fixtures it takes, so
    that those are built or started once. The root conftest's are every worker's own."""
    for mark in item.iter_markers("xdist_group"):
        return str(mark.args[0] if mark.args else mark.kwargs["name"])
    if "demo_first_run" in item.fixturenames:
        return DEMO_CACHE
    owners = [defs[-1].baseid for defs in item._fixtureinfo.name2fixturedefs.values()
              if defs[-1].scope != "function" and defs[-1].baseid not in ROOT]
    return min(owners, key=len, default=None)


def first_the_longest(items: list[pytest.Item]) -> None:
    """Order the groups for the scheduler, which hands them out in this order: the demo's
    (its first run builds for most of a minute, and the longest chain), then the groups and
    tests with a test marked `long` (so that none of them starts last and ends the run alone),
    then the other groups, most tests first, then the tests of no group."""
    groups = [group_of(item) for item in items]
    sizes = {group: groups.count(group) for group in groups}
    long = {group or item.nodeid for item, group in zip(items, groups, strict=True)
            if item.get_closest_marker("long")}
    rank = {item.nodeid: (group != DEMO_CACHE, (group or item.nodeid) not in long,
                          group is None, -sizes[group])
            for item, group in zip(items, groups, strict=True)}
    items.sort(key=lambda item: rank[item.nodeid])


def groups_folder(config: pytest.Config) -> Path:
    """The controller's folder for the workers' group files (made on first use)."""
    if not hasattr(config, "shoal_groups"):
        config.shoal_groups = Path(tempfile.mkdtemp(prefix="shoal-xdist-groups-"))
    return config.shoal_groups


def write_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker: order `items` and write {node id: group} for the controller."""
    folder = getattr(config, "workerinput", {}).get("shoal_groups")
    if folder is None:
        return
    first_the_longest(items)
    groups = {item.nodeid: group for item in items if (group := group_of(item))}
    name = Path(folder) / config.workerinput["workerid"]
    name.with_suffix(".part").write_text(json.dumps(groups))
    os.replace(name.with_suffix(".part"), name.with_suffix(".json"))  # whole, or not there


class SharedFixtureScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with our groups as the scopes. (xdist's own loadgroup reads
    them from node ids that pytest 9.2 no longer lets a plugin change: pytest-xdist#1386.)"""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # first_the_longest has ordered them
        self.folder = groups_folder(config)
        self.groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self.groups is None:  # every worker has collected (and written) by now
            written = sorted(self.folder.glob("*.json"))
            if not written:
                raise RuntimeError(f"no xdist worker wrote its test groups to {self.folder}")
            self.groups = json.loads(written[0].read_text())
        return self.groups.get(nodeid, nodeid)
