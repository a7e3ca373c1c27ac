"""One cluster for every dashboard test of this folder, started once: two real workers on
loopback, `shoal serve` on them, and Debian's Chromium driven by Playwright; a fresh tab each."""

import os
import shutil
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

from coordinator.ops.local_processes import start_server, stop_workers
from engine.sharding import shard
from tests.integration.dashboard.page_parts import FLAGS, KEY, start_node


@pytest.fixture(scope="package")
def cluster(tiny_checkpoint, secret_file, tmp_path_factory):
    """(sharded folder, [worker mac-a, worker mac-b], log folder): replaced when restarted."""
    root = tmp_path_factory.mktemp("dashboard")
    sharded = root / "sharded"
    shard(tiny_checkpoint("qwen3_moe"), sharded, workers=2, progress=False)
    workers = []
    try:
        for index in range(2):
            workers.append(start_node(sharded, index, secret_file, root / "logs"))
        yield sharded, workers, root
    finally:
        stop_workers(workers)


@pytest.fixture(scope="package")
def server(cluster, secret_file):
    sharded, workers, root = cluster
    key_file = root / "key"
    key_file.write_text(KEY + "\n")
    local = start_server(sharded, [w.address for w in workers], secret_file, root / "serve.log",
                         ("--api-key-file", str(key_file), "--model-id", "tiny",
                          "--prompt-cache-dir", str(root / "prompt-cache")))
    yield local
    local.stop()


@pytest.fixture(scope="package")
def browser(chromium):
    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=chromium, args=FLAGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser, request, tmp_path):
    """A tab in a fresh context (its own profile and sessionStorage) that fails the test on
    any console error, and leaves a screenshot in the test's folder (and in the folder
    SHOAL_SCREENSHOTS names, if set)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    tab = context.new_page()
    errors: list[str] = []
    tab.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    tab.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    yield tab
    shot = tmp_path / f"{request.node.name}.png"
    try:
        tab.screenshot(path=str(shot), full_page=True)
        if folder := os.environ.get("SHOAL_SCREENSHOTS"):
            shutil.copy(shot, Path(folder) / shot.name)
    finally:
        context.close()
    assert not errors, errors

