"""Build, run and stop a loader server: ``create_server``, ``serve`` and ``run``.

``create_server`` indexes the shards, starts the ``RenderResources`` (decode workers, shared memory,
pipeline checks) and binds the port; the ``LoaderServer`` it returns owns them and
closes them in ``stop``, after the service has drained. Nothing else closes any part of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2_grpc

from remoteloader.protos import limits, malloc
from remoteloader.protos.same_host import host_id
from remoteloader.server.catalog import Shard, SyntheticShard, media_of
from remoteloader.server.config import (
    CANNOT_BIND,
    HEALTH_ON,
    LISTENING,
    METRICS_ON,
    ServerConfig,
    bind_port,
    bracketed,
    check_port_free,
)
from remoteloader.server.decode import JPEG_MAGIC, DecodeError, _jpeg, region_decoder
from remoteloader.server.formats import FormatOptions, open_shards
from remoteloader.server.formats.keys import make_unique
from remoteloader.server.health import Health
from remoteloader.server.jobs import Jobs
from remoteloader.server.local_socket import LocalSocket
from remoteloader.server.object_cache import ObjectCache
from remoteloader.server.pipeline_checks import PipelineChecks
from remoteloader.server.read_ahead import ReadAhead
from remoteloader.server.read_ahead import available as read_ahead_available
from remoteloader.server.sample_reads import read_sample
from remoteloader.server.security import TokenInterceptor, read_token, server_credentials
from remoteloader.server.service import LoaderService
from remoteloader.server.shared_memory import Arena, SampleCache
from remoteloader.server.sources import open_source
from remoteloader.server.storage import ObjectStorage
from remoteloader.server.worker_pool import WorkerPool, start_fork_server

log = logging.getLogger("remoteloader.server")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (and the exception)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


@dataclass
class RenderResources:
    """What a server renders with, and must close when it stops: the decode workers, the shared
    memory they write into and read from, and the threads that check pipelines."""

    arena: Arena
    cache: SampleCache | None
    pool: WorkerPool
    checks: PipelineChecks
    objects: ObjectCache | None = None  # object-store samples on local disk, where shards are in a store
    read_ahead: ReadAhead | None = None  # where shards are on this machine's disk

    @classmethod
    def start(cls, config: ServerConfig, shards: list[Shard], indexed_ns: int) -> RenderResources:
        """Creates them for ``config`` (the workers start when there is data to decode)."""
        with contextlib.ExitStack() as undo:  # on failure, closes what was made
            arena = Arena(config.slots, config.slot_bytes)
            undo.callback(arena.close)
            cache = SampleCache(config.cache_bytes, sum(len(s) for s in shards)) if config.cache_bytes else None
            if cache is not None:
                undo.callback(cache.close)
            pool = WorkerPool(
                arena,
                config.workers,
                config.allow_custom_pipelines,
                config.max_pixels,
                cache,
                config.region_decode,
                indexed_ns,
                ((config.source, config.source_args),) if config.source else (),
                worker_timeout=config.worker_timeout,
                jobs=Jobs(config.job_weights),
            )
            undo.callback(pool.close)
            checks = PipelineChecks(
                config.allow_custom_pipelines,
                config.max_pixels,
                config.min_image_size,
                config.max_image_size,
                config.slot_bytes,
                media_of(shards),
            )
            undo.callback(checks.close)
            if config.synthetic:
                # Transport benchmark: fill the slots once with noise; synthetic samples are never decoded.
                np.frombuffer(arena.buffer, np.uint8, arena.slots_size)[:] = np.random.default_rng(0).integers(
                    0, 256, arena.slots_size, dtype=np.uint8
                )
            if config.data or config.source:
                pool.start()
            objects = _object_cache(config, shards)
            if objects is not None:
                undo.callback(objects.close)
            read_ahead = None
            if config.read_ahead and read_ahead_available() and any(not s.remote for s in shards):
                read_ahead = ReadAhead()
                undo.callback(read_ahead.close)
            undo.pop_all()
        return cls(arena, cache, pool, checks, objects, read_ahead)

    def close(self) -> None:
        """Stops the pipeline checks and the workers, then closes the shared memory (idempotent)."""
        self.checks.close()
        self.pool.close()
        self.arena.close()
        if self.cache is not None:
            self.cache.close()
        if self.objects is not None:
            self.objects.close()
        if self.read_ahead is not None:
            self.read_ahead.close()


def _object_cache(config: ServerConfig, shards: list[Shard]) -> ObjectCache | None:
    """The local copies of the shards that are in object stores (None: none is)."""
    stores = {s.storage.url: s.storage for s in shards if s.remote and isinstance(s.storage, ObjectStorage)}
    remote = [s for s in shards if s.remote]
    if not stores:
        return None
    total = sum(s.object.size if s.object is not None else s.nbytes for s in remote)
    fits = total <= config.disk_cache_bytes
    log.info(
        "object stores: %.1f GB of shards, %s --disk-cache-bytes (%.1f GB): %s",
        total / 1e9,
        "within" if fits else "over",
        config.disk_cache_bytes / 1e9,
        "the first epoch fetches each sample's bytes once, later ones nothing"
        if fits
        else "each sample's bytes are fetched as it is needed, and fetched again once evicted",
    )
    return ObjectCache(config.cache_dir, config.disk_cache_bytes, list(stores.values()), config.fetch_concurrency)


class LoaderServer:
    """A started loader server: the gRPC server, its service, its resources and bound address.

    It owns the render resources (workers, shared memory, pipeline checks): ``stop`` closes them once the
    service has drained.
    """

    def __init__(
        self,
        config: ServerConfig,
        grpc_server: grpc.aio.Server,
        service: LoaderService,
        health: Health,
        port: int,
        resources: RenderResources,
        local: LocalSocket | None = None,
    ):
        self.config = config
        self.grpc_server = grpc_server
        self.service = service
        self.health = health
        self.port = port
        self.resources = resources
        self.local = local  # the same-host socket, if it offers one
        self._stopped = False

    @property
    def target(self) -> str:
        return f"{bracketed(self.config.host)}:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """Drains: health NOT_SERVING, no new orders, in-flight work finishes; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.grace if grace is None else grace
        await self.health.drain()
        if self.local is not None:  # no new client maps the chunks; those that have keep them
            await self.local.close()
        self.service.drain()
        await self.grpc_server.stop(grace)
        self.resources.close()
        await self.health.close()


