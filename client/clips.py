"""Video clips on the client side: the clip options, checked once, and a batch's pixels as clips.

A clip travels as one image whose rows are its frames one under another (protos/loader.proto,
``Setup.clip_frames``): uint8 [B, K * T * H, W, C] as received, or normalized [B, C, K * T * H, W].
``as_video`` gives the same memory the shape of clips, without a copy: uint8 [B, T, H, W, C];
normalized [B, C, T, H, W] ("BCTHW", torchvision's and PyTorchVideo's video models) or
[B, T, C, H, W] ("BTCHW"); with ``clips_per_video`` K > 1 a K axis after B.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from remoteloader.client.option_groups import _Group, option

VIDEO_LAYOUTS = ("BCTHW", "BTCHW")
VIDEO_PIPELINES = {"train": "video-train", "eval": "video-eval"}  # the image presets' clip counterparts
MAX_CLIP_FRAMES = 512  # as the servers' (server/video_pipelines.py)
MAX_FRAME_STRIDE = 1024
MAX_CLIPS_PER_VIDEO = 64


@dataclass(frozen=True)
class ClipOptions:
    """What a clip is: ``frames`` (T) frames ``stride`` source frames apart, ``clips`` (K) per video,
    and the layout of normalized batches."""

    frames: int
    stride: int = 1
    clips: int = 1
    layout: str = "BCTHW"

    def __post_init__(self):
        for name, value, most in (
            ("clip_frames", self.frames, MAX_CLIP_FRAMES),
            ("frame_stride", self.stride, MAX_FRAME_STRIDE),
            ("clips_per_video", self.clips, MAX_CLIPS_PER_VIDEO),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= most:
                raise ValueError(f"{name}={value!r}: expected an int in 1..{most}")
        if self.layout not in VIDEO_LAYOUTS:
            raise ValueError(f"video_layout={self.layout!r}: expected one of {', '.join(VIDEO_LAYOUTS)}")

    @classmethod
    def of(cls, clip_frames: Any, frame_stride: Any, clips_per_video: Any, video_layout: Any) -> ClipOptions | None:
        """The clip options RemoteLoader was given (None: images, and the clip arguments left at
        their defaults; ValueError naming a clip argument given without ``clip_frames``)."""
        if clip_frames is None:
            given = [
                n
                for n, v, d in (
                    ("frame_stride", frame_stride, 1),
                    ("clips_per_video", clips_per_video, 1),
                    ("video_layout", video_layout, "BCTHW"),
                )
                if v != d
            ]
            if given:
                raise ValueError(f"{', '.join(given)} given without clip_frames: clips need clip_frames=T")
            return None
        return cls(clip_frames, frame_stride, clips_per_video, video_layout)

    @property
    def rows(self) -> int:
        """Frames one sample carries, one under another: K x T."""
        return self.frames * self.clips


@dataclass(frozen=True)
class VideoOptions(_Group):
    """RemoteLoader's clip arguments (checked together: ``ClipOptions``)."""

    TITLE: ClassVar[str] = "Video (docs/video.md; servers that serve videos)"
    clip_frames: int | None = option(
        None,
        'Frames per clip, T (None: images). Each sample is then a video\'s clip: batches are dicts with "video" '
        "uint8 [B, T, H, W, C] (``image_size`` is a frame's), with ``normalize`` ``dtype`` [B, C, T, H, W], "
        '"label", and "ids" with ``return_ids``. ``pipeline`` "train" and "eval" become "video-train" (one '
        'random clip per video per epoch, random resized crop + flip drawn once per clip) and "video-eval" '
        '(the centre clip, resized and centre-cropped as "eval").',
    )
    frame_stride: int = option(1, "Source frames between a clip's frames, S.")
    clips_per_video: int = option(
        1,
        'Clips per video, K: "video-eval" spreads them uniformly, "video-train" draws each; with K > 1 "video" '
        "has a K axis after B.",
    )
    video_layout: str = option("BCTHW", 'Normalized clips as ``"BCTHW"`` or ``"BTCHW"``.')

    def _relate(self) -> None:
        _ = self.clip  # (checks them together)

    @property
    def clip(self) -> ClipOptions | None:
        """What a clip is (None: images)."""
        return ClipOptions.of(self.clip_frames, self.frame_stride, self.clips_per_video, self.video_layout)


def frame_indices(per_sample: list, clip: ClipOptions, device: torch.device) -> torch.Tensor:
    """The batch's clips' source frames as one int64 tensor [B, T] ([B, K, T]); -1 for a sample that
    failed (on_error given a callable keeps it, as zeros)."""
    shape = (clip.frames,) if clip.clips == 1 else (clip.clips, clip.frames)
    rows = [torch.full(shape, -1, dtype=torch.int64) if f is None else f.reshape(shape) for f in per_sample]
    return torch.stack(rows).to(device) if rows else torch.zeros((0, *shape), dtype=torch.int64, device=device)


def as_video(images: torch.Tensor, clip: ClipOptions, normalized: bool) -> torch.Tensor:
    """A received batch's pixels as clips (a view: no copy for uint8 or BCTHW)."""
    t, k = clip.frames, clip.clips
    if not normalized:  # uint8 [B, K*T*H, W, C]
        b, rows, w, c = images.shape
        shape = (b, t, rows // (k * t), w, c) if k == 1 else (b, k, t, rows // (k * t), w, c)
        return images.view(shape)
    b, c, rows, w = images.shape  # [B, C, K*T*H, W]
    h = rows // (k * t)
    video = images.unflatten(2, (t, h) if k == 1 else (k, t, h))  # [B, C, T, H, W] / [B, C, K, T, H, W]
    if k > 1:
        video = video.movedim(2, 1)  # [B, K, C, T, H, W]
    if clip.layout == "BTCHW":
        video = video.movedim(-3, -4)  # C after T
    return video
