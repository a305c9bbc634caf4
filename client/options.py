"""RemoteLoader's options as data: validated once, into one frozen ``LoaderOptions``.

``LoaderOptions.from_arguments`` takes RemoteLoader's keyword arguments as the user wrote
them, all of them in one mapping (the names and defaults live on RemoteLoader's signature
only), checks each, and returns the normalized values; its ValueErrors name the argument,
the value and what was expected. Everything after it reads the options and checks nothing
again. Adding an option: a parameter (and its doc) on RemoteLoader, its check here, and its
field below; ``from_arguments`` refuses a mapping with a name it does not take or without
one it does, so a forgotten place fails at once (``tests/test_options.py`` makes a loader's
arguments reach it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar, overload

import numpy as np
import torch

from remoteloader.client.batches import SampleFailure
from remoteloader.client.clips import VIDEO_PIPELINES, ClipOptions
from remoteloader.client.normalize import Normalize
from remoteloader.client.security import TLSConfig, tls_config, token_metadata
from remoteloader.protos import CUSTOM_PIPELINE, limits, loader_pb2
from remoteloader.protos import targets as tg
from remoteloader.protos.jobs import job_name_error
from remoteloader.protos.wire import WIRES, missing

ON_ERROR = ("raise", "warn", "skip")
BATCH_FORMATS = ("torchvision",)  # besides None: (images, labels) tuples or dicts
RECEIVERS = ("thread", "process")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
UINT64 = 1 << 64  # seeds and epochs travel as uint64
T = TypeVar("T")


@dataclass(frozen=True)
class LoaderOptions:
    """A RemoteLoader's validated options; the fields are documented on RemoteLoader."""

    batch_size: int
    image_size: tuple[int, int]
    setup: loader_pb2.Setup  # the pipeline, the output size and the target fields, as the servers are told
    fields: tuple[str, ...] | None  # as asked for; None: what the servers' shards carry
    shuffle: bool
    seed: int
    drop_last: bool
    sampler: Iterable[int] | None
    rank: int | None  # as given; None: torch.distributed's when the loader plays (client/ranks.py)
    world_size: int | None
    device: torch.device
    normalize: tuple[list[float], list[float]] | None
    dtype: torch.dtype
    return_ids: bool
    batch_format: str | None  # None, or "torchvision" (client/torchvision_form.py)
    ordered: bool
    on_error: str | Callable[[list[SampleFailure]], None]
    prefetch: int
    max_inflight: int
    connect_timeout: float
    reconnect_timeout: float
    progress_timeout: float
    receiver: Literal["thread", "process"]
    wire: str  # protos.wire: how the pixels travel (also in setup.wire)
    shared_memory: bool  # same-host servers' chunks read from their memory (client/same_host.py)
    job: str | None  # the job the streams name (also in setup.job)
    share: bool  # whether servers may share a chunk's decode with another loader (setup.exclusive: not)
    tls: TLSConfig | None
    token: str | None
    metadata: tuple[tuple[str, str], ...]
    clip: ClipOptions | None = None  # video clips (client/clips.py); None: images

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> LoaderOptions:
        """Validates RemoteLoader's arguments, by name (ValueError naming the first bad one;
        TypeError for a name it does not take, or one missing)."""
        a = _Arguments(arguments)
        batch_size = check_int("batch_size", a.take("batch_size"), 1)
        size = _size(a.take("image_size"))
        clip = ClipOptions.of(
            a.take("clip_frames"), a.take("frame_stride"), a.take("clips_per_video"), a.take("video_layout")
        )
        pipeline = a.take("pipeline")
        if clip is not None and isinstance(pipeline, str):
            pipeline = VIDEO_PIPELINES.get(pipeline, pipeline)
        setup = _setup(pipeline, size)
        if clip is not None:  # a clip travels as one image of its frames' rows (protos/loader.proto)
            setup.height, setup.clip_frames = clip.rows * size[0], clip.frames
            setup.frame_stride, setup.clips_per_video = clip.stride, clip.clips
        setup.wire = _wire(a.take("wire"))
        fields = _fields(a.take("fields"))
        if fields is not None:  # what the streams ask for; "label" always travels
            setup.fields.extend(f for f in fields if f != tg.LABEL)
        shuffle = bool(a.take("shuffle"))
        seed = check_int("seed", a.take("seed"), 0, UINT64)
        drop_last = bool(a.take("drop_last"))
        sampler = a.take("sampler")
        rank, world_size = _rank_world(a.take("rank"), a.take("world_size"))
        device = _device(a.take("device"))
        normal = _normalize(a.take("normalize"))
        dtype = a.take("dtype")
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype}: expected torch.float32, bfloat16, float16 or float64")
        batch_format = a.take("batch_format")
        if batch_format is not None and batch_format not in BATCH_FORMATS:
            raise ValueError(f"batch_format={batch_format!r}: expected None or one of {', '.join(BATCH_FORMATS)}")
        on_error = a.take("on_error")
        if not callable(on_error) and on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r}: expected one of {', '.join(ON_ERROR)} or a callable")
        prefetch = check_int("prefetch", a.take("prefetch"), 1)
        max_inflight = check_int("max_inflight", a.take("max_inflight"), 1)
        connect_timeout = _seconds("connect_timeout", a.take("connect_timeout"))
        reconnect_timeout = _seconds("reconnect_timeout", a.take("reconnect_timeout"))
        progress_timeout = _seconds("progress_timeout", a.take("progress_timeout"))
        if progress_timeout == 0:
            raise ValueError("progress_timeout=0: expected seconds > 0")
        return_ids, ordered = bool(a.take("return_ids")), bool(a.take("ordered"))
        receiver, shared_memory = _receiver(a.take("receiver"), device), bool(a.take("shared_memory"))
        tls, token = tls_config(a.take("tls")), a.take("token")
        job = a.take("job")
        if job is not None:
            error = job_name_error(job) if isinstance(job, str) and job else f"job={job!r}: expected a name or None"
            if error:
                raise ValueError(error)
            setup.job = job
        share = bool(a.take("share"))
        setup.exclusive = not share
        a.done()
        return cls(
            batch_size=batch_size,
            image_size=size,
            setup=setup,
            fields=fields,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            sampler=sampler,
            rank=rank,
            world_size=world_size,
            device=device,
            normalize=normal,
            dtype=dtype,
            return_ids=return_ids,
            batch_format=batch_format,
            ordered=ordered,
            on_error=on_error,
            prefetch=prefetch,
            max_inflight=max_inflight,
            connect_timeout=connect_timeout,
            reconnect_timeout=reconnect_timeout,
            progress_timeout=progress_timeout,
            receiver=receiver,
            wire=setup.wire,
            shared_memory=shared_memory,
            job=job,
            share=share,
            tls=tls,
            token=token.strip() if isinstance(token, str) else None,
            metadata=token_metadata(token),
            clip=clip,
        )

    @property
    def masks(self) -> bool:
        """Whether batches come with masks (the streams ask for the "mask" field)."""
        return tg.MASK in self.setup.fields

    @property
    def batch_bytes(self) -> int:
        """Bytes of one received batch (uint8 NHWC, then the masks, uint8 NHW)."""
        h, w = self.sample_size
        return self.batch_size * limits.sample_bytes(h, w, self.masks)

    @property
    def sample_size(self) -> tuple[int, int]:
        """(rows, width) of one sample as it travels: the image size, or a clip's K x T frames' rows."""
        h, w = self.image_size
        return (h * self.clip.rows if self.clip is not None else h), w

    def with_fields(self, fields: Sequence[str]) -> LoaderOptions:
        """These options with the streams asking for ``fields`` ("label" always travels)."""
        setup = loader_pb2.Setup()
        setup.CopyFrom(self.setup)
        del setup.fields[:]
        setup.fields.extend(f for f in fields if f != tg.LABEL)
        return dataclasses.replace(self, setup=setup)

    @property
    def batch_buffers(self) -> int:
        """Batch buffers a loader receives into: ``prefetch`` + 2 (RemoteLoader's docstring gives
        the memory they take). The receiver process's shared slots, the CUDA delivery's pinned
        pool and the host delivery's pool of free batches each hold this many."""
        return self.prefetch + 2


