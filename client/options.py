"""RemoteLoader's options: seven frozen groups, each field declaring its default, doc and check.

The groups are the sections of RemoteLoader's docstring, which is made from the fields' docs:
``BatchOptions``, ``OutputOptions``, ``FlowOptions``, ``ConnectionOptions``, ``JobOptions``,
``VideoOptions`` and ``SecurityOptions`` (in ``option_groups.py``, but ``OutputOptions``, which
needs torch, here, and ``VideoOptions`` in ``clips.py``). A
group checks its fields when it is made (ValueErrors name the argument, the value and what was
expected) and keeps the normalized values; the engine takes ``FlowOptions`` and the links
``ConnectionOptions`` and ``SecurityOptions`` as they are. ``LoaderOptions`` holds the seven and
what they make together (the streams' Setup).

Adding an option: one ``option(default, doc, check)`` field in its group. RemoteLoader's
signature, its docstring and (with ``read_back=True``) its read-only attribute come from it;
``tests/test_options.py`` checks that they do.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from remoteloader.client.clips import VIDEO_PIPELINES, ClipOptions, VideoOptions
from remoteloader.client.normalize import Normalize
from remoteloader.client.option_groups import (
    UINT64,
    BatchOptions,
    ConnectionOptions,
    ErrorHandler,
    FlowOptions,
    JobOptions,
    OnError,
    ReceiverKind,
    SecurityOptions,
    Wire,
    _batch_format,
    _fields,
    _flag,
    _Group,
    _on_error,
    _receiver,
    check_int,
    option,
)
from remoteloader.protos import CUSTOM_PIPELINE, limits, loader_pb2
from remoteloader.protos import targets as tg

__all__ = [
    "UINT64",
    "BatchOptions",
    "ConnectionOptions",
    "FlowOptions",
    "JobOptions",
    "LoaderOptions",
    "OnError",
    "OutputOptions",
    "ReceiverKind",
    "SecurityOptions",
    "Wire",
    "check_int",
]

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _device(name: str, device: Any) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{name}={str(device)!r} but torch.cuda.is_available() is False: this torch build "
                f"({torch.__version__}) has no usable GPU here; pass device='cpu'"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"{name}={str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}={str(device)!r}: expected 'cpu' or 'cuda'")
    return device


def _normalize(name: str, normalize: Normalize | None) -> tuple[list[float], list[float]] | None:
    if normalize is None:
        return None
    try:
        mean, std = normalize
        mean, std = [float(v) for v in mean], [float(v) for v in std]
    except (TypeError, ValueError):
        raise ValueError(f"{name}={normalize!r}: expected (mean, std), three floats each") from None
    if len(mean) != 3 or len(std) != 3 or any(s <= 0 for s in std) or not all(map(math.isfinite, mean + std)):
        raise ValueError(f"{name}={normalize!r}: expected (mean, std), three floats each, std > 0")
    if any(abs(v) > 1 for v in mean) or any(v > 1 for v in std):
        raise ValueError(
            f"{name}={normalize!r}: mean and std are on the 0..1 scale (images are divided "
            f"by 255 first), e.g. ImageNet's ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)); "
            f"divide 0..255 figures by 255"
        )
    return mean, std


def _dtype(name: str, dtype: Any) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"{name}={dtype}: expected torch.float32, bfloat16, float16 or float64")
    return dtype


@dataclass(frozen=True)
class OutputOptions(_Group):
    """What the training loop gets, and where."""

    TITLE: ClassVar[str] = "Output"
    device: torch.device = option("cpu", '``"cpu"`` or ``"cuda[:i]"``.', _device, read_back=True)
    normalize: tuple[list[float], list[float]] | None = option(
        None,
        "(mean, std) per channel on the 0..1 scale; when given, images come out as ``dtype`` NCHW "
        "(channels_last memory) normalized; otherwise uint8 NHWC.",
        _normalize,
        read_back=True,
    )
    dtype: torch.dtype = option(torch.float32, "Floating dtype of normalized images.", _dtype, read_back=True)
    return_ids: bool = option(
        False,
        'Yield (images, labels, ids) with the global sample ids; with dict batches, the dict holds "ids".',
        _flag,
        read_back=True,
    )
    fields: tuple[str, ...] | None = option(
        None,
        'The target fields to receive (docs/targets.md): e.g. ``["bboxes", "bbox_labels"]``. None: every field '
        "the servers' shards carry. When that is more than the class ``label`` (or fields is given), each batch "
        'is a dict of "images" and those fields: "label" a tensor, "mask" uint8 [B, H, W] (zeros for a sample '
        "without one), each other field a list of per-sample tensors (empty, or None for an extra array, where a "
        "sample has none), all on ``device``; otherwise batches are (images, labels) tuples as for "
        "classification. A field that no server's shards carry is an error naming what carries it (e.g. COCO "
        "servers' ``--coco-masks``), except ``orig_size`` and ``to_orig``, which every server computes.",
        _fields,
        read_back=True,
    )
    batch_format: str | None = option(
        None,
        'None: batches as above; ``"torchvision"``: (images, targets) as torchvision\'s detection models and '
        "references take them: ``images`` a list of float [3, H, W] tensors on the 0..1 scale (or normalized, "
        'with ``normalize``), ``targets`` a list of dicts with "boxes", "labels", "image_id", "area", "iscrowd", '
        '"masks" (with that field) and the other fields asked for (docs/targets.md, "Detection with torchvision").',
        _batch_format,
        read_back=True,
    )
    on_error: ErrorHandler = option(
        "raise",
        'What to do with samples a server could not decode: "raise", "warn" or "skip" (the batch comes without '
        "them), or a callable taking a list of SampleFailure that returns nothing (then the batch is kept as is, "
        "zeros in place).",
        _on_error,
        read_back=True,
    )
    receiver: ReceiverKind | None = option(
        None,
        'Where the batches are received: ``"process"``, a child process that writes them into shared memory '
        "(pinned on CUDA), so the training process spends almost no CPU and none of its GIL on input, or "
        '``"thread"``, an I/O thread of this process (no child; one copy less on the CPU). None: "process" on '
        'CUDA, "thread" on the CPU. With "process", (prefetch + 2) batch slots of shared memory replace the '
        "host buffers of ``prefetch``.",
        _receiver,
        read_back=True,
    )

    def _relate(self) -> None:
        if self.receiver is None:  # "process" by default on CUDA (where Linux allows it)
            cuda = self.device.type == "cuda" and hasattr(os, "memfd_create")
            object.__setattr__(self, "receiver", ReceiverKind.PROCESS if cuda else ReceiverKind.THREAD)


GROUPS: tuple[type[_Group], ...] = (
    BatchOptions,
    OutputOptions,
    FlowOptions,
    ConnectionOptions,
    JobOptions,
    VideoOptions,
    SecurityOptions,
)


@dataclass(frozen=True)
class LoaderOptions:
    """A RemoteLoader's options: its seven groups, and the Setup message they make for the streams.

    ``served``: the fields the streams ask for when ``output.fields`` is None (what the servers'
    shards carry, learned at start: ``with_fields``)."""

    batches: BatchOptions
    output: OutputOptions
    flow: FlowOptions
    connection: ConnectionOptions
    jobs: JobOptions
    video: VideoOptions
    security: SecurityOptions
    served: tuple[str, ...] | None = None
    setup: loader_pb2.Setup = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "setup", self._make_setup())

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> LoaderOptions:
        """The groups made from RemoteLoader's keyword arguments (defaults for those not given);
        TypeError for a name no group has, ValueError naming the first bad value."""
        unknown = set(arguments) - set(ARGUMENTS)
        if unknown:
            raise TypeError(f"RemoteLoader() got unexpected keyword argument(s): {', '.join(sorted(unknown))}")
        groups: dict[str, Any] = {}
        for group in GROUPS:
            names = {f.name for f in dataclasses.fields(group)}
            groups[_GROUP_NAMES[group]] = group(**{k: v for k, v in arguments.items() if k in names})
        return cls(**groups)

    def _make_setup(self) -> loader_pb2.Setup:
        """The pipeline, the output size, the fields, the wire and the job, as the servers are told."""
        h, w = self.sample_size
        pipeline = self.batches.pipeline
        clip = self.clip
        if clip is not None and isinstance(pipeline, str):
            pipeline = VIDEO_PIPELINES.get(pipeline, pipeline)
        if isinstance(pipeline, str):
            setup = loader_pb2.Setup(pipeline=pipeline, height=h, width=w)
        else:
            setup = loader_pb2.Setup(
                pipeline=CUSTOM_PIPELINE, height=h, width=w, albumentations_json=json.dumps(pipeline)
            )
        if clip is not None:  # a clip travels as one image of its frames' rows (protos/loader.proto)
            setup.clip_frames, setup.frame_stride, setup.clips_per_video = clip.frames, clip.stride, clip.clips
        setup.wire = self.connection.wire.value
        fields = self.output.fields if self.output.fields is not None else self.served
        if fields is not None:  # what the streams ask for; "label" always travels
            setup.fields.extend(f for f in fields if f != tg.LABEL)
        if self.jobs.job is not None:
            setup.job = self.jobs.job
        setup.exclusive = not self.jobs.share
        return setup

    def with_fields(self, fields: Sequence[str]) -> LoaderOptions:
        """These options with the streams asking for ``fields`` (when ``output.fields`` is None)."""
        return dataclasses.replace(self, served=tuple(fields))

    @property
    def sampler(self) -> Iterable[int] | None:
        """The sampler given (``loader.options.sampler``, as docs/user-guide.md says)."""
        return self.batches.sampler

    @property
    def masks(self) -> bool:
        """Whether batches come with masks (the streams ask for the "mask" field)."""
        return tg.MASK in self.setup.fields

    @property
    def batch_bytes(self) -> int:
        """Bytes of one received batch (uint8 NHWC, then the masks, uint8 NHW)."""
        h, w = self.sample_size
        return self.batches.batch_size * limits.sample_bytes(h, w, self.masks)

    @property
    def clip(self) -> ClipOptions | None:
        """Video clips (client/clips.py); None: images."""
        return self.video.clip

    @property
    def sample_size(self) -> tuple[int, int]:
        """(rows, width) of one sample as it travels: the image size, or a clip's K x T frames' rows."""
        h, w = self.batches.image_size
        clip = self.clip
        return (h * clip.rows if clip is not None else h), w

    @property
    def batch_buffers(self) -> int:
        """Batch buffers a loader receives into: ``prefetch`` + 2 (RemoteLoader's docstring gives
        the memory they take). The receiver process's shared slots, the CUDA delivery's pinned
        pool and the host delivery's pool of free batches each hold this many."""
        return self.flow.prefetch + 2


