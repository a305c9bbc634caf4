"""The engine's scheduling, with fake links: no server, no network, no threads.

``FakeLink`` stands for ``client/link.py``'s Link with what the engine reads and calls (its
state, credits, measured rate, orders in flight) and records the orders it is sent; a test
answers them with chunks (``answer``), fails the link, or sets rates, and checks where the
engine sent what: orders split by shard and order size, work shared by rate, a slow
replica's orders split to its deadline, hedging of a late order, failover, a stranded epoch.
The chunks' checks and placement have their own tests below.
"""

from __future__ import annotations

import asyncio
import queue

import numpy as np
import pytest

from remoteloader.client import chunks
from remoteloader.client.assembly import Order
from remoteloader.client.batches import END, Batch, LoaderError
from remoteloader.client.engine import Engine
from remoteloader.client.epoch import Pass
from remoteloader.client.link import Arrival, LinkState
from remoteloader.client.option_groups import FlowOptions
from remoteloader.client.plan import EpochPlan
from remoteloader.client.sample_space import SampleSpace
from remoteloader.protos import loader_pb2, wire

H = W = 2
SAMPLE = H * W * 3


class FakeLink:
    """A server's link as the engine sees it; ``sent`` keeps every order it was given."""

    def __init__(self, address: str, rate: float = 0.0, max_inflight: int = 4, max_order_samples: int = 1000):
        self.address = address
        self.state = LinkState.UP
        self.rate = rate
        self.max_inflight = max_inflight
        self.describe = loader_pb2.DescribeResponse(max_order_samples=max_order_samples, cancels=True)
        self.outstanding = 0
        self.gave_up = ""
        self.last_error = ""
        self.sent: list[Order] = []
        self.cancelled: list[int] = []
        self._inflight: dict[int, Order] = {}
        self.engine: Engine | None = None

    # the Link surface the engine uses
    @property
    def credits(self) -> int:
        return self.max_inflight - len(self._inflight) if self.state is LinkState.UP else 0

    @property
    def hopeful(self) -> bool:
        return self.state in (LinkState.UP, LinkState.DOWN)

    async def open_stream(self, setup: loader_pb2.Setup) -> None:
        self.state = LinkState.UP

    def revive(self) -> None:
        pass

    def order(self, order_id: int) -> Order | None:
        return self._inflight.get(order_id)

    def orders(self) -> list[Order]:
        return list(self._inflight.values())

    def send(self, order: Order, request: loader_pb2.Order) -> None:
        assert request.order_id == order.order_id and list(request.indices) == order.local.tolist()
        self._inflight[order.order_id] = order
        self.outstanding += order.samples
        self.sent.append(order)

    def cancel(self, order: Order) -> None:
        if self._inflight.pop(order.order_id, None) is not None:
            self.outstanding -= order.samples
            self.cancelled.append(order.order_id)

    def complete(self, order: Order) -> None:
        del self._inflight[order.order_id]
        self.outstanding -= order.samples

    def check_progress(self, timeout: float) -> None:
        pass

    def retry_left(self) -> float:
        return 30.0

    def fail(self, exc: BaseException) -> None:
        """As Link.fail: DOWN, and its unfinished orders go back to the engine."""
        if self.state is not LinkState.UP:
            return
        self.state = LinkState.DOWN
        self.last_error = str(exc)
        orders = [o for o in self._inflight.values() if not o.cancelled]
        self._inflight.clear()
        self.outstanding = 0
        assert self.engine is not None
        self.engine.on_link_down(self, orders, exc)  # type: ignore[arg-type]

    # the test's side
    def answer(self, order: Order, count: int | None = None, errors: dict[int, str] | None = None) -> None:
        """The server sends ``count`` (default: the rest) of ``order``'s samples: pixels all equal
        to each sample's shard-local index (mod 256), labels the index mod 10."""
        assert self.engine is not None
        start = order.received
        count = order.samples - start if count is None else count
        local = order.local[start : start + count]
        header = loader_pb2.ChunkHeader(
            order_id=order.order_id, start=start, count=count, order_size=order.samples,
            height=H, width=W, channels=3, labels=(local % 10).tolist(),
            errors=[loader_pb2.SampleError(position=p, key=f"k{p}", reason=r) for p, r in (errors or {}).items()],
        )
        payload = np.repeat((local % 256).astype(np.uint8), SAMPLE).tobytes()
        self.arrive(header, payload)

    def arrive(self, header: loader_pb2.ChunkHeader, payload: bytes) -> None:
        """As Link._resolve: a chunk of an order cancelled here is dropped; others reach the engine."""
        assert self.engine is not None
        order = self._inflight.get(header.order_id)
        if order is None and header.order_id in self.cancelled:
            return
        self.engine.on_chunk(self, Arrival(header, memoryview(payload), order))  # type: ignore[arg-type]

    def answer_all(self) -> None:
        for order in self.orders():
            self.answer(order)


