"""The coordinator serving its own Mac's experts in process (dataplane/local_experts.py) gives
exactly mlx-lm's output: this Mac alone, one local store beside one remote worker, and replicas
across the two, in float32 and 4-bit, with every expert in memory and under a 10% budget."""

import os
import signal
import time

import httpx2 as httpx
import mlx.core as mx
import pytest
from mlx_lm.utils import load_model
from playwright.sync_api import sync_playwright

from coordinator.dataplane.local_experts import ADDRESS
from coordinator.decoding.generate import open_remote_model
from coordinator.decoding.report import members_report, streaming_report
from coordinator.ops.local_processes import start_server
from coordinator.ops.worker_stats import read_stats
from engine.auth import load_secret
from engine.process import GRAPHS
from engine.sharding import shard
from tests.integration.dashboard.page_parts import FLAGS as BROWSER_FLAGS
from tests.integration.test_equivalence import PROMPT, greedy_tokens, make_stores

NEW_TOKENS = 8


def expected_output(source):
    reference, _ = load_model(source)
    return reference(mx.array([PROMPT])), greedy_tokens(reference, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("bits", [None, 4])
def test_this_mac_alone_matches_mlx_lm_in_memory_and_streaming_at_10_percent(
    bits, tiny_checkpoint, tmp_path, monkeypatch
):
    monkeypatch.setenv(GRAPHS, "recorded")  # restored after the test
    monkeypatch.delenv(GRAPHS)
    source = tiny_checkpoint("qwen3_moe", quantize_bits=bits)
    expected_logits, expected = expected_output(source)
    sharded = tmp_path / "sharded"
    shard(source, sharded, progress=False)
    for budget in ("100%", "10%"):
        remote = open_remote_model(sharded, [], b"", local_stores=[sharded / "experts"],
                                   memory_budget=budget)
        try:
            logits = remote.model(mx.array([PROMPT]))
            before = read_stats(remote.cluster.links)
            tokens = greedy_tokens(remote.model, PROMPT, NEW_TOKENS)
            after = read_stats(remote.cluster.links)
        finally:
            remote.close()
        assert remote.cluster.links == [remote.local]  # no worker at all
        # nothing evaluates per layer without workers: MLX keeps its own launch setting
        assert GRAPHS not in os.environ
        assert mx.array_equal(logits, expected_logits), budget
        paths = {a: m["path"] for a, m in members_report(remote.dispatcher.stats).items()}
        assert tokens == expected, budget
        local = streaming_report(before, after, NEW_TOKENS,
                           remote.dispatcher.lookahead.stats)["workers"][ADDRESS]
        assert not local["problems"]
        if budget == "100%":
            # every layer ran as mlx-lm runs it: the switch over the stack, no dispatch
            assert not remote.dispatcher.stats.layers
            assert paths == {"local (whole layers)": "in process, mlx-lm's call"}
            assert local["hit_rate"] == 1.0 and local["bytes_read"] == 0
            assert local["demands"] > 0  # the heat and hits were counted all the same
        else:
            # decode steps ran as mlx-lm runs them, over the cache's slots (no request), timed
            # as a dispatched call is: the picks' evaluation, the waits for reads, the rest;
            # the prompt's pass, whose picks need more slots than 10% has, was dispatched
            decode = remote.dispatcher.stats.decode
            assert decode.calls > 0 and decode.requests == 0 and decode.sync_seconds > 0
            assert 0 <= decode.worker_reads_seconds < decode.seconds
            assert decode.worker_bookkeeping_seconds > 0
            assert remote.dispatcher.stats.prefill.requests > 0
            assert paths[ADDRESS] == "in process"
            assert local["bytes_read"] > 0 and local["hit_rate"] < 1.0
            assert local["prefetch_issued"] > 0  # the router's lookahead reached the cache
            # the time spent waiting for the drives is its own part, not bookkeeping's
            total = remote.dispatcher.stats.total()
            assert 0 < total.worker_reads_seconds < total.seconds


def test_a_store_is_served_by_one_coordinator_process_at_a_time(tiny_checkpoint, tmp_path):
    from coordinator.dataplane.local_experts import open_local_experts
    from engine.errors import ShoalError

    sharded = tmp_path / "sharded"
    manifest = shard(tiny_checkpoint("qwen3_moe"), sharded, progress=False)
    first = open_local_experts([sharded / "experts"], manifest, warm=False)
    try:
        with pytest.raises(ShoalError, match=f"served by shoal --local-store PID {os.getpid()}"):
            open_local_experts([sharded / "experts"], manifest, warm=False)
    finally:
        first.close()
    open_local_experts([sharded / "experts"], manifest, warm=False).close()  # released


@pytest.mark.slow
@pytest.mark.parametrize("bits", [None, 4])
def test_one_local_store_and_one_worker_with_and_without_replicas_match_mlx_lm(
    bits, tiny_checkpoint, tmp_path, start_worker, secret_file, monkeypatch
):
    monkeypatch.setenv(GRAPHS, "recorded")  # restored after the test
    monkeypatch.delenv(GRAPHS)
    source = tiny_checkpoint("qwen3_moe", quantize_bits=bits)
    expected_logits, expected = expected_output(source)
    sharded = tmp_path / "sharded"
    manifest = shard(source, sharded, progress=False)
    keys = sorted((e.layer, e.expert) for e in manifest.experts)
    # Halves, so that 10% of either side is still more than one expert; then each side also
    # holding copies of some of the other's, so that copies on both take turns.
    splits = {"split": [keys[::2], keys[1::2]],
              "replicas": [keys[::2] + keys[1::6], keys[1::2] + keys[::4]]}
    secret = load_secret(secret_file)
    for name, shares in splits.items():
        here, there = make_stores(sharded, tmp_path / name, shares)
        for budget in ("100%", "10%"):
            worker = start_worker([there], "--memory-budget", budget, forked=True)
            remote = open_remote_model(sharded, [worker.address], secret, local_stores=[here],
                                       memory_budget=budget)
            try:
                assert os.environ[GRAPHS] == "0"  # with workers every layer evaluates
                logits = remote.model(mx.array([PROMPT]))
                tokens = greedy_tokens(remote.model, PROMPT, NEW_TOKENS)
                routes = remote.cluster.routes
                paths = {a: m["path"]
                         for a, m in members_report(remote.dispatcher.stats).items()}
            finally:
                remote.close()
                worker.stop()
            case = f"{name} at {budget}"
            assert mx.array_equal(logits, expected_logits), case
            assert tokens == expected, case
            served = remote.dispatcher.stats.worker_requests
            assert served[ADDRESS] > 0 and served[worker.address] > 0, (case, served)
            assert paths[ADDRESS] == "in process" and paths[worker.address] == "lane", case
            assert any(r.replicated for r in routes.values()) == (name == "replicas"), case


@pytest.mark.slow
def test_shoal_serve_on_one_mac_alone_answers_as_mlx_lm_batched_or_not(
    tiny_checkpoint, tmp_path
):
    import concurrent.futures

    import httpx2 as httpx
    import openai
    from mlx_lm.utils import load_tokenizer

    from coordinator.decoding.generate import encode_messages, generate
    from coordinator.ops.local_processes import start_server

    source = tiny_checkpoint("qwen3_moe")
    sharded = tmp_path / "sharded"
    shard(source, sharded, progress=False)
    model, _ = load_model(source)
    tokenizer = load_tokenizer(source)
    chats = [[{"role": "user", "content": text}]
             for text in ("What is the capital of France?", "Tell me about fish.", "a")]
    expected = [generate(model, tokenizer, encode_messages(tokenizer, chat), max_tokens=10).text
                for chat in chats]
    for budget in ("100%", "25%"):
        server = start_server(sharded, [], tmp_path / "no-secret", tmp_path / f"{budget}.log",
                              ("--local-store", str(sharded / "experts"),
                               "--memory-budget", budget, "--model-id", "tiny"))
        try:
            health = httpx.get(server.url + "/health", timeout=10)
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                                   max_retries=0, timeout=60)

            def ask(chat, client=client):
                reply = client.chat.completions.create(model="tiny", messages=chat,
                                                       max_tokens=10, temperature=0)
                return reply.choices[0].message.content

            alone = [ask(chat) for chat in chats]
            with concurrent.futures.ThreadPoolExecutor(len(chats)) as pool:
                together = list(pool.map(ask, chats))  # decoded as one batch
        finally:
            server.stop()
        assert health.status_code == 200 and health.json()["workers"] == 1, health.text
        assert alone == expected, budget
        assert together == expected, budget


