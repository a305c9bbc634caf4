"""Prometheus metrics (``--metrics-port``), in the conventional names and units."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

MAX_JOB_LABELS = 64  # job names with series of their own


class Metrics:
    """The server's counters; a private registry so tests can run several servers in one process."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.images = Counter("remoteloader_images_served", "Samples sent to clients (decoded or failed)", registry=r)
        self.bytes = Counter("remoteloader_bytes_served", "Pixel bytes sent to clients", unit="bytes", registry=r)
        self.decode_errors = Counter(
            "remoteloader_decode_errors", "Samples that could not be decoded or augmented", registry=r
        )
        self.orders = Counter("remoteloader_orders", "Orders completed", registry=r)
        self.order_latency = Histogram(
            "remoteloader_order_duration",
            "Time from receiving an order to sending its last chunk",
            unit="seconds",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.queue_depth = Gauge(
            "remoteloader_queue_depth", "Decode tasks waiting for or in the workers (read when scraped)", registry=r
        )
        self.active_streams = Gauge("remoteloader_active_streams", "Open order streams", registry=r)
        # What an autoscaler reads (docs/deploy.md, "Autoscaling"); images/s is
        # rate(remoteloader_images_served_total[1m]).
        self.worker_busy_seconds = FunctionCounter(
            "remoteloader_worker_busy",
            "Decode worker-seconds spent holding a task (its rate over remoteloader_workers: the busy ratio)",
            unit="seconds",
            registry=r,
        )
        self.workers_busy = Gauge(
            "remoteloader_workers_busy_ratio",
            "Share of the decode workers that held a task, time-weighted over the last 5 s (read when scraped)",
            registry=r,
        )
        self.workers = Gauge("remoteloader_workers", "Decode worker processes running (read when scraped)", registry=r)
        self.queued_orders = Gauge(
            "remoteloader_queued_orders",
            "Orders received and not finished, over all streams: waiting for a slot, rendering or being sent",
            registry=r,
        )
        # Concurrent jobs (server/sharing.py, server/fair_queue.py): what sharing saved, what each job got.
        self.images_rendered = Counter(
            "remoteloader_images_rendered",
            "Samples the decode workers rendered (a rendering several streams share counts once)",
            registry=r,
        )
        self.images_joined = Counter(
            "remoteloader_images_joined",
            "Samples sent from a rendering another stream started: decodes saved by sharing",
            registry=r,
        )
        self.job_images = Counter(
            "remoteloader_job_images_served", "Samples sent, by job (RemoteLoader(job=...))", ["job"], registry=r
        )
        self.job_rendered = Counter(
            "remoteloader_job_images_rendered",
            "Samples rendered, by the job whose stream started the rendering: its share of the decode",
            ["job"],
            registry=r,
        )
        self._jobs: set[str] = set()
        self.refused = Counter("remoteloader_refused_streams", "Streams refused over a limit", registry=r)
        # Object stores (server/object_cache.py), read when scraped.
        self.store_bytes = FunctionCounter(
            "remoteloader_store_fetched", "Bytes fetched from object stores", unit="bytes", registry=r
        )
        self.store_requests = FunctionCounter(
            "remoteloader_store_requests", "Ranged GETs to object stores that answered", registry=r
        )
        self.store_failures = FunctionCounter(
            "remoteloader_store_failed_samples",
            "Samples whose bytes could not be fetched from an object store",
            registry=r,
        )
        self.disk_cache_bytes = Gauge(
            "remoteloader_disk_cache_bytes", "Bytes fetched from object stores kept in --cache-dir", registry=r
        )

    def job_label(self, name: str) -> str:
        """The ``job`` label of a job's samples: its name, "(none)" for streams that name none, and
        "(other)" once MAX_JOB_LABELS names are in use (clients choose names: the series stay few)."""
        if not name:
            return "(none)"
        if name not in self._jobs and len(self._jobs) >= MAX_JOB_LABELS:
            return "(other)"
        self._jobs.add(name)
        return name

    def serve(self, port: int, host: str) -> int:
        """Exposes /metrics over HTTP; returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port


class FunctionCounter(Collector):
    """A counter read from a function when scraped (what ``Gauge.set_function`` is for gauges).

    The function must never go down (a counter's rate is taken by Prometheus)."""

    def __init__(self, name: str, documentation: str, unit: str = "", registry: CollectorRegistry | None = None):
        self._family = (name, documentation, unit)
        self._read: Callable[[], float] = lambda: 0.0
        if registry is not None:
            registry.register(self)

    def set_function(self, read: Callable[[], float]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        name, documentation, unit = self._family
        yield CounterMetricFamily(name, documentation, value=self._read(), unit=unit)
