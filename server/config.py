"""Server configuration: one frozen dataclass, built from CLI flags or REMOTELOADER_* variables.

Every field maps one-to-one onto a flag (``--chunk-bytes``) and an environment variable
(``REMOTELOADER_CHUNK_BYTES``); a flag wins over the variable. Docker, compose, Kubernetes
and the tests all build the same object.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from remoteloader.protos import limits
from remoteloader.protos.jobs import parse_weights
from remoteloader.server.storage import is_remote, scratch_folder

ENV_PREFIX = "REMOTELOADER_"
# What the server says on stderr that launchers read (tools/local.py): once it serves,
# "remoteloader-server listening on HOST:PORT"; when its port is taken, "cannot bind ...".
LISTENING = "listening on"
CANNOT_BIND = "cannot bind"
# And, logged at INFO before that, the other ports it bound: "... METRICS_ON http://HOST:PORT/metrics"
# and "... HEALTH_ON HOST:PORT".
METRICS_ON = "Prometheus metrics on"
HEALTH_ON = "gRPC health alone, plaintext and without a token, on"
# --metrics-port and --health-port: 0 turns them off (compose, Kubernetes and the docs rely on
# that), so "a free one" is this value; the server logs the port it bound (server/app.py).
ANY_PORT = -1
MAX_IMAGE_SIDE = 8192
MiB = limits.MiB


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def bracketed(host: str) -> str:
    """``host`` as written before ``:port``: an IPv6 literal in brackets (``[::1]:50051``), so
    that gRPC and clients read the port after the last colon and not inside the address."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def check_port_free(host: str, port: int, flag: str) -> None:
    """OSError ("cannot bind ...") when something listens on ``host:port`` already: said before
    gRPC tries, whose own failure logs a C-core line ahead of ours. Port 0 is always free."""
    if not port:
        return
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (a port in TIME_WAIT is free)
        try:
            probe.bind((bare, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(
                    f"{CANNOT_BIND} {bracketed(host)}:{port}: the port is in use (another server on it?); "
                    f"choose another {flag}"
                ) from None
            # (other failures, e.g. an address this machine lacks: gRPC's bind says why)


def bind_port(port: int) -> int:
    """The port to bind for a --metrics-port or --health-port that is on: ``ANY_PORT`` is 0 (a free one)."""
    return 0 if port == ANY_PORT else port


def _setting(default: Any, help: str, parse: Callable[[Any], Any] | None = None) -> Any:
    """A ServerConfig field and its one description, which ``--help`` prints. ``parse``: the flag
    is text (its variable too) that ``ServerConfig`` parses once into the value it keeps (the
    parser takes the text, or a value already parsed; ValueError names the setting)."""
    return field(default=default, metadata={"help": help, "parse": parse})


def _job_weights(value: str | Mapping[str, float]) -> dict[str, float]:
    if not isinstance(value, str):  # given parsed (a ServerConfig made in code): checked as the text is
        value = ",".join(f"{name}={weight!r}" for name, weight in value.items())
    return parse_weights(value)


def _tfrecord_features(value: str | Mapping[str, str]) -> dict[str, str]:
    if not value:
        return {}
    from remoteloader.server.formats import tfrecord  # (its parser knows the features)

    return tfrecord.renamed_features(value)


def _parquet_columns(value: str | Mapping[str, str]) -> dict[str, str]:
    if not value:
        return {}
    from remoteloader.server.formats import parquet  # (its parser knows the columns)

    return parquet.columns(value)


@dataclass(frozen=True)
class ServerConfig:
    """A loader server's settings, grouped by purpose; each field's ``help`` says what it does.

    Validated once, here: an instance is a server that can start. ``slots=0`` becomes its
    default (4 x workers + 4) and ``data`` a tuple of strings.
    """

    # Data
    data: tuple[str, ...] = _setting(
        (),
        "shard paths: ImageFolder trees, .tar files, folders of .tar files or COCO annotation .json files, "
        "on this machine or in an object store (s3://bucket/prefix, gs://, az://, https://)",
    )
    image_root: str = _setting("", "folder or URL of a COCO file's images (default: the folder the .json is in)")
    coco_masks: bool = _setting(
        False, "keep COCO segmentations: a semantic mask (the 'mask' field) and an instance mask per box ('masks')"
    )
    # (these two are kept parsed: a dict of the names given, {} for none)
    tfrecord_features: dict[str, str] = _setting(
        "",
        'TFRecord feature names other than TensorFlow\'s usual ones, as JSON: {"image": "jpeg", "label": "cls"} '
        "(image, label, xmin, ymin, xmax, ymax, bbox_label, width, height)",
        _tfrecord_features,
    )
    parquet_columns: dict[str, str] = _setting(
        "",
        'Parquet columns other than those found by type, as JSON: {"image": "img", "label": "y"} '
        "(image, label, labels, objects, bbox_format: coco or pascal_voc)",
        _parquet_columns,
    )
    # Unpickling runs code from the file: only the operator may ask for it, never a client.
    lmdb_unpickle: bool = _setting(
        False, "read LMDB values that are pickles: this RUNS CODE from the database file; only for files you trust"
    )
    # The operator's code, from this command line only; never sent by a client.
    source: str = _setting("", "serve samples from your own Python object: package.module:factory")
    source_args: str = _setting("{}", "JSON object of keyword arguments for the --source factory")
    # Object stores (credentials from the standard variables: AWS_*, GOOGLE_*, AZURE_*)
    cache_dir: str = _setting(
        "",
        "folder for bytes fetched from an object store and for tar indexes that cannot be kept beside their tars "
        "(default: ~/.cache/remoteloader)",
    )
    disk_cache_bytes: int = _setting(
        16 << 30, "most bytes fetched from object stores kept in --cache-dir (least recently used go first)"
    )
    store_timeout: float = _setting(
        60.0, "seconds a request to an object store is retried (timeouts, 5xx, throttling) before its samples fail"
    )
    fetch_concurrency: int = _setting(64, "requests to object stores in flight at once")
    # Network
    host: str = _setting("127.0.0.1", "address to bind; 0.0.0.0 in a container")
    port: int = _setting(50051, "TCP port; 0 picks a free one")
    # For probes that speak neither TLS nor tokens (Kubernetes' grpc probes, Docker's HEALTHCHECK
    # through `remoteloader probe`); the health service only, never the Loader service.
    health_port: int = _setting(
        0,
        f"also answer gRPC health checks on this port, in plaintext and without a token (0: off; {ANY_PORT}: a free "
        "port, which the server logs)",
    )
    # Work
    workers: int = field(default_factory=default_workers, metadata={"help": "decode/augment worker processes"})
    # 2 MiB by measurement (benchmarks/wire.py --chunk-bytes ...): 1.5-2 MiB moved the most per receiver CPU-second.
    chunk_bytes: int = _setting(2 * MiB, "pixel bytes per streamed message")
    # A same-host client reads a chunk where the workers wrote it: no message bounds it, and each
    # chunk costs both sides a header, a wake-up and a release. 8 MiB by measurement
    # (benchmarks/detection.py, 640 px): the server's main process 0.55 -> 0.21 ms per image.
    shared_chunk_bytes: int = _setting(
        8 * MiB, "pixel bytes per chunk for clients on this host (--local-socket), which read it in place"
    )
    slots: int = _setting(
        0,
        "shared chunk buffers (memory = slots x max(chunk_bytes, shared_chunk_bytes, largest sample)); "
        "0: 4 x workers + 4",
    )
    max_order_samples: int = _setting(1024, "most samples in one order")
    max_inflight_orders: int = _setting(16, "most outstanding orders per stream")  # more: RESOURCE_EXHAUSTED
    min_image_size: int = _setting(8, "smallest output side clients may ask for")
    max_image_size: int = _setting(1024, "largest output side clients may ask for")
    max_pixels: int = _setting(100_000_000, "largest image (width x height) the server decodes")
    # Native region decoding when it was built (decode.decode_crop); the pixels are the same either way.
    region_decode: bool = _setting(
        True,
        "decode only the region a random-resized crop keeps (same pixels); until a file has decoded without error, "
        "the rest of it is entropy-decoded too, to refuse it as a whole decode would",
    )
    # Rebuilt from albumentations' registry only (A.from_dict): no client code runs.
    allow_custom_pipelines: bool = _setting(False, "accept albumentations pipelines serialized by clients")
    cache_bytes: int = _setting(0, "shared memory for caching encoded samples after their first read (0: off)")
    read_ahead: bool = _setting(
        True, "ask the kernel to read each order's samples from local disk as the order arrives (server/read_ahead.py)"
    )
    # Concurrent jobs: their shares of the decode (server.fair_queue); a client names its job with
    # RemoteLoader(job=...). A job not listed weighs 1 for each stream it has open (as do streams
    # that name no job): naming a job changes its share only once it is listed here. Kept parsed:
    # job name -> weight.
    job_weights: dict[str, float] = _setting(
        "",
        "shares of the decode workers by job, as NAME=WEIGHT,... (e.g. sweep=3,probe=1; 0.001 to 1000 each); "
        "a job not listed weighs 1 for each of its streams",
        _job_weights,
    )
    # For sharing a machine, and for tests of uneven servers.
    max_rate: float = _setting(0.0, "most images per second this server renders (0: unlimited)")
    # A decode stuck for good (a stopped or wedged process) must not hold its samples forever.
    worker_timeout: float = _setting(
        30.0,
        "seconds a decode worker may hold work without answering before it is replaced (its work goes to "
        "another worker once); health says NOT_SERVING after a third of it",
    )
    # Benchmarking (--data is then not needed)
    synthetic: int = _setting(
        0, "serve this many generated samples without decoding, to measure the transport (0: off)"
    )
    # Security and limits
    tls_cert: str = _setting("", "PEM certificate: serve TLS")
    tls_key: str = _setting("", "PEM private key of tls_cert")
    tls_client_ca: str = _setting("", "PEM CA: require client certificates it signed (mutual TLS)")
    token_file: str = _setting("", "file holding the bearer token clients must send")  # health checks need none
    # The socket sends the chunk memory's descriptor (read-only) after the token, when there is one.
    local_socket: bool = _setting(
        True,
        "offer clients on this host the chunk memory over an abstract Unix socket, so that batches skip gRPC; "
        "false: none",
    )
    max_streams: int = _setting(64, "open order streams accepted in all")
    # 16: a train and an eval loader on each of 8 GPU ranks of one host.
    max_streams_per_client: int = _setting(16, "open order streams accepted per client address")
    # Ended with DEADLINE_EXCEEDED and its slots freed; the 10 s is stalls.CONTENDED_STALL.
    stall_timeout: float = _setting(
        120.0,
        "seconds a client may leave a chunk unread (or a new stream its Setup) "
        "before the stream is ended; 10 s while a stream waits for a free slot",
    )
    # Operations
    metrics_port: int = _setting(
        0, f"serve Prometheus metrics on this port (0: off; {ANY_PORT}: a free port, which the server logs)"
    )
    grace: float = _setting(30.0, "seconds in-flight work may take to finish after SIGTERM")
    log_level: str = _setting("INFO", "logging level")
    log_format: str = _setting("text", "text or json")  # json: one JSON object per line

    def __post_init__(self) -> None:
        if isinstance(self.data, (str, os.PathLike)):
            object.__setattr__(self, "data", (str(self.data),))
        object.__setattr__(self, "data", tuple(str(p) for p in self.data))
        if not self.data and not self.synthetic and not self.source:
            raise ValueError("data: no shard paths given; pass --data DIR (or REMOTELOADER_DATA) or --source")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port}: expected 0..65535 (0 picks a free port)")
        if not ANY_PORT <= self.health_port <= 65535 or (self.health_port > 0 and self.health_port == self.port):
            raise ValueError(
                f"health_port={self.health_port}: expected 0..65535 (0 turns it off) or {ANY_PORT} (a free port), "
                f"not the Loader's port {self.port}"
            )
        self._check_source()
        for f in dataclasses.fields(self):  # the settings given as text, parsed once here
            parse = f.metadata.get("parse")
            if parse is not None:
                object.__setattr__(self, f.name, parse(getattr(self, f.name)))
        if self.image_root and not is_remote(self.image_root) and not os.path.isdir(self.image_root):
            raise ValueError(f"image_root={self.image_root!r}: no such folder")
        _positive(
            self,
            "workers",
            "chunk_bytes",
            "shared_chunk_bytes",
            "max_order_samples",
            "max_inflight_orders",
            "min_image_size",
            "max_image_size",
            "max_pixels",
        )
        if self.max_order_samples > limits.most_order_samples():
            most = limits.most_order_samples()
            raise ValueError(
                f"max_order_samples={self.max_order_samples}: at most {most} (an order's indices must fit in "
                f"the {limits.MAX_ORDER_MESSAGE_BYTES >> 20} MiB orders clients send)"
            )
        if self.max_image_size > MAX_IMAGE_SIDE:
            raise ValueError(
                f"max_image_size={self.max_image_size}: at most {MAX_IMAGE_SIDE} (each of the "
                f"slots holds at least one sample of max_image_size^2 x 3 bytes)"
            )
        if self.min_image_size > self.max_image_size:
            raise ValueError(f"min_image_size={self.min_image_size} > max_image_size={self.max_image_size}")
        if self.slots < 0:
            raise ValueError(f"slots={self.slots}: expected >= 0 (0 means 4 x workers + 4)")
        if self.slots == 0:
            object.__setattr__(self, "slots", 4 * self.workers + 4)
        for name in ("cache_bytes", "max_rate", "synthetic"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: expected >= 0 (0 turns it off)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: give both PEM files, or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key too")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "token_file"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"{name}={path!r}: no such file")
        _positive(self, "max_streams", "max_streams_per_client", "stall_timeout", "worker_timeout", "store_timeout")
        _positive(self, "fetch_concurrency")
        if self.disk_cache_bytes < 0:
            raise ValueError(f"disk_cache_bytes={self.disk_cache_bytes}: expected >= 0")
        if not self.cache_dir:
            object.__setattr__(self, "cache_dir", scratch_folder())
        if not ANY_PORT <= self.metrics_port <= 65535:
            raise ValueError(
                f"metrics_port={self.metrics_port}: expected 0..65535 (0 turns metrics off) or {ANY_PORT} (a free port)"
            )
        if not isinstance(logging.getLevelName(str(self.log_level).upper()), int):
            raise ValueError(f"log_level={self.log_level!r}: expected DEBUG, INFO, WARNING, ERROR or CRITICAL")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format={self.log_format!r}: expected 'text' or 'json'")
        if self.grace < 0:
            raise ValueError(f"grace={self.grace}: expected seconds >= 0")

    def _check_source(self) -> None:
        if self.source:
            module, _, name = self.source.partition(":")
            if not module or not name.isidentifier():
                raise ValueError(f"source={self.source!r}: expected package.module:factory")
        try:
            args = json.loads(self.source_args)
        except ValueError as exc:
            raise ValueError(f"source_args={self.source_args!r} is not JSON: {exc}") from None
        if not isinstance(args, dict):
            raise ValueError(f"source_args={self.source_args!r}: expected a JSON object of keyword arguments")

    @property
    def index_folder(self) -> str:
        """Where indexes go that cannot be kept beside their files (and Parquet's extracts beside it)."""
        return os.path.join(self.cache_dir, "indexes")

    @property
    def max_sample_bytes(self) -> int:
        """Pixel bytes of the largest sample clients may ask for."""
        return limits.sample_bytes(self.max_image_size, self.max_image_size)

    def stream_chunk_bytes(self, shared: bool) -> int:
        """Pixel bytes of a stream's chunks: ``shared``, read in place by a same-host client."""
        return self.shared_chunk_bytes if shared and self.local_socket else self.chunk_bytes

    @property
    def slot_bytes(self) -> int:
        """Bytes of one shared slot: any chunk of this server's (protos.limits.slot_bytes)."""
        chunk = max(self.stream_chunk_bytes(shared=False), self.stream_chunk_bytes(shared=True))
        return limits.slot_bytes(chunk, self.max_sample_bytes)

    @property
    def max_message_bytes(self) -> int:
        """Largest message the server sends: one slot of pixels plus its header (protos.limits)."""
        return limits.max_message_bytes(self.chunk_bytes, self.max_sample_bytes)


def _positive(config: ServerConfig, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value <= 0:
            raise ValueError(f"{name}={value}: expected a positive number")


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per ServerConfig field, defaulting to its REMOTELOADER_* variable."""
    defaults = ServerConfig(data=("-",))
    for f in dataclasses.fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        env = ENV_PREFIX + f.name.upper()
        doc = f.metadata["help"]
        if f.name == "data":
            parser.add_argument(flag, nargs="+", default=_env_list(env), help=f"{doc} [env {env}, space-separated]")
        elif f.type in (bool, "bool"):
            # A string default goes through type=, so a bad variable is a usage error, not a traceback.
            parser.add_argument(
                flag,
                type=_bool,
                nargs="?",
                const=True,
                default=os.environ.get(env, getattr(defaults, f.name)),
                help=f"{doc} [env {env}]",
            )
        else:
            kind = str if f.metadata.get("parse") else {"int": int, "float": float, "str": str}[str(f.type)]
            default = getattr(defaults, f.name)
            # (an empty default means "none"; a help text that says its default keeps its words)
            shown = "" if default in ("", {}) or "(default" in doc else f" (default {default})"
            parser.add_argument(
                flag, type=_typed(kind, env), default=os.environ.get(env), help=f"{doc}{shown} [env {env}]"
            )


def _typed(kind, env: str):
    """``kind``, with an error that names the variable when the value came from it."""

    def convert(text: str):
        try:
            return kind(text)
        except ValueError:
            source = f" (from {env})" if os.environ.get(env) == text else ""
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}{source}") from None

    convert.__name__ = kind.__name__
    return convert


def unknown_variables() -> list[str]:
    """REMOTELOADER_* variables set in the environment that name no setting (typos)."""
    names = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(ServerConfig)}
    return sorted(k for k in os.environ if k.startswith(ENV_PREFIX) and k not in names)


def from_args(args: argparse.Namespace) -> ServerConfig:
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(ServerConfig)
        if getattr(args, f.name, None) is not None
    }
    return ServerConfig(**values)


def _env_list(name: str) -> list[str] | None:
    value = os.environ.get(name)
    return value.split() if value else None