class _Stop(Exception):
    """The rebalance stopped between two steps (as by Ctrl-C or a crash of the command)."""


@pytest.mark.slow
def test_experts_move_from_the_coordinator_to_a_worker_and_back_stopped_at_every_step(
    tiny_checkpoint, tmp_path, start_worker, secret_file
):
    """A live migration in the generating process: some of the coordinator's own experts go
    to a worker, then come back. The run is stopped after every single step and planned again
    from what the members then report; at every stop each expert still has a verified file on
    some drive, and generation (which follows the moves) still gives mlx-lm's tokens."""
    import shutil

    from coordinator.ops.migration_executor import Executor
    from coordinator.ops.rebalancer import observe
    from engine.migration import plan_migration
    from engine.rebalance_plan import state_of
    from worker.store import scan_stores

    source = tiny_checkpoint("qwen3_moe")
    _, expected = expected_output(source)
    sharded = tmp_path / "out"
    manifest = shard(source, sharded, workers=2, progress=False)
    here, there = tmp_path / "here", tmp_path / "there"  # not in OUT_DIR: no third source
    shutil.move(sharded / "worker-0", here)
    shutil.move(sharded / "worker-1", there)
    worker = start_worker([there], "--no-advertise", "--node-id", "w1")
    remote = open_remote_model(sharded, [worker.address], load_secret(secret_file),
                               local_stores=[here])
    sizes = {(e.layer, e.expert): e.bytes for e in manifest.experts}
    everything = set(sizes)
    try:
        links = remote.cluster.links
        me = remote.local.node_id
        moved = sorted(remote.local.held())[:3]
        for holder in ("w1", me):  # out to the worker, then back
            stops = 0
            while True:
                members, by_name = observe(links)
                state = state_of(members, sizes, ())
                target = {key: tuple(sorted(held)) for key, held in
                          ((k, {w for w, s in copies.items() if s == "serving"})
                           for k, copies in state.items())}
                target.update({key: (holder,) for key in moved})
                plan = plan_migration(state, target, sizes)
                if not plan.steps:
                    break
                assert stops < 40, "the migration does not converge"

                def stop_after_one(event, step, sent, plan=plan):
                    if event == "step" and step is not plan.steps[0]:
                        raise _Stop

                executor = Executor(manifest, by_name, {}, log=lambda m: None, quiet=0.1,
                                    progress=False, on_event=stop_after_one)
                with pytest.raises(_Stop):
                    if executor.run(plan, "rebalance").steps_done == len(plan.steps):
                        raise _Stop  # a one-step plan ran to its end
                stops += 1
                on_disk = set(scan_stores([here]).held) | set(scan_stores([there]).held)
                assert on_disk == everything, f"lost {sorted(everything - on_disk)}"
                tokens = greedy_tokens(remote.model, PROMPT, NEW_TOKENS)
                assert tokens == expected, f"after {stops} steps towards {holder}"
            # copy (the receiver verifies and serves what it took in), drain, delete each
            assert stops >= 3 * len(moved)
            served = {w.name: w.serving for w in observe(links)[0]}
            assert all(key in served[holder] for key in moved)
            assert not any(key in held for name, held in served.items() if name != holder
                           for key in moved)
        assert remote.cluster.reloads > 0  # the dispatcher followed the members' inventories
    finally:
        remote.close()


