"""The chunk slots (server/slots.py): each stream's fair share by its job's weight in the job
registry (server/jobs.py), which the slots open and close the streams' jobs in."""

from __future__ import annotations

import asyncio

from remoteloader.server.jobs import Jobs
from remoteloader.server.shared_memory import Arena
from remoteloader.server.slots import Slots


def test_slots_are_shared_by_job_weight_and_evenly_among_a_jobs_streams():
    async def run():
        slots = Slots(Arena(12, 4096), stall_timeout=60, jobs=Jobs({"heavy": 3.0, "light": 1.0}))
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
        slots = Slots(Arena(24, 4096), stall_timeout=60)
        ranks = [slots.open("ddp-job") for _ in range(4)]  # a named job of 4 ranks
        others = [slots.open(f"#{n}") for n in range(2)]  # two streams that name no job
        assert {slots.fair_share(s) for s in ranks + others} == {4}  # 24 / 6 streams, as unnamed
        assert slots.jobs.weight(ranks[0].job) == 4.0 and slots.jobs.weight(others[0].job) == 1.0

    asyncio.run(run())
