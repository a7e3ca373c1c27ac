"""What the dashboard tests share: the key, Chromium's flags, the workers' node ids and how to
start one, open the page with the key and wait on it; conftest.py starts the cluster."""

import time
from pathlib import Path

import openai

from coordinator.ops.local_processes import LocalWorker, start_worker

KEY = "sk-dashboard-0123456789"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
NODES = ("mac-a", "mac-b")



def start_node(sharded: Path, index: int, secret_file: Path, logs: Path,
               port: str = "0") -> LocalWorker:
    return start_worker([sharded / f"worker-{index}"], secret_file,
                        logs / f"{NODES[index]}-{time.monotonic_ns()}.log",
                        ("--no-advertise", "--node-id", NODES[index], "--port", port),
                        forked=True)


def open_with_key(page, server) -> None:
    page.goto(server.url + "/")
    page.wait_for_selector("#key-form", state="visible", timeout=10_000)
    page.fill("#key-input", KEY)
    page.click("#key-form button")
    page.wait_for_selector("#main", state="visible", timeout=10_000)


def card_states(page) -> dict[str, str]:
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll(
        '.card.worker')].map(c => [c.dataset.node, c.dataset.state]))""")


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s (last: {value!r})")
        time.sleep(0.1)


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)

