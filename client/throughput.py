"""What the training loop's side of a RemoteLoader saw: batches, images, bytes and time waited.

``Throughput`` counts what was delivered and how long the loop waited for each batch; each
epoch played to its end becomes one entry of ``stats()["epochs"]`` and one line of the log,
with its likely limit (``bottleneck.py``, from the servers' and the receiver's busy shares over
the epoch), and a warning, once, when a training loop waited for data more than
``WAIT_WARNING`` of an epoch, saying what would help.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from remoteloader.client import bottleneck

log = logging.getLogger("remoteloader.client")

T = TypeVar("T")

# Above this share of an epoch spent waiting for data, a warning (once), for a pass that trains:
# one of at least WARN_AFTER_S, not an eval pipeline's, whose loop spent at least LOOP_WORK_S per
# batch on its own work (a loop that only reads batches waits by design).
WAIT_WARNING = 0.2
WARN_AFTER_S = 10.0
LOOP_WORK_S = 0.002
EPOCHS_KEPT = 100  # epochs stats() reports


@dataclass
class EpochSpan:
    """Where a pass started: the clock, the counters, and the servers' and receiver's readings."""

    epoch: int
    began: float
    waited: float
    images: int
    servers: Mapping[str, Mapping[str, Any]]
    receiver_cpu: float


@dataclass
class Throughput:
    """The training loop's side of one loader (see the module's docstring).

    Args:
        batch_size: The loader's, to tell the loop's own work per batch.
        pipeline: The loader's pipeline name ("...eval" passes are not warned of).
    """

    batch_size: int
    pipeline: str
    batches: int = 0
    images: int = 0
    bytes: int = 0
    wait_s: float = 0.0
    start: float | None = None  # when the first batch was asked for
    epochs: collections.deque[dict] = field(default_factory=lambda: collections.deque(maxlen=EPOCHS_KEPT))
    warned: bool = False  # of waiting for data

    def wait_for(self, get: Callable[[], T]) -> T:
        """``get()``, its time counted as the loop waiting for data."""
        asked = time.perf_counter()
        if self.start is None:
            self.start = asked
        try:
            return get()
        finally:
            self.wait_s += time.perf_counter() - asked

    def delivered(self, images: int, nbytes: int) -> None:
        self.batches += 1
        self.images += images
        self.bytes += nbytes

    def span(self, epoch: int, servers: Mapping[str, Mapping[str, Any]], receiver_cpu: float) -> EpochSpan:
        """A pass of ``epoch`` starts now (``servers``: their counters; the receiver's CPU seconds)."""
        return EpochSpan(epoch, time.perf_counter(), self.wait_s, self.images, servers, receiver_cpu)

    def epoch_done(self, span: EpochSpan, servers: Mapping[str, Mapping[str, Any]], receiver_cpu: float) -> None:
        """The epoch of ``span`` played to its end (``servers`` and ``receiver_cpu``: as now): its
        entry in ``epochs``, its log line, and the warning when the loop waited for data."""
        seconds = time.perf_counter() - span.began
        waited, images = self.wait_s - span.waited, self.images - span.images
        per_server = bottleneck.spans(span.servers, servers)
        receiver_busy = (receiver_cpu - span.receiver_cpu) / seconds if seconds else 0.0
        share = waited / seconds if seconds else 0.0
        rate = images / seconds if seconds else 0.0
        limit = bottleneck.likely_limit(per_server, receiver_busy, share, seconds)
        self.epochs.append(
            {
                "epoch": span.epoch,
                "images": images,
                "seconds": seconds,
                "images_per_s": rate,
                "wait_fraction": share,
                "limit": limit,
                "workers_busy": {a: round(s.workers_busy, 3) for a, s in per_server.items()},
                "receiver_busy": receiver_busy,
            }
        )
        log.info(
            "epoch %d: %d images in %.1fs (%.0f images/s); the loop waited for data %.0f%% of it; likely limit: %s",
            span.epoch,
            images,
            seconds,
            rate,
            100 * share,
            limit,
        )
        batches = max(1, math.ceil(images / self.batch_size))
        trains = (
            seconds >= WARN_AFTER_S
            and not self.pipeline.endswith("eval")
            and (seconds - waited) / batches >= LOOP_WORK_S
        )
        if share > WAIT_WARNING and trains and not self.warned:
            self.warned = True
            log.warning(
                "epoch %d: the training loop waited for data %.0f%% of the time (%.0f images/s): its input is "
                "the limit; likely: %s. %s; stats()['epochs'] and ['servers'] show each epoch and each server, "
                "and `remoteloader bench` measures what more servers would give",
                span.epoch,
                100 * share,
                rate,
                limit,
                bottleneck.REMEDY[limit],
                extra={"remoteloader_waited": share},  # (for a filter: `remoteloader bench` waits by design)
            )

    def stats(self, servers: dict, receiver_cpu: float) -> dict:
        """``RemoteLoader.stats()``: rates since the first batch was asked for, and the epochs."""
        elapsed = (time.perf_counter() - self.start) if self.start else 0.0
        return {
            "batches": self.batches,
            "images": self.images,
            "bytes": self.bytes,
            "elapsed_s": elapsed,
            "images_per_s": self.images / elapsed if elapsed else 0.0,
            "bytes_per_s": self.bytes / elapsed if elapsed else 0.0,
            "wait_s": self.wait_s,
            "wait_fraction": self.wait_s / elapsed if elapsed else 0.0,
            "epochs": list(self.epochs),
            "receiver_cpu_s": receiver_cpu,
            # Samples received whose decode a server shared with another loader (RemoteLoader's share).
            "images_shared": sum(server.get("shared_samples", 0) for server in servers.values()),
            "servers": servers,
        }