class Buffers:
    """Host buffers without a limit (or ``most`` at a time), as BatchBuffers."""

    def __init__(self, most: int = 1000):
        self.most, self.lent = most, 0

    def allocate(self, n: int, h: int, w: int) -> np.ndarray | None:
        if self.lent >= self.most:
            return None
        self.lent += 1
        return np.zeros((n, h, w, 3), np.uint8)

    def masks_for(self, images: np.ndarray, n: int, h: int, w: int) -> np.ndarray:
        return np.zeros((n, h, w), np.uint8)

    def release(self, images: np.ndarray) -> None:
        self.lent -= 1

    def listen(self, freed) -> None:
        pass


def space(shards: dict[str, tuple[int, list[str]]]) -> SampleSpace:
    """A sample space: shard id -> (samples, the addresses that hold it)."""
    describes: dict[str, loader_pb2.DescribeResponse] = {}
    for shard_id, (samples, owners) in shards.items():
        for address in owners:
            if address not in describes:
                describes[address] = loader_pb2.DescribeResponse()
                describes[address].class_lists.add(names=[str(i) for i in range(10)])
            describes[address].shards.add(id=shard_id, name=shard_id, num_samples=samples, class_list=1)
    return SampleSpace(describes)


def engine_of(links: list[FakeLink], *, prefetch: int = 8, ordered: bool = True, buffers: Buffers | None = None,
              setup: loader_pb2.Setup | None = None) -> Engine:
    setup = setup or loader_pb2.Setup(height=H, width=W)
    flow = FlowOptions(prefetch=prefetch, ordered=ordered, progress_timeout=60.0)
    engine = Engine({link.address: link for link in links}, setup, flow, buffers or Buffers(), seed=1)  # type: ignore[misc]
    for link in links:
        link.engine = engine
    return engine


class Listed(list):
    """Batches given whole, as the engine takes a plan's (assembly.PlannedBatches)."""

    def size(self, k: int) -> int:
        return len(self[k])

    def samples_from(self, k: int) -> int:
        return sum(len(b) for b in self[max(0, k):])


async def start(engine: Engine, sample_space: SampleSpace, batches: list[np.ndarray], **kw) -> queue.Queue:
    plan = EpochPlan(epoch=0, num_samples=sample_space.num_samples, batch_size=1, rank=0, world_size=1,
                     drop_last=False, shuffle=False, seed=1, batches=Listed(batches))  # type: ignore[arg-type]
    played = Pass(0, plan, kw.pop("first_seq", 0), kw.pop("skip", frozenset()), token=7, space=sample_space)
    await engine.start_epoch(played)
    return engine.out


def drain(out: queue.Queue) -> list:
    items = []
    while True:
        try:
            items.append(out.get_nowait())
        except queue.Empty:
            return items


def check_exactly_once(items: list, batches: list[np.ndarray]) -> None:
    """The batches came in plan order, whole, each row's pixels and label its own sample's, then END."""
    assert items[-1] is END, items[-1]
    got = [b for b in items if isinstance(b, Batch)]
    assert [b.seq for b in got] == list(range(len(batches)))
    for batch, ids in zip(got, batches):
        assert np.array_equal(batch.ids, ids)
        assert batch.remaining == 0
        assert np.array_equal(batch.pixels[:, 0, 0, 0], ids % 256)  # (one shard: local index == global id)
        assert np.array_equal(batch.labels, ids % 10)


def run(test) -> None:
    asyncio.run(test())