class _HasOptions(Protocol):
    options: LoaderOptions


class Option(Generic[T]):
    """A read-only attribute of its owner (RemoteLoader): the validated option of the same name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, loader: None, owner: type) -> Option[T]: ...
    @overload
    def __get__(self, loader: _HasOptions, owner: type) -> T: ...

    def __get__(self, loader: _HasOptions | None, owner: type) -> T | Option[T]:
        if loader is None:
            return self
        return getattr(loader.options, self.name)

    def __set__(self, loader: _HasOptions, value: T) -> None:
        raise AttributeError(f"RemoteLoader.{self.name} is fixed when it is made: make another loader")


class _Arguments:
    """RemoteLoader's arguments, each taken once by name; ``done`` refuses what is left."""

    def __init__(self, arguments: Mapping[str, Any]):
        self._left = dict(arguments)

    def take(self, name: str) -> Any:
        try:
            return self._left.pop(name)
        except KeyError:
            raise TypeError(f"LoaderOptions.from_arguments: RemoteLoader passed no {name!r}") from None

    def done(self) -> None:
        if self._left:
            raise TypeError(f"LoaderOptions.from_arguments: no check for {', '.join(sorted(self._left))}")


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name}={value!r}: expected seconds >= 0")
    return value


def check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    """``value`` as an int in [low, high) (numpy ints too; not bools, floats or strings)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r}: expected an int")
    value = int(value)
    if value < low or (high is not None and value >= high):
        bound = f">= {low}" if high is None else f"in {low}..{high - 1}"
        raise ValueError(f"{name}={value!r}: expected an int {bound}")
    return value


def _size(image_size: Any) -> tuple[int, int]:
    size = (image_size, image_size) if isinstance(image_size, (int, np.integer)) else image_size
    if (
        not isinstance(size, Sequence)
        or len(size) != 2
        or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and 0 < v <= 65535 for v in size)
    ):
        raise ValueError(f"image_size={image_size!r}: expected an int or (height, width), 1..65535 each")
    return int(size[0]), int(size[1])


def _setup(pipeline: Any, size: tuple[int, int]) -> loader_pb2.Setup:
    h, w = size
    if isinstance(pipeline, str):
        if pipeline == CUSTOM_PIPELINE:
            raise ValueError("pipeline='custom': pass the albumentations pipeline itself (A.Compose or A.to_dict)")
        return loader_pb2.Setup(pipeline=pipeline, height=h, width=w)
    if isinstance(pipeline, dict):
        document = pipeline
    elif type(pipeline).__module__.startswith("albumentations"):
        import albumentations as A  # only when the user already uses it

        document = A.to_dict(pipeline)
    else:
        raise ValueError(
            f"pipeline={pipeline!r}: expected 'train', 'eval', an albumentations pipeline or its A.to_dict() dictionary"
        )
    return loader_pb2.Setup(pipeline=CUSTOM_PIPELINE, height=h, width=w, albumentations_json=json.dumps(document))


def _fields(fields: Any) -> tuple[str, ...] | None:
    if fields is None:
        return None
    if isinstance(fields, str) or not isinstance(fields, Iterable):
        raise ValueError(f"fields={fields!r}: expected a list of field names, e.g. ['bboxes', 'bbox_labels'], or None")
    names = tuple(dict.fromkeys(fields))
    try:
        for name in names:
            tg.check_field_name(name)
    except tg.TargetError as exc:
        raise ValueError(f"fields={fields!r}: {exc}") from None
    if len(names) > tg.MAX_FIELDS:
        raise ValueError(f"fields={fields!r}: at most {tg.MAX_FIELDS} fields")
    return names


def _rank_world(rank: Any, world_size: Any) -> tuple[int | None, int | None]:
    """The rank and world size given (None: read from torch.distributed when needed, ``ranks.py``)."""
    world_size = None if world_size is None else check_int("world_size", world_size, 1)
    return (None if rank is None else check_int("rank", rank, 0, world_size)), world_size


def _device(device: Any) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={str(device)!r} but torch.cuda.is_available() is False: this torch build "
                f"({torch.__version__}) has no usable GPU here; pass device='cpu'"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(device)!r}: expected 'cpu' or 'cuda'")
    return device


def _normalize(normalize: Normalize | None) -> tuple[list[float], list[float]] | None:
    if normalize is None:
        return None
    try:
        mean, std = normalize
        mean, std = [float(v) for v in mean], [float(v) for v in std]
    except (TypeError, ValueError):
        raise ValueError(f"normalize={normalize!r}: expected (mean, std), three floats each") from None
    if len(mean) != 3 or len(std) != 3 or any(s <= 0 for s in std) or not all(map(math.isfinite, mean + std)):
        raise ValueError(f"normalize={normalize!r}: expected (mean, std), three floats each, std > 0")
    if any(abs(v) > 1 for v in mean) or any(v > 1 for v in std):
        raise ValueError(
            f"normalize={normalize!r}: mean and std are on the 0..1 scale (images are divided "
            f"by 255 first), e.g. ImageNet's ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)); "
            f"divide 0..255 figures by 255"
        )
    return mean, std


def _wire(wire: Any) -> str:
    """The wire encoding (protos.wire), which this process must be able to decode."""
    if not isinstance(wire, str) or wire not in WIRES:
        raise ValueError(f"wire={wire!r}: expected one of {', '.join(WIRES)} (jpeg95 is lossy)")
    why = missing(wire)
    if why:
        raise ValueError(why)
    return wire


def _receiver(receiver: Any, device: torch.device) -> Literal["thread", "process"]:
    """The receiver kind: "process" by default on CUDA (where Linux allows it), else "thread"."""
    if receiver is None:
        receiver = "process" if device.type == "cuda" and hasattr(os, "memfd_create") else "thread"
    if receiver not in RECEIVERS:
        raise ValueError(f"receiver={receiver!r}: expected one of {', '.join(RECEIVERS)}")
    if receiver == "process" and not hasattr(os, "memfd_create"):
        raise ValueError("receiver='process' needs Linux (os.memfd_create); use receiver='thread'")
    return "process" if receiver == "process" else "thread"
