"""Clip pipelines: a video sample's clip(s) decoded (video_decode) and augmented with ONE draw of an
albumentations pipeline for all of a clip's frames (albumentations 2's ``images=`` target).

Presets: ``"video-train"`` (random resized crop + flip, as "train") and ``"video-eval"`` (the
"eval" geometry: resize to cover size / 0.875, centre crop), or an operator-allowed custom
albumentations pipeline, built and seeded as an image pipeline is (``pipelines.Pipeline``: the
same per-transform generators, reseeded per sample from the sample's seed). The clip's frame
numbers come from the sample seed too (``video_decode.clip_frames``): a training clip at a
random start, the eval clip(s) centred or spread.

Decoding costs least where the frames are converted small: with "video-train" the crop is drawn
first, on the video's full-size frame, and only that region of each kept frame is resized and
converted to RGB, at the output size (``video_decode.region_to_rgb``); with "video-eval" the
frames are converted (swscale) straight to the size the first resize gives. The output is
[K * T, H, W, 3] as one [K * T * H, W, 3] image (protos/loader.proto, Setup.clip_frames): the
rows of the clips' frames, one under another.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import NamedTuple

import albumentations as A
import numpy as np

from remoteloader.protos import CUSTOM_PIPELINE
from remoteloader.protos import targets as tg
from remoteloader.server import video_decode as vd
from remoteloader.server.pipelines import Pipeline, PipelineError, PipelineSpec

VIDEO_PRESETS = ("video-train", "video-eval")
FRAME_INDICES = tg.FRAME_INDICES  # the field of a clip's source frames: int64 [T] (or [K, T]), 0-based
MAX_CLIP_FRAMES = 512  # frames of one clip
MAX_FRAME_STRIDE = 1024
MAX_CLIPS_PER_VIDEO = 64
_IMAGE_PRESET = {"video-train": "train", "video-eval": "eval"}
MAX_KEPT_BYTES = 64 << 20  # of the video indexes a worker keeps: about 100,000 constant-rate videos


class _Regular(NamedTuple):
    """A constant frame rate's index, kept in about 600 bytes with its key (measured) whatever its
    length: frame k at ``first + k * step``; ``keys``: the keyframes' numbers."""

    first: int
    step: int
    frames: int
    keys: np.ndarray
    time_base: tuple[int, int]
    height: int
    width: int


def _pack(index: vd.VideoIndex) -> vd.VideoIndex | _Regular:
    pts = index.pts
    step = int(pts[1] - pts[0]) if len(pts) > 1 else 1
    if len(pts) > 1 and not np.all(np.diff(pts) == step):
        return index  # a variable frame rate: kept whole
    keys = np.flatnonzero(index.keyframe).astype(np.int32)
    return _Regular(int(pts[0]), step, len(pts), keys, index.time_base, index.height, index.width)


def _unpack(kept: vd.VideoIndex | _Regular) -> vd.VideoIndex:
    if isinstance(kept, vd.VideoIndex):
        return kept
    keyframe = np.zeros(kept.frames, bool)
    keyframe[kept.keys] = True
    pts = kept.first + kept.step * np.arange(kept.frames, dtype=np.int64)
    return vd.VideoIndex(pts, keyframe, kept.time_base, kept.height, kept.width)


def _kept_bytes(kept: vd.VideoIndex | _Regular) -> int:
    return 600 + (kept.keys.nbytes if isinstance(kept, _Regular) else 9 * len(kept))


class _RecentIndexes:
    """A process's recently read video indexes (reading a video's packets costs a twentieth to a
    tenth of a clip's decode, more for a long video), up to ``MAX_KEPT_BYTES``, by which bytes the
    video is: read from a file, (path, offset, length, mtime_ns); else a digest of its bytes
    (which costs a twentieth of a 640x480 clip's decode). A constant frame rate's index is kept
    as its rate and keyframes (``_Regular``), so a worker keeps those of a Kinetics-sized set."""

    def __init__(self):
        self._kept: OrderedDict[object, vd.VideoIndex | _Regular] = OrderedDict()
        self._bytes = 0

    def get(self, data: bytes, identity: tuple | None = None) -> vd.VideoIndex:
        key = identity if identity is not None else hashlib.blake2b(data, digest_size=16).digest()
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            return _unpack(kept)
        index = vd.index_video(data)
        kept = self._kept[key] = _pack(index)
        self._bytes += _kept_bytes(kept)
        while self._bytes > MAX_KEPT_BYTES and len(self._kept) > 1:
            self._bytes -= _kept_bytes(self._kept.popitem(last=False)[1])
        return index