@pytest.mark.slow
@pytest.mark.parametrize("towards", ["worker", "coordinator"])
def test_a_worker_killed_mid_copy_to_or_from_the_coordinator_loses_nothing_and_a_rerun_finishes(
    towards, tiny_checkpoint, tmp_path, start_worker, secret_file
):
    """Experts move between the coordinator's own store and a worker; the worker is killed in
    the middle of the second copy (as receiver, or as the source the coordinator reads from).
    Every expert keeps a verified file; with the worker back, planning again from what the
    members hold resumes the partial file and finishes, and the tokens are mlx-lm's."""
    import shutil
    import time

    from coordinator.ops.migration_executor import Executor
    from coordinator.ops.rebalancer import observe
    from engine.errors import ShoalError
    from engine.migration import plan_migration
    from engine.rebalance_plan import state_of
    from worker.store import scan_stores

    source = tiny_checkpoint("qwen3_moe")
    _, expected = expected_output(source)
    sharded = tmp_path / "out"
    manifest = shard(source, sharded, workers=2, progress=False)
    here, there = tmp_path / "here", tmp_path / "there"
    shutil.move(sharded / "worker-0", here)
    shutil.move(sharded / "worker-1", there)
    sizes = {(e.layer, e.expert): e.bytes for e in manifest.experts}
    secret = load_secret(secret_file)

    def migrate_towards(remote, moved, holder, on_event=None):
        members, by_name = observe(remote.cluster.links)
        state = state_of(members, sizes, ())
        target = {k: tuple(sorted(w for w, s in copies.items() if s == "serving"))
                  for k, copies in state.items()}
        target.update({key: (holder,) for key in moved})
        executor = Executor(manifest, by_name, {}, log=lambda m: None, quiet=0.1,
                            progress=False, chunk_bytes=4096, on_event=on_event)
        return executor.run(plan_migration(state, target, sizes), "rebalance")

    worker = start_worker([there], "--no-advertise", "--node-id", "w1")
    remote = open_remote_model(sharded, [worker.address], secret, local_stores=[here])
    me = remote.local.node_id
    holder, giver = ("w1", here) if towards == "worker" else (me, there)
    moved = sorted(scan_stores([giver]).held)[:3]
    copies, killed = [], []

    def kill(event, step, sent):
        if event == "step" and step.kind == "copy":
            copies.append(step)
        if event == "chunk" and len(copies) == 2 and sent >= 8192 and not killed:
            killed.append(step)
            time.sleep(0.3)  # let the receiver write what it was sent
            worker.proc.kill()
            worker.proc.wait(10)

    try:
        with pytest.raises(ShoalError, match="run the command again"):
            migrate_towards(remote, moved, holder, kill)
    finally:
        remote.close()
    assert killed
    on_disk = set(scan_stores([here]).held) | set(scan_stores([there]).held)
    assert on_disk == set(sizes), f"lost {sorted(set(sizes) - on_disk)}"
    receiver = there if towards == "worker" else here
    partial = list(receiver.rglob("*.incoming"))
    assert partial  # kept, to resume from
    # A worker receiving is killed with part of the file written; the coordinator reading
    # from a worker has had the whole file in one message of the source's stream (it is
    # smaller than a chunk), so what it keeps is the next copy's start, which failed at once.
    resumed_from = 4096 if towards == "worker" else 0
    assert partial[0].stat().st_size >= resumed_from

    worker = start_worker([there], "--no-advertise", "--node-id", "w1")  # back, new port
    remote = open_remote_model(sharded, [worker.address], secret, local_stores=[here])
    try:
        events = []
        migrate_towards(remote, moved, holder, lambda *e: events.append(e))
        if resumed_from:  # a copy that starts at byte 0 is a fresh one, not a resume
            assert any(e[0] == "resume" and e[2] >= resumed_from for e in events)
        served = {w.name: w.serving for w in observe(remote.cluster.links)[0]}
        assert all(key in served[holder] for key in moved)
        assert greedy_tokens(remote.model, PROMPT, NEW_TOKENS) == expected
    finally:
        remote.close()
    assert not list(here.rglob("*.incoming")) and not list(there.rglob("*.incoming"))


