"""The option groups' machinery, their checks, and the groups the I/O side uses (no torch here).

``option(default, doc, check)`` declares a field once; a group (``_Group``) checks its fields
when it is made and keeps the normalized values. These groups travel to the receiver process,
which never imports torch: ``OutputOptions``, which needs it, and ``LoaderOptions``, which
holds all seven, live in ``options.py`` (its docstring says how to add an option).
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from remoteloader.client.batches import SampleFailure
from remoteloader.client.security import TLSConfig, tls_config, token_metadata
from remoteloader.protos import CUSTOM_PIPELINE
from remoteloader.protos import targets as tg
from remoteloader.protos import wire as wires
from remoteloader.protos.jobs import job_name_error

BATCH_FORMATS = ("torchvision",)  # besides None: (images, labels) tuples or dicts
UINT64 = 1 << 64  # seeds and epochs travel as uint64


class _Name(str, enum.Enum):
    """An option given as a name: equal to its string, and printed as it (as ``enum.StrEnum``, 3.11+)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class OnError(_Name):
    """``on_error`` given as a name (a callable is the other form)."""

    RAISE = "raise"
    WARN = "warn"
    SKIP = "skip"


class ReceiverKind(_Name):
    """``receiver``: where batches are received (``receiver.py``)."""

    THREAD = "thread"
    PROCESS = "process"


class Wire(_Name):
    """``wire``: how the pixels travel (``protos.wire``)."""

    RAW = wires.RAW
    ZSTD = wires.ZSTD
    JPEG95 = wires.JPEG95


ErrorHandler = OnError | Callable[[list[SampleFailure]], None]


def option(default: Any, doc: str, check: Callable[[str, Any], Any] | None = None, *, read_back: bool = False) -> Any:
    """A group's field: its default, its doc (a line of RemoteLoader's docstring) and its check,
    ``check(name, value)``, which returns the value normalized or raises ValueError naming it.
    ``read_back``: RemoteLoader has a read-only attribute of the same name."""
    return field(default=default, metadata={"doc": doc, "check": check, "read_back": read_back})


@dataclass(frozen=True)
class _Group:
    """What every group does: check each field by its own check, then ``_relate`` its fields."""

    TITLE: ClassVar[str]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check = f.metadata["check"]
            if check is not None:
                object.__setattr__(self, f.name, check(f.name, getattr(self, f.name)))
        self._relate()

    def _relate(self) -> None:
        """Checks between this group's fields (after each field's own)."""


# ---- checks, each ``check(name, value) -> value`` ---------------------------------------------
def check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    """``value`` as an int in [low, high) (numpy ints too; not bools, floats or strings)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r}: expected an int")
    value = int(value)
    if value < low or (high is not None and value >= high):
        bound = f">= {low}" if high is None else f"in {low}..{high - 1}"
        raise ValueError(f"{name}={value!r}: expected an int {bound}")
    return value


def _positive(name: str, value: Any) -> int:
    return check_int(name, value, 1)


def _uint64(name: str, value: Any) -> int:
    return check_int(name, value, 0, UINT64)


def _flag(name: str, value: Any) -> bool:
    return bool(value)


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name}={value!r}: expected seconds >= 0")
    return value


def _some_seconds(name: str, value: Any) -> float:
    if _seconds(name, value) == 0:
        raise ValueError(f"{name}=0: expected seconds > 0")
    return value


def _optional(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda name, value: None if value is None else check(name, value)


def _size(name: str, image_size: Any) -> tuple[int, int]:
    size = (image_size, image_size) if isinstance(image_size, (int, np.integer)) else image_size
    if (
        not isinstance(size, Sequence)
        or len(size) != 2
        or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and 0 < v <= 65535 for v in size)
    ):
        raise ValueError(f"{name}={image_size!r}: expected an int or (height, width), 1..65535 each")
    return int(size[0]), int(size[1])


def _pipeline(name: str, pipeline: Any) -> str | dict:
    """A pipeline's name, or the document of a custom one (``A.to_dict``)."""
    if isinstance(pipeline, str):
        if pipeline == CUSTOM_PIPELINE:
            raise ValueError(f"{name}='custom': pass the albumentations pipeline itself (A.Compose or A.to_dict)")
        return pipeline
    if isinstance(pipeline, dict):
        return pipeline
    if type(pipeline).__module__.startswith("albumentations"):
        import albumentations as A  # only when the user already uses it

        return A.to_dict(pipeline)
    raise ValueError(
        f"{name}={pipeline!r}: expected 'train', 'eval', an albumentations pipeline or its A.to_dict() dictionary"
    )


