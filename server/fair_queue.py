"""The decode queue's order: jobs share the workers by weight (start-time fair queueing).

Every task belongs to a job (a name the operator may weigh with ``--job-weights``, or one
stream on its own; the registry, server.jobs, says what a job weighs now, when its task is
queued) and costs its samples. Each
job's tasks keep their order; among jobs, the next task is the one whose job has had the
least decode for its weight, so that jobs with work waiting get shares of the workers in
proportion to their weights (3:1 when weighed 3 and 1), and a job with nothing waiting
leaves its share to the others. Tags are virtual
time: a task starts at ``max(now, its job's last finish)`` and finishes ``cost / weight``
later; the queue's ``now`` is the start of the last task taken, so a job that was idle
comes back level with the others, never owed for the time it waited for nothing.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Generic, NamedTuple, TypeVar

from remoteloader.server.jobs import Jobs

T = TypeVar("T")


class Job(NamedTuple):
    """Whom decode work is for: a job's name (``#n`` for stream n, which names none); what it
    weighs is the registry's (server.jobs)."""

    name: str = ""


class FairQueue(Generic[T]):
    """Tasks by job, taken in weighted-fair order; each job's in the order it put them.

    Args:
        jobs: What each job weighs (default: a registry without weights, every job 1).
    """

    def __init__(self, jobs: Jobs | None = None) -> None:
        self._jobs = jobs if jobs is not None else Jobs()
        # job -> ((start tag, tie-break), task), in order: ties go to the task put first
        self._queues: dict[str, deque[tuple[tuple[float, int], T]]] = {}
        self._finish: dict[str, float] = {}  # job -> finish tag of its last task put
        self._now = 0.0
        self._puts = itertools.count()

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return bool(self._queues)

    def put(self, job: Job, cost: float, task: T) -> None:
        """Queues ``task`` for ``job``, costing ``cost`` (its samples) at the job's weight now."""
        name = job.name
        weight = self._jobs.weight(name)
        assert weight > 0, (job, weight)
        start = max(self._now, self._finish.get(name, 0.0))
        self._finish[name] = start + cost / weight
        self._queues.setdefault(name, deque()).append(((start, next(self._puts)), task))
        if len(self._finish) > 2 * len(self._queues) + 64:  # (jobs long idle are level with now: forget them)
            self._finish = {j: f for j, f in self._finish.items() if f > self._now or j in self._queues}

    def put_first(self, job: Job, task: T) -> None:
        """Queues ``task`` ahead of everything (a task given back by a worker that stalled)."""
        first = min([self._now, *(queue[0][0][0] for queue in self._queues.values())])
        self._queues.setdefault(job.name, deque()).appendleft(((first, -next(self._puts)), task))

    def take(self) -> T:
        """The next task: the first of the job whose first task starts soonest (IndexError if none)."""
        if not self._queues:
            raise IndexError("take from an empty FairQueue")
        job = min(self._queues, key=lambda j: self._queues[j][0][0])
        queue = self._queues[job]
        start, task = queue.popleft()
        if not queue:
            del self._queues[job]
        self._now = max(self._now, start[0])
        return task