# ---- dispatch --------------------------------------------------------------------------------
def test_a_batch_over_many_shards_of_one_server_is_one_order():
    async def test():
        a = FakeLink("a", max_inflight=100)
        ids = [f"s{k:03d}" for k in range(200)]
        sp = space({shard_id: (4, ["a"]) for shard_id in ids})
        engine = engine_of([a], prefetch=1)
        batch = np.random.default_rng(0).permutation(800)[:256]  # a shuffled batch touches most of the shards
        await start(engine, sp, [batch])
        (order,) = a.sent
        assert order.positions.tolist() == list(range(256))
        assert np.array_equal(sp.offsets(order.shards) + order.local, batch)
        assert len(np.unique(order.shards)) > 150
        engine.close()

    run(test)


def test_batches_are_split_by_owners_and_order_size_and_dispatched_up_to_prefetch():
    async def test():
        a = FakeLink("a", max_order_samples=3, max_inflight=100)
        b = FakeLink("b", max_order_samples=3, max_inflight=100)
        sp = space({"s0": (10, ["a"]), "s1": (10, ["a"]), "s2": (10, ["b"])})
        engine = engine_of([a, b], prefetch=2)
        batches = [np.array([0, 1, 12, 2, 13, 21]), np.array([3, 4, 5, 6, 7]), np.array([8, 9, 10, 11, 14])]
        out = await start(engine, sp, batches)
        # Two batches ahead of the consumer: batch 0 (server a: 3 + 2 samples of s0 and s1; b: 1 of s2),
        # batch 1 (a: 3 + 2).
        assert [(o.batch.seq, o.shards.tolist(), o.local.tolist()) for o in a.sent] == [
            (0, [0, 0, 1], [0, 1, 2]), (0, [0, 1], [2, 3]), (1, [0, 0, 0], [3, 4, 5]), (1, [0, 0], [6, 7])]
        assert [o.positions.tolist() for o in a.sent[:2]] == [[0, 1, 2], [3, 4]]
        assert [(o.batch.seq, o.shards.tolist(), o.local.tolist(), o.positions.tolist()) for o in b.sent] == [
            (0, [2], [1], [5])]
        a.answer_all()
        b.answer_all()
        assert [b.seq for b in drain(out)] == [0, 1]
        engine.consumed(engine.playing)  # the consumer took one: the third batch goes out
        assert [o.batch.seq for o in a.sent[4:]] == [2, 2]
        engine.close()

    run(test)


def test_dispatch_waits_for_a_free_buffer_and_goes_on_when_one_comes_back():
    async def test():
        a = FakeLink("a", max_inflight=100)
        buffers = Buffers(most=1)
        engine = engine_of([a], buffers=buffers)
        batches = [np.arange(i * 4, i * 4 + 4) for i in range(3)]
        out = await start(engine, space({"s": (12, ["a"])}), batches)
        assert [o.batch.seq for o in a.sent] == [0]
        a.answer_all()
        (first,) = drain(out)
        buffers.release(first.images)  # the consumer is done with it
        engine.buffer_freed()
        assert [o.batch.seq for o in a.sent] == [0, 1]
        engine.close()

    run(test)


def test_a_resumed_epoch_starts_at_first_seq_and_leaves_out_what_was_delivered():
    async def test():
        a = FakeLink("a", max_inflight=100)
        engine = engine_of([a], ordered=True)
        batches = [np.arange(i * 2, i * 2 + 2) for i in range(5)]
        out = await start(engine, space({"s": (10, ["a"])}), batches, first_seq=1, skip=frozenset({3}))
        assert sorted({o.batch.seq for o in a.sent}) == [1, 2, 4]
        a.answer_all()
        items = drain(out)
        assert [b.seq for b in items[:-1]] == [1, 2, 4] and items[-1] is END
        engine.close()

    run(test)


# ---- sharing by rate, deadlines, hedging ---------------------------------------------------------
def test_replicas_share_orders_by_their_measured_rates():
    async def test():
        fast, slow = FakeLink("fast", rate=2000.0, max_inflight=100), FakeLink("slow", rate=1000.0, max_inflight=100)
        engine = engine_of([fast, slow], prefetch=30, ordered=False)
        sp = space({"s": (3000, ["fast", "slow"])})
        await start(engine, sp, [np.arange(i * 100, i * 100 + 100) for i in range(30)])
        samples = {link.address: sum(o.samples for o in link.sent) for link in (fast, slow)}
        assert samples["fast"] + samples["slow"] == 3000
        assert 1.7 < samples["fast"] / samples["slow"] < 2.3, samples  # twice the rate, about twice the work
        engine.close()

    run(test)


