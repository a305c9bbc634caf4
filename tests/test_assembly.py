"""client/assembly.py without servers: an Order and an EpochRun change only through their own
methods (the engine calls them): what arrives, hedging and requeueing an order, and a pass's
batches handed out in turn, taken, cancelled with their buffers given back."""

from __future__ import annotations

import queue

import numpy as np

from remoteloader.client import plan as plan_module
from remoteloader.client.assembly import EpochRun, Order
from remoteloader.client.batches import END, Batch
from remoteloader.client.epoch import Pass


def batch(seq: int, n: int) -> Batch:
    images = np.zeros((n, 2, 2, 3), np.uint8)
    return Batch(seq, np.arange(n), images, images, np.zeros(n, np.int64), n)


def order(n: int = 8, order_id: int = 1) -> Order:
    rows = np.arange(n)
    return Order(order_id, batch(0, n), ("a", "b"), rows, np.zeros(n, np.int64), rows + 100, 0)


def test_an_order_counts_what_arrives_and_completes_once_all_has():
    o = order(8)
    assert not o.arrived(3) and not o.arrived(4) and o.arrived(1)
    o.cancel()
    assert o.cancelled


def test_a_hedged_order_keeps_what_arrived_and_its_twin_asks_for_the_rest():
    o = order(8)
    o.arrived(3)
    twin = o.hedge(order_id=2)
    assert o.credited == 3 and o.twin is twin and twin.twin is o
    assert twin.order_id == 2 and twin.local.tolist() == o.local[3:].tolist() and twin.batch is o.batch
    twin.unhedge()
    assert twin.twin is None and o.twin is twin  # (the engine unhedges the one left alone)


def test_a_requeued_order_forgets_what_its_batch_already_holds():
    o = order(8)
    o.arrived(5)
    o.hedge(order_id=2)
    o.requeue()  # its server failed and its twin is gone too
    assert o.twin is None and o.credited == 0 and o.local.tolist() == list(range(105, 108))
    plain = order(4)
    plain.requeue()  # never hedged: sent again whole
    assert plain.samples == 4


def planned(batches: int, start: int = 0, done: frozenset[int] = frozenset()) -> Pass:
    plan = plan_module.make_plan(batches * 2, 2, shuffle=False, seed=0, epoch=0, rank=0, world_size=1,
                                 drop_last=False)
    return Pass(0, plan, start, done, token=5)


def test_a_run_plays_its_pass_from_its_start_less_what_was_done_in_plan_order():
    out: queue.Queue = queue.Queue()
    run = EpochRun(planned(5, start=1, done=frozenset({3})), out)
    assert run.expected == 3 and run.epoch == 0 and run.played.token == 5
    seqs = []
    while (seq := run.next_batch(in_flight=2)) is not None:
        run.dispatched_batch(batch(seq, 2))
        seqs.append(seq)
    assert seqs == [1, 2]  # two ahead of the consumer, then it waits
    run.took_one()
    assert run.next_batch(in_flight=2) == 4  # 3 was delivered before the resume


def test_a_cancelled_run_gives_back_what_it_held_and_what_the_consumer_never_took():
    out: queue.Queue = queue.Queue()
    run = EpochRun(planned(3), out)
    held = [batch(s, 2) for s in range(2)]
    for b in held:
        run.dispatched_batch(b)
    rows = np.arange(2)
    run.credit(Order(1, held[0], ("a",), rows, rows, rows, 0), 2)  # complete: handed out, never taken
    assert out.qsize() == 1 and list(run.open) == [1]
    freed = run.cancel(drain=True)
    assert {id(b) for b in freed} == {id(b) for b in held} and run.cancelled and out.empty()
    error = RuntimeError("failed")
    run.failed(error)
    assert out.get_nowait() is error


def test_an_empty_pass_ends_at_once():
    out: queue.Queue = queue.Queue()
    EpochRun(planned(2, start=2), out)
    assert out.get_nowait() is END
