"""The jobs of the open streams and what each weighs now: the one registry that the slots (each
stream's fair share of the chunk slots, server.slots) and the decode queue (each job's turns at
the workers, server.fair_queue) read.

A job the operator weighed (``--job-weights``, parsed by ServerConfig) weighs that, however many
streams it has open; one not weighed weighs 1 for each stream it has open (at least 1), so that
with no weights given every stream counts the same, named or not. A stream that names no job is
a job of its own ("#n", named by the service).
"""

from __future__ import annotations

from collections.abc import Mapping


class Jobs:
    """The registry: ``open`` and ``close`` as streams come and go (server.slots does), ``weight``
    for whoever shares by job.

    Args:
        weights: The operator's weights by job name (``ServerConfig.job_weights``).
    """

    def __init__(self, weights: Mapping[str, float] | None = None):
        self._weighed = dict(weights or {})
        self._streams: dict[str, int] = {}  # open jobs -> their open streams

    def open(self, job: str) -> None:
        """A stream of ``job`` opens."""
        self._streams[job] = self._streams.get(job, 0) + 1

    def close(self, job: str) -> None:
        """A stream of ``job`` has ended."""
        streams = self._streams[job]
        if streams > 1:
            self._streams[job] = streams - 1
        else:
            del self._streams[job]

    def weighed(self, job: str) -> float | None:
        """The operator's weight of ``job``, or None where it gave none."""
        return self._weighed.get(job)

    def streams(self, job: str) -> int:
        """The streams ``job`` has open."""
        return self._streams.get(job, 0)

    def weight(self, job: str) -> float:
        """What ``job`` weighs now (see above)."""
        weighed = self._weighed.get(job)
        return weighed if weighed is not None else float(max(1, self._streams.get(job, 0)))

    def total(self) -> float:
        """The weights of the open jobs, summed."""
        return sum(self.weight(job) for job in self._streams)