def test_a_slow_replica_gets_only_the_part_it_can_finish_before_the_loop_wants_it():
    async def test():
        fast = FakeLink("fast", rate=10_000.0, max_inflight=1)
        slow = FakeLink("slow", rate=1000.0, max_inflight=4)
        engine = engine_of([fast, slow], prefetch=4, ordered=True)
        sp = space({"s": (2048, ["fast", "slow"])})
        batches = [np.arange(i * 512, i * 512 + 512) for i in range(4)]
        await start(engine, sp, batches)
        # The fast one holds batch 0 (its one credit); the slow one would take 0.5 s for a whole
        # batch, and the loop wants batch 1 after 512 samples at 11,000/s (47 ms): it gets a
        # split-off head it can finish in time (at least MIN_SPLIT samples), and no whole batch.
        assert [o.samples for o in fast.sent] == [512]
        assert slow.sent, "the slow replica was given nothing"
        assert all(16 <= o.samples < 512 for o in slow.sent), [o.samples for o in slow.sent]
        assert sum(o.samples for o in slow.sent) < 512
        # Every sample is still asked for exactly once, in the end.
        while fast.orders() or slow.orders():
            fast.answer_all()
            slow.answer_all()
            engine.consumed(engine.playing)
        asked = np.sort(np.concatenate([o.local for o in fast.sent + slow.sent]))
        assert np.array_equal(asked, np.arange(2048))
        engine.close()

    run(test)


def test_an_idle_server_is_sent_a_twin_of_a_late_order_and_the_first_to_finish_wins():
    async def test():
        slow = FakeLink("slow", rate=50.0, max_inflight=4)
        fast = FakeLink("fast", rate=5000.0, max_inflight=4)
        fast.state = LinkState.DOWN  # not up yet: the slow replica gets the whole batch
        engine = engine_of([slow, fast], prefetch=1)
        batches = [np.arange(64)]
        out = await start(engine, space({"s": (64, ["slow", "fast"])}), batches)
        (held,) = slow.sent
        slow.answer(held, count=16)  # a quarter arrived
        fast.state = LinkState.UP
        engine.on_link_up(fast)  # type: ignore[arg-type]
        # The fast server has nothing to do, the loop waits for the slow one's order: hedged.
        (twin,) = fast.sent
        assert twin.local.tolist() == list(range(16, 64)) and twin.twin is held and held.twin is twin
        fast.answer(twin)
        assert slow.cancelled == [held.order_id], "the loser is cancelled on its server"
        check_exactly_once(drain(out), batches)
        engine.close()

    run(test)


# ---- failures ----------------------------------------------------------------------------------
def test_a_failed_servers_orders_go_to_a_replica_and_every_sample_arrives_once():
    async def test():
        a, b = FakeLink("a", rate=1000.0), FakeLink("b", rate=1000.0)
        engine = engine_of([a, b], prefetch=4)
        batches = [np.arange(i * 8, i * 8 + 8) for i in range(4)]
        out = await start(engine, space({"s": (32, ["a", "b"])}), batches)
        assert a.sent and b.sent
        for order in a.orders():
            a.answer(order, count=3)  # part of each arrives, then the server fails
        a.fail(ConnectionError("reset"))
        assert a.orders() == [] and a.state is LinkState.DOWN
        b.answer_all()
        b.answer_all()  # (the requeued orders, sent again whole)
        check_exactly_once(drain(out), batches)
        engine.close()

    run(test)