_INDEXES = _RecentIndexes()  # (one a worker process: its pipelines share it)


def is_video(spec: PipelineSpec) -> bool:
    """Whether a spec asks for clips (a video preset, or any pipeline with clip_frames)."""
    return spec.clip_frames > 0 or spec.name in VIDEO_PRESETS


def check_clip(spec: PipelineSpec) -> None:
    """PipelineError unless the spec's clip parameters are in bounds and its height is whole frames."""
    if spec.name in VIDEO_PRESETS and spec.clip_frames < 1:
        raise PipelineError(f"pipeline {spec.name!r} makes clips: ask for clip_frames (1..{MAX_CLIP_FRAMES})")
    for name, value, most in (
        ("clip_frames", spec.clip_frames, MAX_CLIP_FRAMES),
        ("frame_stride", spec.frame_stride, MAX_FRAME_STRIDE),
        ("clips_per_video", spec.clips_per_video, MAX_CLIPS_PER_VIDEO),
    ):
        if not 1 <= value <= most:
            raise PipelineError(f"{name}={value}: this server offers 1..{most}")
    frames = spec.clip_frames * spec.clips_per_video
    if spec.height % frames:
        raise PipelineError(
            f"height={spec.height} is not clips_per_video x clip_frames ({frames}) x a frame height "
            f"(protos/loader.proto, Setup.clip_frames)"
        )


