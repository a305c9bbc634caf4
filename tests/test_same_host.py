"""Servers on the training host hand over their chunk memory: batches skip gRPC, and nothing
else changes (issue 17). Every comparison is against the same servers read over gRPC
(``shared_memory=False``); a server started with ``--local-socket false`` stands for a
remote one."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from remoteloader.client import RemoteLoader
from remoteloader.tools.shapes import make_coco
from remoteloader.tools.textures import make_imagefolder

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

SIZE, BATCH = 48, 8
FIELDS = ["bboxes", "bbox_labels", "mask"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("same-host")
    folder = make_imagefolder(root / "folder", ["a", "b", "c"], 12, size=(64, 80))
    (folder / "a" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")  # fails on every path alike
    other = make_imagefolder(root / "other", ["a", "b", "c"], 8, size=(64, 80), seed=3)
    coco = make_coco(root / "coco", 24, size=(64, 80))
    return {"folder": folder, "other": other, "coco": coco}


def read_epoch(address, **options) -> tuple[list[tuple], list, dict]:
    failures: list = []
    with RemoteLoader(address, batch_size=BATCH, image_size=SIZE, seed=3, drop_last=False, return_ids=True,
                      on_error=failures.extend, connect_timeout=20, **options) as loader:
        batches = [tuple(b) if not isinstance(b, dict) else b for b in loader]
        servers = loader.stats()["servers"]
    return batches, sorted((f.sample_id, f.reason) for f in failures), servers


def same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, dict):
            assert x.keys() == y.keys()
            for key in x:
                if isinstance(x[key], torch.Tensor):
                    assert torch.equal(x[key], y[key]), key
                else:
                    assert len(x[key]) == len(y[key]) and all(torch.equal(u, v) for u, v in zip(x[key], y[key])), key
        else:
            assert all(torch.equal(u, v) for u, v in zip(x, y))


@pytest.mark.parametrize("receiver", ["thread", "process"])
def test_batches_labels_targets_and_failures_are_the_same_bit_for_bit(cluster, data, receiver):
    folder = cluster.add(data["folder"])
    coco = cluster.add(data["coco"], "--coco-masks", "true")  # (FIELDS asks for the mask)
    for index, options in ((folder, {}), (coco, {"fields": FIELDS, "pipeline": "detection-train"})):
        address = cluster.address(index)
        shared, shared_failures, servers = read_epoch(address, receiver=receiver, **options)
        assert servers[address]["shared_memory"] is True  # it did take the same-host path
        grpc, grpc_failures, servers = read_epoch(address, receiver=receiver, shared_memory=False, **options)
        assert servers[address]["shared_memory"] is False
        same(shared, grpc)
        assert shared_failures == grpc_failures
    assert len(shared_failures) == 0 and len(grpc) > 0
    _, failures, _ = read_epoch(cluster.address(folder), receiver=receiver)
    assert [reason for _, reason in failures] and len(failures) == 1  # the broken file, once


def test_a_local_server_killed_mid_epoch_fails_over_to_a_remote_replica_and_back(cluster, data):
    local = cluster.add(data["folder"])
    remote = cluster.add(data["folder"], "--local-socket", "false")
    target = f"{cluster.address(local)},{cluster.address(remote)}"
    reference, _, _ = read_epoch(target, shared_memory=False)
    # share=False: the epoch is decoded again, not joined from what the servers kept of the
    # reference pass (server/sharing.py), so the local server holds work when it is killed.
    with RemoteLoader(target, batch_size=BATCH, image_size=SIZE, seed=3, drop_last=False, return_ids=True,
                      on_error=lambda failures: None, connect_timeout=20, reconnect_timeout=60,
                      share=False) as loader:
        it = iter(loader)
        got = [tuple(next(it)) for _ in range(2)]
        cluster.kill(local)
        got += [tuple(b) for b in it]
        ids = collections.Counter(i for _, _, batch_ids in got for i in batch_ids.tolist())
        assert set(ids.values()) == {1} and len(ids) == sum(len(b[2]) for b in reference)
        for (x, y, i), (xr, yr, ir) in zip(got, reference):
            assert torch.equal(i, ir) and torch.equal(y, yr) and torch.equal(x, xr)
        cluster.restart(local)
        deadline = time.monotonic() + 60
        while loader.stats()["servers"][cluster.address(local)]["state"] != "up":  # reconnected (back-off)
            assert time.monotonic() < deadline, loader.stats()["servers"]
            time.sleep(0.2)
        before = loader.stats()["servers"][cluster.address(local)]["samples"]
        loader.set_epoch(1)
        again = [tuple(b) for b in loader]
        servers = loader.stats()["servers"]
    assert servers[cluster.address(local)]["samples"] > before  # back, and used
    assert servers[cluster.address(local)]["shared_memory"] is True
    assert servers[cluster.address(remote)]["shared_memory"] is False
    assert sorted(i for _, _, b in again for i in b.tolist()) == sorted(ids)


def test_local_and_remote_servers_together_deliver_every_sample_once(cluster, data):
    local = cluster.add(data["folder"])
    remote = cluster.add(data["other"], "--local-socket", "false")
    target = f"{cluster.address(local)},{cluster.address(remote)}"
    batches, failures, servers = read_epoch(target)
    ids = [i for _, _, b in batches for i in b.tolist()]
    assert len(ids) == len(set(ids)) == 36 + 1 + 24 and len(failures) == 1  # (the broken file, in its zeros)
    assert servers[cluster.address(local)]["shared_memory"] and not servers[cluster.address(remote)]["shared_memory"]
    assert servers[cluster.address(local)]["samples"] > 0 and servers[cluster.address(remote)]["samples"] > 0


def shm_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("remoteloader")} if os.path.isdir(
        "/dev/shm") else set()


def test_nothing_is_left_in_shared_memory_after_either_side_is_sigkilled(cluster, data, tmp_path):
    before = shm_files()
    index = cluster.add(data["folder"])
    address = cluster.address(index)
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from remoteloader.client import RemoteLoader
        loader = RemoteLoader({address!r}, batch_size={BATCH}, image_size={SIZE}, on_error="skip", receiver="process")
        for epoch in range(1000):
            loader.set_epoch(epoch)
            for n, _ in enumerate(loader):
                if epoch == 0 and n == 0:
                    print("reading", loader.stats()["servers"][{address!r}]["shared_memory"], flush=True)
    """))
    client = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "reading True"
        os.killpg(os.getpgid(client.pid), 0)  # (alive)
        client.send_signal(signal.SIGKILL)
        client.wait(30)
    finally:
        if client.poll() is None:
            client.kill()
    # the server goes on serving: the killed client's stream ended and its slots came back
    batches, _, servers = read_epoch(address)
    assert servers[address]["shared_memory"] and batches
    cluster.kill(index)
    assert shm_files() <= before  # nothing named in /dev/shm: the memory lived in unlinked files


def test_a_client_that_stops_reading_pins_no_server_memory_and_is_not_ended(cluster, data):
    """Chunks are copied out and released as they come, into batches the client keeps: one
    that stops reading holds no slot of the server's (whose stall rules would end its stream)."""
    index = cluster.add(data["folder"], "--stall-timeout", "2", "--slots", "4")
    address = cluster.address(index)
    with RemoteLoader(address, batch_size=BATCH, image_size=SIZE, seed=3, drop_last=False, return_ids=True,
                      on_error=lambda failures: None, prefetch=2, connect_timeout=20) as paused:
        it = iter(paused)
        first = next(it)
        time.sleep(4)  # twice the stall timeout, reading nothing
        batches, _, servers = read_epoch(address)  # another client meanwhile
        assert batches and servers[address]["shared_memory"]
        rest = [first, *it]  # and the first goes on where it stopped
        assert paused.stats()["servers"][address]["failures"] == 0  # its stream was never ended
    assert sorted(i for _, _, b in rest for i in b.tolist()) == list(range(37))