def _fields(name: str, fields: Any) -> tuple[str, ...] | None:
    if fields is None:
        return None
    if isinstance(fields, str) or not isinstance(fields, Iterable):
        raise ValueError(f"{name}={fields!r}: expected a list of field names, e.g. ['bboxes', 'bbox_labels'], or None")
    names = tuple(dict.fromkeys(fields))
    try:
        for field_name in names:
            tg.check_field_name(field_name)
    except tg.TargetError as exc:
        raise ValueError(f"{name}={fields!r}: {exc}") from None
    if len(names) > tg.MAX_FIELDS:
        raise ValueError(f"{name}={fields!r}: at most {tg.MAX_FIELDS} fields")
    return names


def _batch_format(name: str, batch_format: Any) -> str | None:
    if batch_format is not None and batch_format not in BATCH_FORMATS:
        raise ValueError(f"{name}={batch_format!r}: expected None or one of {', '.join(BATCH_FORMATS)}")
    return batch_format


def _on_error(name: str, on_error: Any) -> ErrorHandler:
    if callable(on_error):
        return on_error
    if on_error not in tuple(OnError):
        raise ValueError(f"{name}={on_error!r}: expected one of {', '.join(OnError)} or a callable")
    return OnError(on_error)


def _receiver(name: str, receiver: Any) -> ReceiverKind | None:
    """The receiver kind asked for (None: OutputOptions picks it by the device)."""
    if receiver is None:
        return None
    if receiver not in tuple(ReceiverKind):
        raise ValueError(f"{name}={receiver!r}: expected one of {', '.join(ReceiverKind)}")
    if receiver == ReceiverKind.PROCESS and not hasattr(os, "memfd_create"):
        raise ValueError(f"{name}='process' needs Linux (os.memfd_create); use receiver='thread'")
    return ReceiverKind(receiver)


def _wire(name: str, wire: Any) -> Wire:
    """The wire encoding (protos.wire), which this process must be able to decode."""
    if not isinstance(wire, str) or wire not in wires.WIRES:
        raise ValueError(f"{name}={wire!r}: expected one of {', '.join(wires.WIRES)} (jpeg95 is lossy)")
    why = wires.missing(wire)
    if why:
        raise ValueError(why)
    return Wire(wire)


def _job(name: str, job: Any) -> str | None:
    if job is None:
        return None
    error = job_name_error(job) if isinstance(job, str) and job else f"{name}={job!r}: expected a name or None"
    if error:
        raise ValueError(error)
    return job


def _tls(name: str, tls: Any) -> TLSConfig | None:
    return tls_config(tls)


def _token(name: str, token: Any) -> str | None:
    token_metadata(token)  # (refuses what is not a non-empty string)
    return token.strip() if isinstance(token, str) else None


# ---- the groups: RemoteLoader's docstring sections, in its order ------------------------------
@dataclass(frozen=True)
class BatchOptions(_Group):
    """Which samples make each epoch's batches, and their size."""

    TITLE: ClassVar[str] = "Batches"
    batch_size: int = option(256, "Samples per batch.", _positive, read_back=True)
    image_size: tuple[int, int] = option(224, "Output size, an int or (height, width).", _size, read_back=True)
    pipeline: str | dict = option(
        "train",
        '``"train"`` (random resized crop + flip), ``"eval"`` (resize + center crop), ``"detection-train"``, '
        '``"detection-eval"``, ``"segmentation-train"``, ``"segmentation-eval"`` (docs/targets.md), or an '
        "albumentations pipeline (``A.Compose``, or its ``A.to_dict``), which the servers must allow.",
        _pipeline,
    )
    shuffle: bool = option(True, "Shuffle the union of all servers' samples every epoch.", _flag, read_back=True)
    seed: int = option(0, "Seeds the shuffle and every sample's augmentation.", _uint64, read_back=True)
    drop_last: bool = option(True, "Drop the last incomplete batch.", _flag, read_back=True)
    sampler: Iterable[int] | None = option(
        None,
        "An iterable of global sample ids replacing shuffle (e.g. weighted); its ``set_epoch`` is called if it "
        "has one. It is ``options.sampler``: the loader has no ``sampler`` attribute, so that frameworks "
        "do not take it for a DataLoader.",
    )
    rank: int | None = option(
        None,
        "This process's part of each epoch; None: torch.distributed's, read at ``len()`` and at each pass's "
        "first batch (a loader made before ``init_process_group`` is right), else 0. Every rank gets the same "
        "number of batches.",
    )
    world_size: int | None = option(
        None, "The number of ranks; None: torch.distributed's, else 1.", _optional(_positive)
    )

    def _relate(self) -> None:
        if self.rank is not None:
            object.__setattr__(self, "rank", check_int("rank", self.rank, 0, self.world_size))