def test_a_malformed_chunk_fails_its_server_and_the_order_is_served_elsewhere():
    async def test():
        a, b = FakeLink("a", rate=1000.0, max_inflight=1), FakeLink("b", rate=10.0, max_inflight=1)
        b.state = LinkState.DOWN
        engine = engine_of([a, b], prefetch=1)
        batches = [np.arange(8)]
        out = await start(engine, space({"s": (8, ["a", "b"])}), batches)
        (order,) = a.sent
        header = loader_pb2.ChunkHeader(order_id=order.order_id, start=0, count=8, order_size=8, height=H,
                                        width=W + 1, channels=3, labels=[0] * 8)
        a.arrive(header, bytes(8 * H * (W + 1) * 3))
        assert a.state is LinkState.DOWN and "malformed chunk from a" in a.last_error
        b.state = LinkState.UP
        engine.on_link_up(b)  # type: ignore[arg-type]
        b.answer_all()
        check_exactly_once(drain(out), batches)
        engine.close()

    run(test)


def test_work_no_live_server_can_serve_ends_the_epoch_with_an_error_naming_the_shard():
    async def test():
        a = FakeLink("a")
        engine = engine_of([a], prefetch=2)
        out = await start(engine, space({"s": (8, ["a"])}), [np.arange(4), np.arange(4, 8)])
        a.fail(ConnectionError("reset"))  # down, but still reconnecting: the work waits for it
        assert drain(out) == []
        a.state = LinkState.DEAD
        a.gave_up = "refused: bad token"
        engine.on_link_lost(a)  # type: ignore[arg-type]
        (error,) = drain(out)
        assert isinstance(error, LoaderError)
        assert "no loader server can serve shard s" in str(error) and "a: refused: bad token" in str(error)
        engine.close()

    run(test)


def test_failed_samples_reach_their_batch_only_once_the_order_completes():
    async def test():
        a = FakeLink("a")
        engine = engine_of([a], prefetch=1)
        out = await start(engine, space({"s": (4, ["a"])}), [np.arange(4)])
        (order,) = a.sent
        a.answer(order, count=2, errors={1: "truncated"})
        assert order.batch.failures == []  # not yet: the order may still fail and be sent again
        a.answer(order)
        (batch, end) = drain(out)
        assert end is END
        assert [(f.sample_id, f.key, f.reason, f.server) for f in batch.failures] == [(1, "k1", "truncated", "a")]
        engine.close()

    run(test)


# ---- chunk checks ------------------------------------------------------------------------------
class _Placed:
    def __init__(self, samples: int, received: int = 0):
        self.samples, self.received = samples, received


SHAPE = chunks.StreamShape.of(loader_pb2.Setup(height=H, width=W))


def header(**kw) -> loader_pb2.ChunkHeader:
    fields = dict(order_id=1, start=0, count=2, order_size=2, height=H, width=W, channels=3, labels=[0, 0])
    fields.update(kw)
    return loader_pb2.ChunkHeader(**fields)


@pytest.mark.parametrize(
    "changes",
    [
        {"start": 1},  # not where the order is
        {"count": 3, "labels": [0, 0, 0]},  # more than the order holds
        {"count": 0, "labels": []},
        {"height": H + 1},
        {"channels": 4},
        {"labels": [0]},
        {"payload": 2 * SAMPLE - 1},
    ],
)
def test_a_chunk_that_does_not_fit_its_order_or_stream_is_refused(changes):
    payload = changes.pop("payload", None)
    h = header(**changes)
    with pytest.raises(chunks.BadChunk, match="malformed chunk from srv"):
        chunks.check(h, payload if payload is not None else h.count * SAMPLE, _Placed(2), SHAPE, "srv")
    with pytest.raises(chunks.BadChunk):  # and a chunk of no order held
        chunks.check(header(), 2 * SAMPLE, None, SHAPE, "srv")
    assert chunks.check(header(), 2 * SAMPLE, _Placed(2), SHAPE, "srv") == chunks.Checked(None, None)


def test_encoded_parts_are_checked_before_any_is_read():
    shape = chunks.StreamShape.of(loader_pb2.Setup(height=H, width=W, wire=wire.ZSTD))
    with pytest.raises(chunks.BadChunk, match="malformed chunk from srv"):
        chunks.check(header(encoded_sizes=[SAMPLE, SAMPLE + 5]), 2 * SAMPLE, _Placed(2), shape, "srv")
    checked = chunks.check(header(encoded_sizes=[SAMPLE, 3]), SAMPLE + 3, _Placed(2), shape, "srv")
    assert checked.parts == [(0, SAMPLE), (SAMPLE, 3)]
