"""Concurrent jobs on one fleet: a chunk asked for by several streams is decoded once
(server/sharing.py), each job still gets every sample once, and jobs share the decode
workers by weight (server/fair_queue.py, server/slots.py).

Units first (the fair queue, the renderings' table over real slots), then real servers:
    0, 1  shards A and B, one server each, with slots enough to keep a whole epoch's chunks
    2     shard C (60 samples) on a server of 4 slots: a late job falls out of its window
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from conftest import ANY_PORT, wait_until_equal

from remoteloader.client import RemoteLoader
from remoteloader.protos import SERVICE, loader_pb2
from remoteloader.server.local_socket import Loans
from remoteloader.server.pipelines import PipelineSpec
from remoteloader.server.shared_memory import Arena
from remoteloader.server.sharing import ChunkKey, SharedRenders
from remoteloader.server.slots import Slots
from remoteloader.server.stalls import Stalls
from remoteloader.server.worker_pool import Rendered
from remoteloader.tools.textures import make_imagefolder

pytestmark = pytest.mark.timeout(180)

PER_CLASS = 12  # x 2 classes: 24 samples a shard, 48 an epoch over servers 0 and 1
BATCH = 8
SIZE = 32


# ---- renderings shared over real slots ----------------------------------------------------------

SPEC = PipelineSpec("eval", SIZE, SIZE)


def key(first: int, seed: int = 0, spec: PipelineSpec = SPEC) -> ChunkKey:
    return ChunkKey(spec, ("shard",) * 4, seed, 0, np.arange(first, first + 4, dtype=np.int64).tobytes())


class Renders:
    """SharedRenders over a real arena, with renderings the test completes by hand."""

    def __init__(self, slots: int):
        self.arena = Arena(slots, 4096)
        self.slots = Slots(self.arena)
        self.renders = SharedRenders(self.slots)
        self.started: list[asyncio.Future[Rendered]] = []

    def render(self, slot: int) -> asyncio.Future[Rendered]:
        future: asyncio.Future[Rendered] = asyncio.get_running_loop().create_future()
        self.started.append(future)
        return future

    async def start(self, stream, chunk: ChunkKey | None):
        return await self.renders.start(stream, chunk, self.render)


def test_streams_that_ask_for_the_same_chunk_share_one_rendering_and_one_slot():
    async def run():
        r = Renders(12)
        a, b = r.slots.open("#1"), r.slots.open("#2")
        first = await r.start(a, key(0))
        second = await r.start(b, key(0))
        assert len(r.started) == 1 and second.joined and not first.joined
        assert second.slot == first.slot and second.future is first.future
        other = await r.start(b, key(0, seed=1))  # another seed: its own
        assert len(r.started) == 2 and not other.joined and other.slot != first.slot
        apart = await r.start(b, None)  # exclusive: never joined, never joinable
        assert len(r.started) == 3 and not r.renders.has(None)
        r.started[0].set_result(Rendered([], []))
        await asyncio.sleep(0)
        r.renders.give(a, first.slot)
        assert r.arena.free == 9  # b still holds it
        r.renders.give(b, second.slot)
        assert r.arena.free == 9 and r.renders.kept == 1  # clean: kept for a later stream
        c = r.slots.open("#3")
        later = await r.start(c, key(0))
        assert later.joined and later.slot == first.slot and r.renders.kept == 0 and len(r.started) == 3
        r.renders.give(c, later.slot)
        for slot, future in ((other.slot, r.started[1]), (apart.slot, r.started[2])):
            future.set_result(Rendered([(0, "broken")], []))
            await asyncio.sleep(0)
            r.renders.give(b, slot)
        assert r.arena.free == 11 and r.renders.kept == 1  # a rendering with errors is not kept
        assert not r.renders.has(key(0, seed=1))

    asyncio.run(run())


def test_kept_renderings_go_back_oldest_first_when_a_stream_needs_a_slot():
    async def run():
        r = Renders(3)
        a = r.slots.open("#1")
        for first in (0, 4, 8):
            started = await r.start(a, key(first))
            r.started[-1].set_result(Rendered([], []))
            await asyncio.sleep(0)
            r.renders.give(a, started.slot)
        assert r.renders.kept == 3 and r.arena.free == 0
        await r.start(a, key(12))  # none free: the oldest kept one goes back
        assert not r.renders.has(key(0)) and r.renders.has(key(4)) and r.renders.has(key(8))
        assert len(r.renders) == 3

    asyncio.run(asyncio.wait_for(run(), 10))


def test_a_kept_rendering_whose_slot_went_back_is_never_joined():
    async def run():
        r = Renders(6)  # two streams: a share of 3 each
        a, b = r.slots.open("#1"), r.slots.open("#2")
        kept = await r.start(a, key(0))
        r.started[-1].set_result(Rendered([], []))
        await asyncio.sleep(0)
        r.renders.give(a, kept.slot)
        assert r.renders.kept == 1 and r.renders.has(key(0))
        for stream, takes in ((a, 3), (b, 2)):
            for _ in range(takes):
                await r.start(stream, None)  # rendered apart
        assert r.arena.free == 0
        evicted = await r.start(b, None)  # none free: the kept slot goes back, and is taken for another rendering
        assert evicted.slot == kept.slot and r.renders.kept == 0
        assert not r.renders.has(key(0)) and len(r.renders) == 0  # its pixels are another chunk's now

    asyncio.run(asyncio.wait_for(run(), 10))


def test_a_clean_rendering_is_not_kept_while_a_take_waits_for_a_slot():
    async def run():
        r = Renders(4)  # three streams: a share of 2 each
        a, b, c = r.slots.open("#1"), r.slots.open("#2"), r.slots.open("#3")
        done = await r.start(a, key(0))
        await r.start(a, None)
        for _ in range(2):
            await r.start(b, None)
        assert r.arena.free == 0
        waiting = asyncio.ensure_future(r.start(c, None))
        while r.slots.waiters != 1:  # (bounded by the test's wait_for)
            await asyncio.sleep(0)
        r.started[0].set_result(Rendered([], []))
        await asyncio.sleep(0)
        r.renders.give(a, done.slot)  # clean, but a take waits: it goes to that take
        taken = await asyncio.wait_for(waiting, 5)
        assert taken.slot == done.slot and r.renders.kept == 0 and not r.renders.has(key(0))

    asyncio.run(asyncio.wait_for(run(), 10))


def test_a_clean_rendering_lent_to_a_same_host_client_is_kept_once_released():
    async def run():
        r = Renders(6)
        a = r.slots.open("#1")
        loans = Loans(Stalls(r.slots, stall_timeout=60), r.renders, a)
        started = await r.start(a, key(0))
        r.started[-1].set_result(Rendered([], []))
        await asyncio.sleep(0)
        ticket = loans.lend(started.slot)
        assert loans.give_back(ticket) and a.held == 0
        assert r.renders.kept == 1 and r.renders.has(key(0)) and r.arena.free == 5
        b = r.slots.open("#2")
        later = await r.start(b, key(0))
        assert later.joined and later.slot == started.slot and r.renders.kept == 0
        r.renders.give(b, later.slot)
        assert r.renders.kept == 1 and r.arena.free == 5

    asyncio.run(asyncio.wait_for(run(), 10))


# ---- real servers -----------------------------------------------------------------------------


class Servers:
    def __init__(self, cluster):
        self.cluster = cluster
        self.target = ",".join(cluster.address(i) for i in (0, 1))
        self.small = cluster.address(2)

    def counts(self, servers=(0, 1)) -> dict[str, float]:
        """Rendered, joined and served samples, summed over ``servers``."""
        totals = {"rendered": 0.0, "joined": 0.0, "served": 0.0}
        for i in servers:
            m = self.cluster.metrics(i)
            totals["rendered"] += m["remoteloader_images_rendered_total"]
            totals["joined"] += m["remoteloader_images_joined_total"]
            totals["served"] += m["remoteloader_images_served_total"]
        return totals

    def counted_since(self, before: dict[str, float], expected: dict[str, float], servers=(0, 1)) -> dict[str, float]:
        """The counts once those named in ``expected`` have gone up by as much since ``before``;
        fails the test with both values if they do not within a bound.

        A chunk is counted once its write has completed, which the server may learn after the
        client has the chunk; a client that closes its stream meanwhile ends that write
        uncounted. So call this while the loaders are still open."""
        last: dict[str, float] = {}

        def grown() -> dict[str, float]:
            last.update(self.counts(servers))
            return {k: last[k] - before[k] for k in expected}

        wait_until_equal(grown, expected, f"counts of servers {servers} since {before}")
        return dict(last)


@pytest.fixture(scope="module")
def servers(module_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("sharing")
    a = make_imagefolder(root / "a", ["cat", "dog"], PER_CLASS, size=(48, 64), seed=31)
    b = make_imagefolder(root / "b", ["eel", "fox"], PER_CLASS, size=(48, 64), seed=32)
    c = module_cluster
    c.add(a, "--slots", "48", "--metrics-port", ANY_PORT, wait=False)
    c.add(b, "--slots", "48", "--metrics-port", ANY_PORT, wait=False)
    small = make_imagefolder(root / "c", ["gnu", "hen"], 30, size=(48, 64), seed=34)
    c.add(small, "--slots", "4", "--metrics-port", ANY_PORT, wait=False)
    for i in range(3):
        c.wait_ready(i)
    return Servers(c)


def loader(address: str, **options) -> RemoteLoader:
    settings = dict(batch_size=BATCH, image_size=SIZE, seed=7, return_ids=True, connect_timeout=30)
    return RemoteLoader(address, **{**settings, **options})


def play(loader: RemoteLoader, epochs=(0,), pause: float = 0.0) -> list[tuple]:
    """(epoch, images, ids) per batch, over ``epochs``."""
    out = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        for images, _, ids in loader:
            out.append((epoch, images.clone(), ids.clone()))
            time.sleep(pause)
    return out


def together(*jobs) -> list:
    """Runs each ``job()`` in a thread of its own, at once; their results, in order."""
    results: list = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(i, job):
        try:
            results[i] = job()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert not errors, errors
    return results


def assert_each_sample_once(batches: list[tuple], total: int, epochs=(0,)) -> None:
    for epoch in epochs:
        ids = torch.cat([ids for e, _, ids in batches if e == epoch]).tolist()
        assert sorted(ids) == list(range(total)), f"epoch {epoch}: not every sample exactly once"


def assert_same_batches(first: list[tuple], second: list[tuple]) -> None:
    assert len(first) == len(second)
    for (e1, images1, ids1), (e2, images2, ids2) in zip(first, second):
        assert e1 == e2 and torch.equal(ids1, ids2) and torch.equal(images1, images2)


def test_jobs_with_one_plan_get_the_same_batches_each_sample_once_each_decoded_once(servers):
    before = servers.counts()
    loaders = [loader(servers.target, job=f"seed-sweep-{i}") for i in range(3)]
    try:
        results = together(*[lambda lo=lo: play(lo, epochs=(0, 1)) for lo in loaders])
        shared = [lo.stats()["images_shared"] for lo in loaders]
        total = 2 * 2 * PER_CLASS
        # Each sample of each epoch decoded once; the other two jobs joined it.
        servers.counted_since(before, {"served": 3 * 2 * total, "rendered": 2 * total, "joined": 2 * 2 * total})
    finally:
        for lo in loaders:
            lo.close()
    for batches in results:
        assert_each_sample_once(batches, total, epochs=(0, 1))
        assert_same_batches(results[0], batches)
    assert sum(shared) == 2 * 2 * total
    served = servers.cluster.metrics(0)
    assert served['remoteloader_job_images_served_total{job="seed-sweep-1"}'] >= 2 * PER_CLASS * 2


def test_jobs_that_differ_in_seed_pipeline_or_say_share_false_never_share(servers):
    before = servers.counts()
    loaders = [
        loader(servers.target, seed=101),
        loader(servers.target, seed=102),
        loader(servers.target, seed=101, pipeline="eval"),
        loader(servers.target, seed=101, share=False),
    ]
    try:
        results = together(*[lambda lo=lo: play(lo) for lo in loaders])
        assert [lo.stats()["images_shared"] for lo in loaders] == [0, 0, 0, 0]
        total = 2 * 2 * PER_CLASS
        servers.counted_since(before, {"served": 4 * total, "joined": 0, "rendered": 4 * total})
    finally:
        for lo in loaders:
            lo.close()
    for batches in results:
        assert_each_sample_once(batches, total)
    assert_same_batches(results[0], results[3])  # share=False: the same batches, decoded apart


def test_a_late_job_joins_what_is_kept_and_renders_what_is_not(servers):
    everyone = (0, 1, 2)
    for address, total, kept in ((servers.target, 4 * PER_CLASS, True), (servers.small, 60, False)):
        start = servers.counts(everyone)
        with loader(address, seed=55, batch_size=4) as first:
            alone = play(first)
            before = servers.counted_since(start, {"served": total}, everyone)
        with loader(address, seed=55, batch_size=4) as late:
            again = play(late)
            shared = late.stats()["images_shared"]
            after = servers.counted_since(before, {"served": total}, everyone)
        assert_each_sample_once(again, total)
        assert_same_batches(alone, again)
        rendered = after["rendered"] - before["rendered"]
        if kept:  # the whole epoch was kept: nothing decoded again
            assert (rendered, shared) == (0, total)
        else:  # 4 slots keep 4 of its 15 chunks at most: the rest is decoded for it alone
            assert rendered >= total - 4 * 4 and shared <= 4 * 4


def test_a_slow_job_and_a_fast_one_each_get_every_sample_once(servers):
    fast, slow = loader(servers.target, seed=66), loader(servers.target, seed=66, prefetch=2)
    try:
        quick, patient = together(lambda: play(fast, epochs=(0, 1)), lambda: play(slow, epochs=(0, 1), pause=0.15))
    finally:
        fast.close()
        slow.close()
    total = 2 * 2 * PER_CLASS
    assert_each_sample_once(quick, total, epochs=(0, 1))
    assert_each_sample_once(patient, total, epochs=(0, 1))
    assert_same_batches(quick, patient)


_KILLED_JOB = textwrap.dedent("""
    import sys
    from remoteloader.client import RemoteLoader
    with RemoteLoader(sys.argv[1], batch_size=8, image_size=32, seed=77, prefetch=2) as loader:
        for batch in loader:
            print("batch", flush=True)
            sys.stdin.readline()  # held here until killed
