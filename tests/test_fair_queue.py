"""The decode queue's order (server/fair_queue.py): jobs share the workers by the weights the job
registry (server/jobs.py) gives them, each job's tasks in the order it put them."""

from __future__ import annotations

from remoteloader.server.fair_queue import FairQueue, Job
from remoteloader.server.jobs import Jobs


def test_jobs_with_work_waiting_share_the_queue_by_weight_each_in_its_own_order():
    queue: FairQueue[tuple[str, int]] = FairQueue(Jobs({"heavy": 3.0, "light": 1.0}))
    heavy, light = Job("heavy"), Job("light")
    for i in range(400):
        queue.put(heavy, 8, ("heavy", i))
        queue.put(light, 8, ("light", i))
    taken = [queue.take() for _ in range(400)]
    assert sum(1 for job, _ in taken if job == "heavy") == 300
    for name in ("heavy", "light"):
        order = [i for job, i in taken if job == name]
        assert order == sorted(order)


def test_a_job_that_had_nothing_waiting_is_not_owed_the_time_it_was_idle():
    queue: FairQueue[str] = FairQueue()
    for _ in range(100):  # "a" alone for a while
        queue.put(Job("a"), 8, "a")
        queue.take()
    for _ in range(50):
        queue.put(Job("a"), 8, "a")
        queue.put(Job("b"), 8, "b")
    taken = [queue.take() for _ in range(20)]
    assert taken.count("b") == 10  # level from now on, not 100 tasks of "b" first


def test_a_task_given_back_goes_first():
    queue: FairQueue[str] = FairQueue()
    for name in "abc":
        queue.put(Job(name), 8, name)
    queue.take()
    queue.put_first(Job("c"), "again")
    assert queue.take() == "again" and len(queue) == 2
    empty: FairQueue[str] = FairQueue()  # (the only task, given back by a stalled worker)
    empty.put_first(Job("a"), "alone")
    assert empty.take() == "alone" and not empty


def test_a_job_weighs_what_the_registry_says_when_its_task_is_queued():
    jobs = Jobs()  # nobody weighed: 1 a stream
    queue: FairQueue[str] = FairQueue(jobs)
    for _ in range(4):
        jobs.open("ddp")  # a job of 4 streams weighs 4 against a stream of its own
    jobs.open("#1")
    for _ in range(100):
        queue.put(Job("ddp"), 8, "ddp")
        queue.put(Job("#1"), 8, "#1")
    taken = [queue.take() for _ in range(100)]
    assert taken.count("ddp") == 80