class VideoPipeline:
    """Decode + augment one video sample into its clips: uint8 [K * T * H, W, 3].

    Args:
        spec: The stream's spec (its height: K x T x the frame height).
        allow_custom / max_pixels: As for ``pipelines.Pipeline``.
        threads: FFmpeg threads per decoder (1: the workers are the parallelism, one per core).
    """

    def __init__(self, spec: PipelineSpec, allow_custom: bool = False, max_pixels: int = 100_000_000, threads: int = 1):
        check_clip(spec)
        if spec.name not in VIDEO_PRESETS and spec.name != CUSTOM_PIPELINE:
            raise PipelineError(
                f"pipeline {spec.name!r} with clip_frames: this server's clip pipelines are "
                f"{', '.join(VIDEO_PRESETS + ((CUSTOM_PIPELINE,) if allow_custom else ()))}"
            )
        self.spec = spec
        self.frames = spec.clip_frames * spec.clips_per_video
        self.height, self.width = spec.height // self.frames, spec.width
        self.max_pixels = max_pixels
        self.threads = threads
        name = _IMAGE_PRESET.get(spec.name, spec.name)
        frame_spec = PipelineSpec(name, self.height, self.width, spec.albumentations_json)
        self.image = Pipeline(frame_spec, allow_custom, max_pixels)  # its compose, reseeded per sample
        transforms = list(self.image.compose.transforms)
        first = transforms[0] if transforms else None
        self._crop = first if isinstance(first, A.RandomResizedCrop) and first.p >= 1 else None
        self._rest = A.Compose(transforms[1:]) if self._crop is not None else None
        self._cover = None  # "video-eval": the size its first resize covers (height, width)
        if spec.name == "video-eval":
            self._cover = tuple(first.max_size_hw)  # type: ignore[union-attr]

    def __call__(self, data: bytes, seed: int, fused: bool = True, verified: bool = False) -> np.ndarray:
        """The sample's clips from the video's bytes, as rows (``fused`` False: full-size frames
        through the whole compose, as a user's plain pipeline; ``verified`` is not used)."""
        return self.render(data, seed, fused)[0]

    def render(
        self, data: bytes, seed: int, fused: bool = True, identity: tuple | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The sample's clips as rows [K * T * H, W, 3], and their source frames [K, T] (int64);
        ``identity``: which bytes of which file ``data`` is, when read from one (``_RecentIndexes``)."""
        index = _INDEXES.get(data, identity)
        if index.height * index.width > self.max_pixels:
            raise vd.VideoError(f"frames of {index.width}x{index.height} are over max_pixels={self.max_pixels}")
        numbers = self.frame_numbers(index, seed)
        return self.clips(data, index, seed, fused, numbers).reshape(-1, self.width, 3), numbers

    def frame_numbers(self, index: vd.VideoIndex, seed: int) -> np.ndarray:
        """The source frames of the sample's clips: [K, T] (train: drawn from the seed; else spread)."""
        spec = self.spec
        train = spec.name == "video-train"
        return vd.clip_frames(
            len(index), spec.clip_frames, spec.frame_stride, seed=seed if train else None, clips=spec.clips_per_video
        )

    def clips(
        self, data: vd.Source, index: vd.VideoIndex, seed: int, fused: bool = True, numbers: np.ndarray | None = None
    ) -> np.ndarray:
        """uint8 [K * T, H, W, 3]: each clip decoded and put through one draw of the pipeline."""
        numbers = self.frame_numbers(index, seed) if numbers is None else numbers
        out = np.empty((self.frames, self.height, self.width, 3), np.uint8)
        t = self.spec.clip_frames
        for k, clip in enumerate(numbers):
            order = np.argsort(clip, kind="stable")  # (increasing already; kept general)
            self.image.reseed(seed if k == 0 else seed + k)
            out[k * t : (k + 1) * t] = self._clip(data, index, clip[order], fused)
        return out

    def _clip(self, data: vd.Source, index: vd.VideoIndex, numbers: np.ndarray, fused: bool) -> np.ndarray:
        height, width = index.height, index.width
        if fused and self._crop is not None:
            params = self._crop.get_params()
            params["shape"] = (height, width, 3)
            coords = self._crop.get_params_dependent_on_data(params, {})["crop_coords"]
            region = vd.decode_frames(data, index, numbers, (self.height, self.width), self.threads, crop=coords)
            assert self._rest is not None
            return self._rest(images=region)["images"] if self._rest.transforms else region
        size = None
        if fused and self._cover is not None:
            scale = max(self._cover[0] / height, self._cover[1] / width)
            if scale < 1:  # as SmallestMaxSize rounds it; the compose's resize then keeps the size
                size = (max(1, round(height * scale)), max(1, round(width * scale)))
        frames = vd.decode_frames(data, index, numbers, size, self.threads)
        return self.image.compose(images=frames)["images"]

    def check_output(self) -> None:
        """Runs the pipeline on test clips; PipelineError unless every frame comes out at the size asked."""
        rng = np.random.default_rng(0)
        for shape in ((self.height * 2 + 7, self.width * 2 + 3), (61, 97)):
            frames = rng.integers(0, 256, (2, *shape, 3), dtype=np.uint8)
            self.image.reseed(0)
            try:
                out = np.asarray(self.image.compose(images=frames)["images"])
            except Exception as exc:
                raise PipelineError(
                    f"the pipeline fails on frames of {shape[0]}x{shape[1]} ({type(exc).__name__}: {exc}); "
                    f"it must accept any frame size, e.g. start with a Resize or RandomResizedCrop"
                ) from None
            if out.shape != (2, self.height, self.width, 3) or out.dtype != np.uint8:
                raise PipelineError(
                    f"the pipeline turns a clip of {shape[0]}x{shape[1]} frames into {out.shape[1:]} {out.dtype}; "
                    f"each frame must come out uint8 {self.height}x{self.width}x3"
                )


def make_pipeline(spec: PipelineSpec, allow_custom: bool, max_pixels: int, region_decode: bool = True):
    """The pipeline a spec asks for: a clip pipeline for clips, else an image ``Pipeline``."""
    if is_video(spec):
        return VideoPipeline(spec, allow_custom, max_pixels)
    return Pipeline(spec, allow_custom, max_pixels, region_decode)