""")


def test_a_job_killed_mid_epoch_does_not_hold_back_the_one_sharing_with_it(servers):
    victim = subprocess.Popen(
        [sys.executable, "-c", _KILLED_JOB, servers.target], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert victim.stdout.readline().strip() == "batch"
        with loader(servers.target, seed=77, progress_timeout=20) as survivor:
            survivor.set_epoch(0)
            batches = []
            for n, (images, _, ids) in enumerate(survivor):
                batches.append((0, images, ids))
                if n == 1:
                    os.kill(victim.pid, signal.SIGKILL)
            shared = survivor.stats()["images_shared"]
    finally:
        victim.kill()
        victim.wait(10)
    assert_each_sample_once(batches, 2 * 2 * PER_CLASS)
    assert shared > 0  # it did share with the job that died (what that one had decoded, at least)


def test_a_bad_job_name_is_refused_by_the_loader_and_by_the_server(servers):
    with pytest.raises(ValueError, match="job='a b'"):
        loader(servers.target, job="a b")
    channel = grpc.insecure_channel(servers.cluster.address(0))
    stream = channel.stream_stream(
        f"/{SERVICE}/Stream",
        request_serializer=loader_pb2.StreamRequest.SerializeToString,
        response_deserializer=loader_pb2.Chunk.FromString,
    )
    setup = loader_pb2.StreamRequest(setup=loader_pb2.Setup(pipeline="eval", height=SIZE, width=SIZE, job="x" * 65))
    with pytest.raises(grpc.RpcError) as error:
        list(stream(iter([setup]), timeout=20))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Setup.job" in error.value.details()
    channel.close()


def test_a_killed_server_fails_over_for_every_job_that_shares(cluster, tmp_path):
    data = make_imagefolder(tmp_path / "c", ["ant", "bee"], 30, size=(48, 64), seed=33)
    cluster.add_many([data, data], "--max-rate", "150")  # replicas of one shard, slow enough to kill mid-epoch
    target = cluster.target
    killed = threading.Event()

    def job():
        with loader(target, seed=88, batch_size=4, reconnect_timeout=5) as lo:
            lo.set_epoch(0)
            out = []
            for n, (images, _, ids) in enumerate(lo):
                out.append((0, images, ids))
                if n == 1 and not killed.is_set():
                    killed.set()
                    cluster.kill(0)
            return out

    first, second = together(job, job)
    assert killed.is_set()
    assert_each_sample_once(first, 60)
    assert_each_sample_once(second, 60)
    assert_same_batches(first, second)