def test_serve_local_store_shows_its_heat_and_says_how_it_stops(tiny_checkpoint, tmp_path,
                                                                   secret_file, chromium):
    """The demo's `shoal serve --local-store`: /api/heat counts the traffic of the
    coordinator's own experts and names them as their owner, and the page's heat map shows
    it; the per-layer-call chart, with no call sent, says so instead of a scale of 1e-9;
    uvicorn's lines read as "uvicorn", not "uvicorn.error"; Ctrl-C says it stops, then that
    it stopped."""
    sharded = tmp_path / "one"
    shard(tiny_checkpoint("qwen3_moe"), sharded, workers=1, progress=False)
    server = start_server(sharded, [], secret_file, tmp_path / "serve.log",
                          ("--local-store", str(sharded / "worker-0")))
    try:
        before = httpx.get(server.url + "/api/heat", timeout=30).json()
        assert before["max"] == 0
        answer = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "one", "prompt": "the heat of a fish", "max_tokens": 24})
        assert answer.status_code == 200, answer.text
        deadline = time.monotonic() + 20
        while (heat := httpx.get(server.url + "/api/heat", timeout=30).json())["max"] == 0:
            assert time.monotonic() < deadline, heat
            time.sleep(0.5)
        assert heat["summary"]["tokens"] > 0 and len(heat["workers"]) == 1
        assert all(o == 0 for row in heat["owner"] for o in row)  # this process holds all
        assert heat["counts"] != before["counts"]
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=BROWSER_FLAGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(server.url + "/")
                page.wait_for_function("window.shoalDashboard.heatCells() > 0", timeout=15_000)
                hottest = page.evaluate("""(h) => Math.max(...h.layers.flatMap((l, r) =>
                    h.counts[r].map((_, e) => window.shoalDashboard.heatCell(l, e).tokens)))""",
                                        heat)
                assert hottest == heat["max"] > 0
                page.wait_for_function("document.getElementById('speed-figures')"
                                       ".childElementCount > 0", timeout=15_000)
                inked = """([x, y, w, h]) => { const d = document.getElementById(
                    'breakdown-chart').getContext('2d').getImageData(x, y, w, h).data;
                    let n = 0; for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n; }"""
                assert page.evaluate(inked, [0, 0, 40, 14]) == 0  # no scale: nothing measured
                assert page.evaluate(inked, [0, 40, 1200, 40]) > 50  # the note instead
            finally:
                browser.close()
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
    log = server.log.read_text()
    assert "uvicorn.error" not in log and "INFO uvicorn: Started" in log
    assert "shoal serve: stopping: new requests are refused" in log
    assert log.rstrip().endswith("shoal serve: stopped")
    assert "Traceback" not in log