_GROUP_NAMES = {g: f.name for g, f in zip(GROUPS, dataclasses.fields(LoaderOptions))}
ARGUMENTS: dict[str, type[_Group]] = {f.name: g for g in GROUPS for f in dataclasses.fields(g)}


def signature(address: inspect.Parameter) -> inspect.Signature:
    """RemoteLoader's signature: ``address``, then every group field, keyword-only, with its default."""
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), address]
    for group in GROUPS:
        for f in dataclasses.fields(group):
            parameters.append(
                inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
            )
    return inspect.Signature(parameters)


def docstring(head: str, width: int = 100) -> str:
    """RemoteLoader's docstring: ``head``, then a section per group, each field's doc and default."""
    lines = [head.rstrip(), ""]
    for group in GROUPS:
        lines.append(f"    {group.TITLE}:")
        for f in dataclasses.fields(group):
            default = f.default
            shown = "torch.float32" if default is torch.float32 else repr(default)
            text = f"{f.name}: {f.metadata['doc']} Default {shown}."
            lines += textwrap.wrap(
                text, width, initial_indent=" " * 8, subsequent_indent=" " * 12, break_on_hyphens=False
            )
    return "\n".join(lines) + "\n    "


def read_back(options: LoaderOptions, name: str) -> Any:
    """The option ``name`` (a field of one group), as RemoteLoader's read-only attribute gives it."""
    group = ARGUMENTS[name]
    return getattr(getattr(options, _GROUP_NAMES[group]), name)


READ_BACK = tuple(f.name for g in GROUPS for f in dataclasses.fields(g) if f.metadata["read_back"])
