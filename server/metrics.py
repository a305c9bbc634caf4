"""Prometheus metrics (``--metrics-port``), in the conventional names and units."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


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
        self.refused = Counter("remoteloader_refused_streams", "Streams refused over a limit", registry=r)

    def serve(self, port: int, host: str) -> int:
        """Exposes /metrics over HTTP; returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