async def create_server(config: ServerConfig) -> LoaderServer:
    """Indexes the shards, starts the workers and binds the port (``port=0``: a free one)."""
    started = time.perf_counter()
    token = read_token(config.token_file) if config.token_file else None  # fail before starting anything
    credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca) if config.tls_cert else None
    indexed_ns = time.time_ns()  # files written after this are never region-decoded (worker_process.main)
    if config.data or config.source:
        start_fork_server()  # its imports run while the data is indexed
    shards = open_shards(list(config.data), FormatOptions.of(config))
    if config.source:
        shards.append(open_source(config.source, config.source_args))
    if config.synthetic:
        shards.append(SyntheticShard(config.synthetic))
    make_unique(shards)  # every key names one sample of this server's data
    resources = RenderResources.start(config, shards, indexed_ns)
    try:
        return await _serve_on(config, shards, resources, token, credentials, started)
    except BaseException:
        resources.close()
        raise


def sample_layout(shards, count: int = 16) -> tuple[int, int]:
    """(JPEGs, JPEGs whose crops decode only their own MCUs) among ``count`` samples spread over
    the shards (needs the native region decoder)."""
    starts = np.cumsum([0] + [len(s) for s in shards])
    total = int(starts[-1])
    jpegs = packed = 0
    for position in sorted({total * k // count for k in range(count)} if total else ()):
        at = int(np.searchsorted(starts, position, side="right")) - 1  # position -> (shard, index)
        shard = shards[at]
        location = shard.locate(position - int(starts[at]))
        try:
            if shard.remote and shard.storage is not None:  # a range of the object, like the workers' reads
                name = location.path.removeprefix(shard.storage.url + "/")
                data = shard.storage.read(name, location.offset, location.offset + location.length)
            else:
                data, _ = read_sample(location.path, location.offset, location.length)
        except (OSError, DecodeError):
            continue  # the workers will say what is wrong with it
        if data[:3] == JPEG_MAGIC:
            jpegs += 1
            packed += _jpeg.cuts(data)
    return jpegs, packed


async def _serve_on(
    config: ServerConfig,
    shards: list[Shard],
    resources: RenderResources,
    token: bytes | None,
    credentials: grpc.ServerCredentials | None,
    started: float,
) -> LoaderServer:
    service = LoaderService(
        config,
        shards,
        resources.pool,
        resources.arena,
        resources.cache,
        resources.checks,
        resources.objects,
        resources.read_ahead,
    )
    limit = max(config.max_message_bytes, limits.MAX_DESCRIBE_BYTES)  # a chunk, or a page of Describe
    interceptors = [TokenInterceptor(token)] if token else []
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limits.MAX_ORDER_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ],
    )
    server.add_generic_rpc_handlers((service.handler(),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server_health = Health(health_servicer, resources.pool)
    address = f"{bracketed(config.host)}:{config.port}"
    check_port_free(config.host, config.port, "--port")
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:
        hint = " (or the TLS certificate and key are not a valid PEM pair)" if credentials else ""
        raise OSError(f"{CANNOT_BIND} {address}{hint}: {exc}") from None
    await server.start()
    health_port = 0
    if config.health_port:
        try:
            health_port = await server_health.serve_port(config.host.strip("[]"), bind_port(config.health_port))
        except OSError:
            await server.stop(None)
            raise
    metrics_port = 0
    if config.metrics_port:
        # Before health says SERVING. On failure the gRPC server is stopped here: left to the
        # garbage collector, it would be shut down on an event loop already closed (a traceback),
        # and one never started keeps its port bound.
        try:
            metrics_port = service.metrics.serve(bind_port(config.metrics_port), config.host.strip("[]"))
        except OSError as exc:
            await server.stop(None)
            await server_health.close()
            raise OSError(
                f"cannot bind the metrics port {config.metrics_port} on {config.host}: "
                f"{exc.strerror or exc} (choose another --metrics-port, or 0 for none)"
            ) from None
    local = _offer_local(config, service, resources.arena, token)
    await server_health.start()
    _log_start(config, shards, started, metrics_port, local, health_port)
    return LoaderServer(config, server, service, server_health, port, resources, local)


def _offer_local(config: ServerConfig, service: LoaderService, arena: Arena, token: bytes | None) -> LocalSocket | None:
    """Starts the same-host socket (--local-socket) where this host can say who it is, and has
    Describe offer it."""
    host = host_id() if config.local_socket else ""
    # Authenticated by certificate alone, the server hands its memory to its own user only (local_socket).
    local = LocalSocket.start(arena, token, same_user=bool(config.tls_client_ca)) if host else None
    if local is not None:
        service.offer_local(local.address, host)
    return local


def _log_start(
    config: ServerConfig,
    shards: list[Shard],
    started: float,
    metrics_port: int,
    local: LocalSocket | None,
    health_port: int,
) -> None:
    """What a started server tells its operator: what it serves, how it decodes, how it is reached."""
    samples = sum(len(s) for s in shards)
    log.info(
        "serving %d shard(s), %d samples, with %d workers; indexed and started in %.1fs",
        len(shards),
        samples,
        config.workers,
        time.perf_counter() - started,
    )
    if not config.synthetic:
        log.info("JPEG crops: %s", region_decoder() if config.region_decode else "whole images (--region-decode off)")
        jpegs, packed = sample_layout(shards) if config.region_decode and _jpeg is not None else (0, 0)
        if jpegs:
            log.info(
                "%d of %d sampled JPEGs have a restart marker per MCU%s",
                packed,
                jpegs,
                ""
                if packed == jpegs
                else ": `remoteloader pack` would cut the decode CPU of the others "
                "by about a quarter (measured on ImageNet-sized photos)",
            )
    if local is not None:
        log.info(
            "same-host clients map the chunks through the local socket %s (%s)",
            local.address,
            "with the token"
            if config.token_file
            else "this user's processes"
            if config.tls_client_ca
            else "any local process: no --token-file",
        )
    if metrics_port:
        log.info("%s http://%s:%d/metrics", METRICS_ON, bracketed(config.host), metrics_port)
    if health_port:
        log.info("%s %s:%d", HEALTH_ON, bracketed(config.host), health_port)
    warning = auth_warning(config)
    if warning:
        log.warning(warning)
    else:
        auth = [n for n, on in (("mutual TLS", config.tls_client_ca), ("bearer token", config.token_file)) if on]
        log.info(
            "transport: %s; authentication: %s",
            "TLS" if config.tls_cert else "plaintext",
            ", ".join(auth) or "none (loopback only)",
        )


def auth_warning(config: ServerConfig) -> str | None:
    """The warning for a server others can reach without authenticating, if that is the case."""
    if _is_loopback(config.host) or config.token_file or config.tls_client_ca:
        return None
    return (
        f"bound to {config.host} without authentication (no --token-file, no --tls-client-ca): anyone "
        f"who can reach this port can read the data"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: assume it is reachable from elsewhere
        return False


async def serve(config: ServerConfig) -> None:
    """Runs a server until SIGTERM or SIGINT, then drains and returns."""
    server = await create_server(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before the readiness line: a SIGTERM right after it drains
        loop.add_signal_handler(sig, stop.set)
    # The readiness line, whatever the log level: tools and tests wait for it.
    print(f"remoteloader-server {LISTENING} {server.target}", file=sys.stderr, flush=True)
    serving = asyncio.ensure_future(server.grpc_server.wait_for_termination())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    log.info("draining (grace %.0fs)", config.grace)
    await server.stop()
    serving.cancel()
    # On its way out a repeated stop signal (a supervisor's second SIGTERM) must not end the
    # process by the signal instead of exit code 0: closing the loop would restore the default
    # action, so the handlers go now, replaced by "ignore". Removing a handler restores the
    # default action for a moment, so the signals wait (blocked) until "ignore" is in place,
    # which then discards them.
    stops = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    for sig in stops:
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
    log.info("stopped")


def run(config: ServerConfig) -> None:
    """Blocking entry: runs ``serve`` on uvloop when available."""
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter()
        if config.log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=config.log_level.upper(), handlers=[handler])
    malloc.tune_malloc()
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(config))
    else:
        uvloop.run(serve(config))
