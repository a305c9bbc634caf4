"""What the server's gRPC health service (grpc.health.v1) says: the one place that decides it.

Two names are answered: the Loader service (``remoteloader.v1.Loader``), which readiness
probes and ``remoteloader probe`` ask, and the server as a whole (``""``), which liveness
probes ask:

* both SERVING once the server has started;
* the Loader service NOT_SERVING while a decode worker has held work without answering for
  a third of ``--worker-timeout`` (the pool replaces that worker at the whole of it, and
  health comes back once no worker is silent), or while no decode worker runs;
* the whole server NOT_SERVING while no decode worker runs (nothing it does will serve);
* both NOT_SERVING from the start of a drain on.

``Health`` looks at the pool every second and sets only what changed, with a log line. On
``--health-port`` it also serves the health service alone, in plaintext and without a token,
for probes that speak neither (Kubernetes' grpc probes, Docker's HEALTHCHECK): it says no
more than SERVING or NOT_SERVING, and the Loader service is never reachable there.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from remoteloader.protos import SERVICE
from remoteloader.server.config import CANNOT_BIND, bracketed, check_port_free

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WATCH_INTERVAL = 1.0  # seconds between looks at the pool


class Workers(Protocol):
    """What health needs of the decode workers (``WorkerPool``)."""

    worker_timeout: float

    @property
    def workers(self) -> int: ...

    def silent_for(self) -> float: ...


class Health:
    """A server's health statuses, set from its decode workers' state.

    Args:
        servicer: The health service registered on the server (and on the health port).
        workers: The decode worker pool it watches.
    """

    def __init__(self, servicer: health.aio.HealthServicer, workers: Workers):
        self.servicer = servicer
        self._workers = workers
        self._statuses: dict[str, int] = {}
        self._watcher: asyncio.Task | None = None
        self._port_server: grpc.aio.Server | None = None
        self._draining = False

    def statuses(self) -> dict[str, int]:
        """What each name should say now: {SERVICE: status, "": status}."""
        silent, workers = self._workers.silent_for(), self._workers.workers
        ready = workers > 0 and silent <= self._workers.worker_timeout / 3
        return {SERVICE: SERVING if ready else NOT_SERVING, "": SERVING if workers > 0 else NOT_SERVING}

    async def start(self) -> None:
        """Says SERVING (or what the workers allow) and starts watching them."""
        await self._update()
        self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            await self._update()

    async def _update(self) -> None:
        if self._draining:
            return
        for name, status in self.statuses().items():
            if self._statuses.get(name) == status:
                continue
            if name in self._statuses or status != SERVING:
                log.log(
                    logging.INFO if status == SERVING else logging.WARNING,
                    "health of %s: %s (%d decode worker(s), the longest silent on its work for %.0fs)",
                    name or "the server",
                    health_pb2.HealthCheckResponse.ServingStatus.Name(status),
                    self._workers.workers,
                    self._workers.silent_for(),
                )
            self._statuses[name] = status
            await self.servicer.set(name, status)

    async def serve_port(self, host: str, port: int) -> int:
        """Serves the health service alone on ``host:port`` (plaintext, no token); returns the port."""
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        address = f"{bracketed(host)}:{port}"
        check_port_free(host, port, "--health-port")
        try:
            bound = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"{CANNOT_BIND} the health port {address}: {exc} (choose another --health-port)") from None
        await server.start()
        self._port_server = server
        return bound

    async def drain(self) -> None:
        """NOT_SERVING from now on (the drain's first step)."""
        self._draining = True
        if self._watcher is not None:
            self._watcher.cancel()
        await self.servicer.enter_graceful_shutdown()

    async def close(self) -> None:
        """Stops the health port (after the drain: probes see NOT_SERVING until the end)."""
        if self._watcher is not None:
            self._watcher.cancel()
        if self._port_server is not None:
            await self._port_server.stop(None)
            self._port_server = None