@dataclass(frozen=True)
class FlowOptions(_Group):
    """How far ahead the loader asks, in what order batches come out, and when a server is late
    (the engine's options)."""

    TITLE: ClassVar[str] = "Flow control"
    prefetch: int = option(
        8,
        "Batches requested ahead of the training loop (8: with uneven servers and ordered delivery, 4 left 10% "
        "of their capacity unused). Host memory is about (prefetch + 2) x batch bytes (pinned on CUDA); with "
        "``normalize`` on the CPU, add the normalized batches you hold and up to two spare ones. A loader whose "
        "buffers would take more than 90% of the memory the machine has available (MemAvailable, or a "
        "container's cgroup room: ``memory_bounds.py``) is refused when it is made, before it allocates any.",
        _positive,
        read_back=True,
    )
    ordered: bool = option(
        True, "Yield batches in plan order (reproducible) or as they complete.", _flag, read_back=True
    )
    progress_timeout: float = option(
        60.0,
        "Seconds a server may hold orders without sending anything before it is treated as failed and its "
        "orders go elsewhere; one that still does so after reconnect_timeout is given up, with an error naming it.",
        _some_seconds,
    )


@dataclass(frozen=True)
class ConnectionOptions(_Group):
    """How every link connects to its server (the links' options, with ``SecurityOptions``)."""

    TITLE: ClassVar[str] = "Connections"
    max_inflight: int = option(
        4,
        "Orders outstanding per server; server-side memory for the stream is about max_inflight x order bytes.",
        _positive,
    )
    connect_timeout: float = option(
        10.0,
        "Seconds to wait for each server at start: a server that refuses the connection (still starting) is "
        "logged at once and tried again until then.",
        _seconds,
    )
    reconnect_timeout: float = option(
        60.0,
        "Seconds a failed server may take to come back before its unserved samples raise an error, when no "
        "other server holds its shards.",
        _seconds,
    )
    wire: Wire = option(
        "raw",
        'How the pixels travel (docs/operator-guide.md, "Wire choices"): ``"raw"``, ``"zstd"`` (lossless, about '
        '1.2x fewer bytes on photos, masks far fewer) or ``"jpeg95"`` (LOSSY: JPEG quality 95, about 4x fewer '
        "bytes; masks, labels and targets stay exact). The servers encode, this process (or its receiver "
        "process) decodes, at some CPU per image: worth it only where the link is the limit. Needs ``pip install "
        "'remoteloader[wire]'`` and servers that offer it.",
        _wire,
        read_back=True,
    )
    shared_memory: bool = option(
        True,
        "Servers on this host hand over their chunk memory, and batches are copied from where their decode "
        'workers wrote them instead of through gRPC (docs/operator-guide.md, "Same host"); found out per server, '
        "by its host id and a Unix socket only local processes can open; servers elsewhere are read over gRPC. "
        'False reads every server over gRPC. Only with ``wire="raw"``.',
        _flag,
        read_back=True,
    )

    @property
    def reads_shared_memory(self) -> bool:
        """Whether links read same-host servers' chunks from their memory (raw pixels only)."""
        return self.shared_memory and self.wire == Wire.RAW


@dataclass(frozen=True)
class JobOptions(_Group):
    """The job a loader feeds, when several share a fleet."""

    TITLE: ClassVar[str] = 'Jobs sharing a fleet (docs/user-guide.md, "Several jobs on one fleet")'
    job: str | None = option(
        None,
        "The training job this loader feeds, as the servers' operator names it in their ``--job-weights`` (its "
        "share of their decode workers) and as their metrics count it: letters, digits, ``.``, ``_``, ``-``, at "
        "most 64. None: each stream is a job of its own. A job the operator did not list weighs 1 a stream, "
        "named or not. Give every rank of a job the same name.",
        _job,
        read_back=True,
    )
    share: bool = option(
        True,
        "True: where another loader asks a server for the very same chunk (same pipeline, size, fields, wire, "
        "seed, epoch and samples: the jobs of a sweep that differ only in the model), the server decodes it once "
        "for both; the batches are the same bit for bit, each loader still gets every sample once, and "
        '``stats()["images_shared"]`` counts those that came from a decode another stream started. False: this '
        "loader's samples are decoded for it alone.",
        _flag,
        read_back=True,
    )


@dataclass(frozen=True)
class SecurityOptions(_Group):
    """Credentials every link presents."""

    TITLE: ClassVar[str] = "Security"
    tls: TLSConfig | None = option(
        None,
        "Path of the CA PEM that signed the servers' certificates, or a TLSConfig (with a client certificate for "
        "mutual TLS); None: plaintext.",
        _tls,
    )
    token: str | None = option(None, "Bearer token the servers expect (their --token-file).", _token)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call sends: the token's authorization header, if any."""
        return token_metadata(self.token)
