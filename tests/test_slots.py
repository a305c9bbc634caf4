"""The chunk slots (server/slots.py): each stream's fair share by its job's weight in the job
registry (server/jobs.py), which the slots open and close the streams' jobs in."""

from __future__ import annotations

import asyncio

import pytest

from remoteloader.server.jobs import Jobs
from remoteloader.server.local_socket import Loans
from remoteloader.server.shared_memory import Arena
from remoteloader.server.sharing import SharedRenders
from remoteloader.server.slots import Slots
from remoteloader.server.stalls import CONTENDED_STALL, Stalled, Stalls


def test_slots_are_shared_by_job_weight_and_evenly_among_a_jobs_streams():
    async def run():
        slots = Slots(Arena(12, 4096), jobs=Jobs({"heavy": 3.0, "light": 1.0}))
        heavy = slots.open("heavy")
        light = slots.open("light")
        assert (slots.fair_share(heavy), slots.fair_share(light)) == (9, 3)
        second = slots.open("heavy")  # a weighed job's weight is the job's, however many streams
        assert slots.fair_share(second) == slots.fair_share(heavy) == 4
        assert slots.jobs.weight(second.job) == 3.0 and slots.jobs.streams("heavy") == 2
        slots.close(second)
        slots.close(light)
        assert slots.fair_share(heavy) == 10  # alone: all but two
        assert slots.jobs.streams("light") == 0 and slots.jobs.total() == 3.0

    asyncio.run(run())


def test_a_job_nobody_weighed_weighs_one_a_stream_named_or_not():
    async def run():
        slots = Slots(Arena(24, 4096))
        ranks = [slots.open("ddp-job") for _ in range(4)]  # a named job of 4 ranks
        others = [slots.open(f"#{n}") for n in range(2)]  # two streams that name no job
        assert {slots.fair_share(s) for s in ranks + others} == {4}  # 24 / 6 streams, as unnamed
        assert slots.jobs.weight(ranks[0].job) == 4.0 and slots.jobs.weight(others[0].job) == 1.0

    asyncio.run(run())


# ---- what a stream's client holds: loans (server/local_socket.py) and the stall rules (server/stalls.py)


def test_a_same_host_clients_loans_are_held_slots_until_released_by_ticket():
    async def run():
        slots = Slots(Arena(6, 4096))
        stream = slots.open("#1")
        loans = Loans(Stalls(slots, stall_timeout=60), SharedRenders(slots), stream)
        taken = []
        for _ in range(3):
            await slots.room(stream)
            taken.append(await slots.acquire(stream))
        tickets = [loans.lend(slot) for slot in taken]
        assert tickets == [1, 2, 3] and loans and stream.held == 3 and slots.arena.free == 3
        assert loans.give_back(2) and not loans.give_back(2) and not loans.give_back(9)
        assert stream.held == 2 and slots.arena.free == 4
        loans.check()  # (nothing kept too long)
        loans.give_all()  # the stream ends
        assert not loans and stream.held == 0 and slots.arena.free == 6

    asyncio.run(asyncio.wait_for(run(), 10))


def test_a_loan_kept_past_the_stall_timeout_ends_its_stream():
    async def run():
        slots = Slots(Arena(4, 4096))
        stream = slots.open("#1")
        loans = Loans(Stalls(slots, stall_timeout=0), SharedRenders(slots), stream)  # (0: any loan is kept too long)
        await slots.room(stream)
        loans.lend(await slots.acquire(stream))
        with pytest.raises(Stalled, match="released no shared chunk for stall_timeout=0s"):
            loans.check()

    asyncio.run(asyncio.wait_for(run(), 10))


def test_a_stream_is_stalled_sooner_only_while_another_waits_for_a_slot():
    async def run():
        slots = Slots(Arena(6, 4096))
        stalls = Stalls(slots, stall_timeout=120)
        hog = slots.open("#1")
        assert stalls.why(hog, CONTENDED_STALL + 1) is None  # nobody waits
        for _ in range(4):  # alone: all but two
            await slots.room(hog)
            await slots.acquire(hog)
        other = slots.open("#2")  # its share is 3, and 2 are free
        for _ in range(2):
            await slots.room(other)
            await slots.acquire(other)
        await slots.room(other)
        waiting = asyncio.ensure_future(slots.acquire(other))  # none free: it waits
        await asyncio.sleep(0)
        assert slots.waiters == 1 and other.waiting == 1
        assert stalls.why(hog, CONTENDED_STALL - 1) is None
        assert "while streams waited for the chunk slots it holds" in stalls.why(hog, CONTENDED_STALL + 1)
        assert stalls.why(other, CONTENDED_STALL + 1) is None  # its own wait is not another's
        assert stalls.why(other, 120) == "stall_timeout=120s"
        waiting.cancel()

    asyncio.run(asyncio.wait_for(run(), 10))


def test_a_write_the_client_never_reads_is_cancelled_and_ends_the_stream():
    async def run():
        slots = Slots(Arena(4, 4096))
        stream = slots.open("#1")
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with pytest.raises(Stalled, match="read nothing for stall_timeout=0.05s"):
            await Stalls(slots, stall_timeout=0.05).send(never, stream)
        assert never.cancelled()
        await Stalls(slots, stall_timeout=0.05).send(asyncio.sleep(0), stream)  # a write that completes

    asyncio.run(asyncio.wait_for(run(), 10))
