"""The node id is stable per machine and renewed when copied to another; a real worker
answers liveness checks without the credential and nothing else."""

import json
import os
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.cluster.discovery import Browser
from engine.advert import Advert
from engine.auth import load_secret, make_credential
from engine.sharding import shard
from proto import secure_channel, shoal_pb2, shoal_pb2_grpc
from worker.advertise import (
    Advertiser,
    choose_node_id,
    host_label,
    instance_name,
    load_node_id,
    machine_fingerprint,
    node_id_path,
)


def test_a_stored_node_id_is_kept_on_its_own_machine_only():
    fresh = choose_node_id(None, "m1", "Studio.local", "abc123")
    assert (fresh.node_id, fresh.write, fresh.note) == ("studio-abc123", True, None)
    kept = choose_node_id({"node_id": "studio-abc123", "machine": "m1"}, "m1", "x", "zzz")
    assert (kept.node_id, kept.write, kept.note) == ("studio-abc123", False, None)
    copied = choose_node_id({"node_id": "studio-abc123", "machine": "m1"}, "m2", "mini", "f00")
    assert copied.node_id == "mini-f00" and copied.write
    assert "made on another machine" in copied.note and "studio-abc123" in copied.note
    broken = choose_node_id({"machine": "m1"}, "m1", "mini", "f00")
    assert broken.node_id == "mini-f00" and "unreadable" in broken.note


def test_host_label_is_dns_safe():
    assert host_label("Jan's MacBook-Pro.local") == "jan-s-macbook-pro"
    assert host_label("...") == "worker"


def test_node_id_file_lives_in_the_config_folder_and_survives_restarts(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    path = node_id_path()
    assert path == tmp_path / "shoal" / "node-id"
    notes = []
    first = load_node_id(path, log=notes.append)
    assert load_node_id(path, log=notes.append) == first and notes == []
    assert json.loads(path.read_text()) == {"node_id": first, "machine": machine_fingerprint()}

    path.write_text(json.dumps({"node_id": first, "machine": "another-mac"}))  # a copy
    renewed = load_node_id(path, log=notes.append)
    assert renewed != first and "another machine" in notes[0]
    assert load_node_id(path, log=notes.append) == renewed


@pytest.fixture
def worker(tiny_checkpoint, tmp_path, start_worker):
    out = tmp_path / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, workers=2, progress=False)
    return start_worker([out / "worker-0"], "--no-advertise", "--node-id", "w0")


def test_liveness_needs_no_credential_but_everything_else_does(worker, secret_file):
    channel = secure_channel(worker.address, load_secret(secret_file).identity, [])
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="shoal.v1.ExpertService"), timeout=10
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub = shoal_pb2_grpc.ExpertServiceStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.GetInventory(shoal_pb2.InventoryRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    credential = make_credential(load_secret(secret_file), "/shoal.v1.ExpertService/GetInventory")
    inventory = stub.GetInventory(shoal_pb2.InventoryRequest(), timeout=10,
                                  metadata=[("shoal-auth", credential)])
    assert inventory.node_id == "w0"
    assert inventory.memory_budget > 0 and inventory.free_disk > 0
    channel.close()


def test_worker_refuses_an_unknown_interface_and_a_bad_cluster_name(tmp_path, secret_file,
                                                                    tiny_checkpoint):
    out = tmp_path / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, workers=2, progress=False)
    for flags, message in [(["--interface", "nosuch9"], "no IPv4 interface 'nosuch9'"),
                           (["--cluster", "two words"], "cluster name 'two words'")]:
        run = subprocess.run(
            [sys.executable, "-m", "worker.daemon", "--store", str(out / "worker-0"),
             "--secret-file", str(secret_file), "--port", "0", *flags],
            capture_output=True, text=True, timeout=120,
        )
        assert run.returncode == 2 and message in run.stderr, run.stderr
        assert "Traceback" not in run.stderr


def test_instance_names_differ_per_port_and_stay_across_restarts():
    machine = machine_fingerprint()
    assert instance_name("a", machine, 50551) == instance_name("a", machine, 50551)
    assert instance_name("a", machine, 50551) != instance_name("a", machine, 50552)
    assert instance_name("a", machine, 50551) != instance_name("a", "other-mac", 50551)
    assert len(instance_name("x" * 63, machine, 1)) <= 63  # one DNS label


def test_two_workers_with_one_node_id_are_both_announced_and_both_warn():
    """Without relying on mDNS renaming (which needs probe answers that not every Mac
    delivers): each has its own instance name, a browser sees both, and each one says so."""
    cluster = f"dup-{os.getpid()}"
    logs: list[list[str]] = [[], []]
    advert = Advert(node_id="a", cluster=cluster, protocol=1, model="f" * 64,
                    inventory="0" * 16, experts=1, memory_budget=1, free_disk=1)
    advertisers = [Advertiser(advert, ["127.0.0.1"], 40001 + i, log=logs[i].append)
                   for i in range(2)]
    seen: dict[str, str] = {}
    browser = Browser(cluster, lambda c: seen.__setitem__(c.key, c.advert.node_id),
                      lambda key: None, interfaces=["127.0.0.1"])
    try:
        for advertiser in advertisers:
            advertiser.start()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not (
            len(seen) == 2 and all(a.duplicates for a in advertisers)
        ):
            time.sleep(0.1)
    finally:
        browser.close()
        for advertiser in advertisers:
            advertiser.close()
    assert sorted(seen.values()) == ["a", "a"], seen
    assert {a.name for a in advertisers} == set(seen)
    for log in logs:
        assert any("already uses node id 'a'" in line and "duplicate id" in line for line in log)
