"""Augmentation pipelines: presets and client-sent albumentations pipelines, fused with decoding.

A pipeline is an ``A.Compose`` whose randomness is reseeded for every sample from a 64-bit
seed derived from (seed, epoch, shard, index), so the same order gives the same pixels on
any server. When its first transform is a random-resized crop, the crop is chosen on the
JPEG header's dimensions and the JPEG is decoded at the smallest DCT scale that keeps the
crop at least the output size, only the crop's region (with the rest of the file read too, as
a whole decode reads it, until the file is known to decode: decode.decode_crop); a first
resize likewise decodes no larger than it needs. A first fit
(Longest/SmallestMaxSize) followed by a RandomScale, as the detection and segmentation
training presets start, resizes the image once, to the size the two give (``DeferredFit``).
The rest of the pipeline runs unchanged in albumentations. The fused and the plain path
draw the same random numbers, so they give the same pixels up to resampling rounding.

Targets that move with the pixels (boxes, keypoints, the masks) go through the same
``A.Compose`` as the image (``Pipeline.with_targets``), with albumentations' own box and
keypoint processors, so they are exactly albumentations' result. Where the pipeline starts
with a random-resized crop, that crop (``RegionCrop``) draws its window as albumentations
does and returns the region the fused decode made of it, while the targets go through the
crop and the rest unchanged. Targets that do not move (``labels``, extra arrays) pass through.
The geometry (``orig_size``, ``to_orig``) is measured by two reference points that go through
the keypoint processor with the sample's own.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # never phone home from a server


def _import_albumentations_without_torch() -> None:
    """Imports albumentations without its PyTorch helpers (ToTensorV2), which it loads whenever
    torch imports: a server never uses them, and torch would cost each server process (its
    main one and the decode workers' forkserver) about 1.2 s of CPU and its memory at start,
    wherever torch is installed. torch is held back only during this import (``None`` in
    ``sys.modules`` makes it raise ImportError, which albumentations expects); code that asks
    for torch later (a ``--source`` plugin) imports it as usual. Where torch is loaded already
    (a training process that uses the server's modules), albumentations is imported as is."""
    if "torch" in sys.modules or "albumentations" in sys.modules:
        return
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        import albumentations  # noqa: F401
    finally:
        del sys.modules["torch"]


_import_albumentations_without_torch()
import albumentations as A  # noqa: E402
import cv2  # noqa: E402
import numpy as np  # noqa: E402

from remoteloader.protos import CUSTOM_PIPELINE  # noqa: E402
from remoteloader.server import decode as dec  # noqa: E402
from remoteloader.server import targets as tg  # noqa: E402
from remoteloader.server.seeds import stream_seeds  # noqa: E402

PRESETS = ("train", "eval", "detection-train", "detection-eval", "segmentation-train", "segmentation-eval")
EVAL_CROP_FRACTION = 0.875
PAD_FILL = 114  # grey padding of letterboxed and scale-jittered images (as YOLO's loaders pad)
# What a stream's boxes and keypoints go through, unless a custom pipeline brings its own.
# Boxes a crop leaves less than a pixel wide or high are dropped with their labels (a
# detector cannot learn from them; torchvision's refuses boxes of no width).
BBOX_PARAMS = {"format": "pascal_voc", "label_fields": [tg.BBOX_LABELS], "clip": True, "min_width": 1, "min_height": 1}
KEYPOINT_PARAMS = {"format": "xy", "remove_invisible": False}
MOVING = (tg.BBOXES, tg.BBOX_LABELS, tg.KEYPOINTS, tg.MASK, tg.MASKS)  # fields transformed with the pixels
THROUGH_COMPOSE = MOVING + tg.RENDERED  # fields that need the whole compose (not the fused decode)
MAX_PIPELINE_JSON = 64 * 1024  # bytes of UTF-8
MAX_TRANSFORMS = 100  # in a custom pipeline, nested composes included


@dataclass(frozen=True)
class PipelineSpec:
    """What a client asked for: a preset or a serialized albumentations pipeline, and a size."""

    name: str
    height: int
    width: int
    albumentations_json: str = ""
    fields: tuple[str, ...] = ()  # target fields the stream asked for, "label" left out
    wire: str = "raw"  # how the pixels travel (protos.wire): it changes nothing in the pipeline
    # Video clips (server/video_pipelines.py): height is then clips_per_video x clip_frames x a frame's
    clip_frames: int = 0
    frame_stride: int = 1
    clips_per_video: int = 1


class PipelineError(ValueError):
    """A pipeline request the server cannot honour; the message lists what it offers."""


def build_compose(spec: PipelineSpec, allow_custom: bool) -> A.Compose:
    """Builds the albumentations pipeline for a spec, with the box and keypoint processors its
    fields need; raises PipelineError for bad requests."""
    return _with_processors(_build(spec, allow_custom), spec.fields)


def _build(spec: PipelineSpec, allow_custom: bool) -> A.Compose:
    h, w = spec.height, spec.width
    if spec.name == "train":
        return A.Compose(
            [
                A.RandomResizedCrop(
                    size=(h, w), scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), interpolation=cv2.INTER_LINEAR
                ),
                A.HorizontalFlip(p=0.5),
            ]
        )
    if spec.name == "eval":
        # Scale so that both sides cover size / 0.875 (for a square size: the short side).
        cover = (round(h / EVAL_CROP_FRACTION), round(w / EVAL_CROP_FRACTION))
        return A.Compose(
            [
                A.SmallestMaxSize(max_size_hw=cover, interpolation=cv2.INTER_LINEAR),
                A.CenterCrop(height=h, width=w),
            ]
        )
    if spec.name == "detection-train":
        # Scale jitter: fit the image in the output, scale it by 0.5..1.5, pad to the output
        # size and crop it there; boxes are clipped, and those left outside are dropped.
        return A.Compose(
            [
                A.LongestMaxSize(max_size_hw=(h, w), interpolation=cv2.INTER_LINEAR),
                A.RandomScale(scale_limit=(-0.5, 0.5), interpolation=cv2.INTER_LINEAR, p=1.0),
                A.PadIfNeeded(min_height=h, min_width=w, border_mode=cv2.BORDER_CONSTANT, fill=PAD_FILL, fill_mask=0),
                A.RandomCrop(height=h, width=w),
                A.HorizontalFlip(p=0.5),
            ]
        )
    if spec.name in ("detection-eval", "segmentation-eval"):
        # Letterbox: the whole image, fitted in the output and padded around (no randomness).
        # A mask's padding is 255, the ignore index, for segmentation; 0 for detection.
        ignore = tg.CROWD if spec.name == "segmentation-eval" else 0
        return A.Compose(
            [
                A.LongestMaxSize(max_size_hw=(h, w), interpolation=cv2.INTER_LINEAR),
                A.PadIfNeeded(
                    min_height=h, min_width=w, border_mode=cv2.BORDER_CONSTANT, fill=PAD_FILL, fill_mask=ignore
                ),
            ]
        )
    if spec.name == "segmentation-train":
        # Cover the output, scale by 0.5..2.0, pad (the mask with 255, the ignore index), crop, flip.
        return A.Compose(
            [
                A.SmallestMaxSize(max_size_hw=(h, w), interpolation=cv2.INTER_LINEAR),
                A.RandomScale(scale_limit=(-0.5, 1.0), interpolation=cv2.INTER_LINEAR, p=1.0),
                A.PadIfNeeded(
                    min_height=h, min_width=w, border_mode=cv2.BORDER_CONSTANT, fill=PAD_FILL, fill_mask=tg.CROWD
                ),
                A.RandomCrop(height=h, width=w),
                A.HorizontalFlip(p=0.5),
            ]
        )
    if spec.name != CUSTOM_PIPELINE:
        raise PipelineError(
            f"unknown pipeline {spec.name!r}; this server offers "
            f"{', '.join(PRESETS + ((CUSTOM_PIPELINE,) if allow_custom else ()))}"
        )
    return _custom(spec, allow_custom)


def _custom(spec: PipelineSpec, allow_custom: bool) -> A.Compose:
    """A client's albumentations pipeline (``albumentations_json``), checked against this server's
    limits before it is rebuilt from albumentations' own registry."""
    if not allow_custom:
        raise PipelineError(
            "this server does not accept custom albumentations pipelines "
            f"(start it with --allow-custom-pipelines); it offers {', '.join(PRESETS)}"
        )
    size = len(spec.albumentations_json.encode("utf-8", "surrogatepass"))
    if size > MAX_PIPELINE_JSON:
        raise PipelineError(f"albumentations_json is {size} bytes, over the limit of {MAX_PIPELINE_JSON}")
    try:
        document = json.loads(spec.albumentations_json)
        numbers = list(_numbers(document))
    except ValueError as exc:
        raise PipelineError(f"albumentations_json is not JSON: {exc}") from None
    except RecursionError:
        raise PipelineError("albumentations_json is nested too deeply") from None
    limit = 4 * max(spec.height, spec.width, 256)
    for path, value in numbers:
        if abs(value) > limit and path.rsplit(".", 1)[-1] not in ("seed",):
            raise PipelineError(
                f"albumentations_json: {path}={value} is over this server's limit of {limit} for "
                f"any size-like parameter (4 x the output size, at least 1024)"
            )
    try:
        # from_dict only instantiates classes from albumentations' own registry: no code runs.
        compose = A.from_dict(document)
    except Exception as exc:  # any malformed document is the client's error
        raise PipelineError(f"cannot rebuild the albumentations pipeline: {type(exc).__name__}: {exc}") from None
    if not isinstance(compose, A.Compose):
        compose = A.Compose([compose])
    count = sum(1 for _ in _walk(compose))
    if count > MAX_TRANSFORMS:
        raise PipelineError(f"the pipeline has {count} transforms and composes, over the limit of {MAX_TRANSFORMS}")
    if compose.p < 1:
        raise PipelineError(
            f"the pipeline's outer Compose has p={compose.p}: it would pass some images through "
            f"untransformed, at their own size; use p=1 there and put the probability on "
            f"the transforms inside"
        )
    return compose


def _with_processors(compose: A.Compose, fields: tuple[str, ...]) -> A.Compose:
    """The compose with exactly the box and keypoint processors the stream's fields need: a
    custom pipeline's own bbox_params / keypoint_params when they fit how targets travel,
    ours (BBOX_PARAMS, KEYPOINT_PARAMS) otherwise."""
    own = _processor_params(compose)
    wanted: dict[str, object] = {}
    if tg.BBOXES in fields or tg.BBOX_LABELS in fields or tg.MASKS in fields:  # (a mask per kept box)
        params = own.get("bbox_params") or A.BboxParams(**BBOX_PARAMS)
        if params.format != "pascal_voc" or list(params.label_fields or []) != [tg.BBOX_LABELS]:
            raise PipelineError(
                f"the pipeline's bbox_params have format={params.format!r} and label_fields="
                f"{list(params.label_fields or [])}; boxes travel as pascal_voc with label_fields=['bbox_labels']"
            )
        wanted["bbox_params"] = params
    if tg.KEYPOINTS in fields or tg.TO_ORIG in fields:
        params = own.get("keypoint_params") or A.KeypointParams(**KEYPOINT_PARAMS)
        if params.format != "xy" or params.remove_invisible or params.label_fields:
            raise PipelineError(
                "the pipeline's keypoint_params must have format='xy', remove_invisible=False and no label_fields: "
                "points that leave the image are kept, with visibility 0"
            )
        wanted["keypoint_params"] = params
    if not wanted and not own:
        return compose
    return A.Compose(list(compose.transforms), p=compose.p, **wanted)


def _numbers(node, path: str = "pipeline"):
    """Every number in a JSON document, with its path: sizes and kernels are checked before anything runs."""
    if isinstance(node, bool):
        return
    if isinstance(node, (int, float)):
        yield path, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _numbers(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _numbers(value, f"{path}[{i}]")


def _always_runs_all(node) -> bool:
    """Whether ``node`` is a Compose or Sequential that always runs all its transforms in order:
    its only draw, ``random() < p``, is then always true, so its generators' state changes nothing."""
    return type(node) in (A.Compose, A.Sequential) and node.p >= 1


def _walk(node):
    """The compose, its nested composes and every transform, in a fixed order."""
    yield node
    for child in getattr(node, "transforms", ()):
        yield from _walk(child)


class Pipeline:
    """Decode + augment one sample into a fixed-size RGB uint8 array."""

    def __init__(
        self, spec: PipelineSpec, allow_custom: bool = False, max_pixels: int = 100_000_000, region_decode: bool = True
    ):
        self.spec = spec
        self.max_pixels = max_pixels
        self.region_decode = region_decode
        self.compose = build_compose(spec, allow_custom)
        self._boxes = "bboxes" in getattr(self.compose, "processors", {})  # boxes go through the compose
        transforms = list(self.compose.transforms)
        first = transforms[0] if transforms else None
        self._crop = first if isinstance(first, A.RandomResizedCrop) and first.p >= 1 else None
        if self._crop is not None and any(f in THROUGH_COMPOSE for f in spec.fields):
            # Targets go through the whole compose; its crop returns the decoded region.
            self._crop = first = _recast(RegionCrop, self._crop)
            transforms[0] = first
            self.compose = A.Compose(transforms, p=self.compose.p, **_processor_params(self.compose))
        self._rest = A.Compose(transforms[1:]) if self._crop is not None else None
        # After the crop, the "train" preset has one horizontal flip: drawn from its own generator
        # and applied as albumentations would, without a Compose call (a twentieth of an image's CPU).
        rest = transforms[1:]
        self._flip_only = rest[0] if len(rest) == 1 and type(rest[0]) is A.HorizontalFlip else None
        # A fit (Longest/SmallestMaxSize) then a RandomScale: one resize, of the source (ResizeOnce).
        self._fit: DeferredFit | None = None
        if self._crop is None and len(transforms) > 1 and DeferredFit.fits(transforms[0], transforms[1]):
            self._fit = _recast(_FIT_KINDS[type(transforms[0])], transforms[0])
            once = _recast(ResizeOnce, transforms[1])
            once.fit = self._fit
            transforms[:2] = [self._fit, once]
            self.compose = A.Compose(transforms, p=self.compose.p, **_processor_params(self.compose))
            first = transforms[0]
        # A first resize needs the image decoded at least this large: (height, width, cover)
        # where cover=True means "scale to cover both" and False "at least this short side".
        self._resize_target = None
        if isinstance(first, A.SmallestMaxSize) and first.p >= 1:
            if first.max_size_hw is not None and None not in first.max_size_hw:
                self._resize_target = (*first.max_size_hw, True)
            elif first.max_size is not None:
                size = first.max_size if isinstance(first.max_size, int) else max(first.max_size)
                self._resize_target = (size, size, False)
        elif isinstance(first, A.Resize) and first.p >= 1:
            self._resize_target = (first.height, first.width, None)
        # Every transform (and nested compose) gets its own generators, reseeded per sample
        # from its own derived seed: albumentations' set_random_seed gives all of them the
        # same seed, which ties e.g. the flip to the crop size, and rebuilds six generator
        # objects per call. Installed after _rest exists, since a Compose reseeds its children.
        self._nodes = list(_walk(self.compose))
        for node in self._nodes:
            node.py_random = random.Random()
            node.random_generator = np.random.Generator(np.random.PCG64())
        # Seeding costs microseconds a generator: only those whose draws can change a sample.
        self._seeded = [(k, node) for k, node in enumerate(self._nodes) if not _always_runs_all(node)]

    def reseed(self, seed: int) -> None:
        """Puts every transform's generators in the state derived from (seed, its position)."""
        streams = stream_seeds(seed, 2 * len(self._nodes) + 1)  # the first one is not used
        for k, node in self._seeded:
            a, b = streams[2 * k + 1], streams[2 * k + 2]
            node.py_random.seed(a)
            node.random_generator.bit_generator.state = {
                "bit_generator": "PCG64",
                "state": {"state": (a << 64) | b, "inc": (b << 1) | 1},
                "has_uint32": 0,
                "uinteger": 0,
            }

    def check_output(self) -> None:
        """Runs the pipeline on a test image and raises PipelineError unless the size is fixed."""
        rng = np.random.default_rng(0)
        for shape in ((self.spec.height * 2 + 7, self.spec.width * 2 + 3), (61, 97)):
            image = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
            self.reseed(0)
            try:
                if self.spec.fields:
                    arrays: dict[str, np.ndarray] = {
                        tg.BBOXES: np.asarray([[1, 1, shape[1] - 1, shape[0] - 1]], np.float32),
                        tg.BBOX_LABELS: np.zeros(1, np.int64),
                        tg.KEYPOINTS: np.asarray([[2, 2, 2]], np.float32),
                    }
                    out = self.with_targets(
                        image,
                        0,
                        arrays,
                        lambda h, w: np.ones((h, w), np.uint8),
                        lambda n, h, w: np.ones((n, h, w), np.uint8),
                    )[0]
                else:
                    out = self.compose(image=image)["image"]
            except Exception as exc:  # the pipeline cannot handle some image sizes
                raise PipelineError(
                    f"the pipeline fails on an image of {shape[0]}x{shape[1]} (height x width) "
                    f"({type(exc).__name__}: "
                    f"{exc}); it must accept any image size, e.g. start with a Resize or "
                    f"RandomResizedCrop"
                ) from None
            if out.shape != (self.spec.height, self.spec.width, 3) or out.dtype != np.uint8:
                raise PipelineError(
                    f"the pipeline turns an image of {shape[0]}x{shape[1]} (height x width) into shape {out.shape} "
                    f"{out.dtype}; it must output uint8 of the requested size "
                    f"{self.spec.height}x{self.spec.width}x3 for every input (end it with a "
                    f"Resize or a crop of that size)"
                )

    def __call__(self, data: bytes, seed: int, fused: bool = True, verified: bool = False) -> np.ndarray:
        """The sample's pixels; ``verified``: the file has decoded without error before, so a
        fused crop may decode its region only; else the rest of the file is read too, to fail as
        a whole decode would (both only when the server's region_decode is on)."""
        fmt, height, width = dec.read_size(data, self.max_pixels)
        self.reseed(seed)
        if fused and self._crop is not None:
            return self._fused_crop(data, fmt, height, width, verified)
        min_h = min_w = 0
        if fused and self._resize_target is not None:
            th, tw, cover = self._resize_target
            if cover is None:  # Resize: each side independently
                min_h, min_w = th, tw
            else:
                scale = max(th / height, tw / width) if cover else th / min(height, width)
                min_h, min_w = math.ceil(height * scale), math.ceil(width * scale)
        image = dec.decode(data, fmt, min_h, min_w, height, width)
        return self._compose(fused, image=image)["image"]

    def _compose(self, fused: bool, **data) -> dict:
        """The compose's result; ``fused`` False: a fit and scale resize twice, as plain albumentations."""
        if self._fit is None or fused:
            return self.compose(**data)
        self._fit.fuse = False
        try:
            return self.compose(**data)
        finally:
            self._fit.fuse = True

    def with_targets(
        self,
        image: bytes | np.ndarray,
        seed: int,
        arrays: dict[str, np.ndarray],
        mask_of: Callable[[int, int], np.ndarray | None],
        instances_of: Callable[[int, int, int], np.ndarray | None] = lambda n, h, w: None,
        verified: bool = False,
        fused: bool = True,
    ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
        """The sample's pixels, its targets for the stream's fields, and its mask (None: it has none).

        ``image``: encoded bytes or a uint8 RGB array; ``arrays``: its targets as the source gave
        them (boxes in the image's pixels); ``mask_of(height, width)``: its mask at the image's size;
        ``instances_of(boxes, height, width)``: its instance masks (None: none drawn, zeros);
        ``fused`` False: a first fit and scale resize twice, as plain albumentations (DeferredFit)."""
        fields = self.spec.fields
        if isinstance(image, np.ndarray):
            if image.shape[0] * image.shape[1] > self.max_pixels:
                raise dec.DecodeError(
                    f"image of {image.shape[1]}x{image.shape[0]} is over max_pixels={self.max_pixels}"
                )
            self.reseed(seed)
            pixels = image
        elif not any(f in THROUGH_COMPOSE for f in fields):  # nothing moves with the pixels: the fused path
            return self(image, seed, fused, verified), _passed(arrays, fields), None
        else:
            fmt, height, width = dec.read_size(image, self.max_pixels)
            self.reseed(seed)
            if isinstance(self._crop, RegionCrop):  # decoded by the crop, by region: a placeholder
                self._crop.render = lambda coords: self._region(image, fmt, height, width, coords, verified)
                pixels = np.empty((height, width, 0), np.uint8)
            else:
                pixels = dec.decode(image, fmt, 0, 0, height, width)
        try:
            return self._transform(pixels, arrays, mask_of, instances_of, fused)
        finally:
            if isinstance(self._crop, RegionCrop):
                self._crop.render = None

    def _transform(
        self,
        pixels: np.ndarray,
        arrays: dict[str, np.ndarray],
        mask_of: Callable[[int, int], np.ndarray | None],
        instances_of: Callable[[int, int, int], np.ndarray | None],
        fused: bool = True,
    ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
        fields = self.spec.fields
        height, width = pixels.shape[:2]
        kwargs: dict[str, np.ndarray] = {"image": pixels}
        mask = mask_of(height, width) if tg.MASK in fields else None
        if mask is not None:
            kwargs["mask"] = mask
        boxes = self._boxes
        source_boxes = arrays.get(tg.BBOXES, np.zeros((0, 4), np.float32))
        if boxes:
            kwargs[tg.BBOXES] = tg.fit_boxes(source_boxes, height, width)
            kwargs[tg.BBOX_LABELS] = np.arange(len(kwargs[tg.BBOXES]))
        if tg.MASKS in fields:
            instances = instances_of(len(source_boxes), height, width)
            kwargs["masks"] = np.zeros((len(source_boxes), height, width), np.uint8) if instances is None else instances
        points = arrays.get(tg.KEYPOINTS, np.zeros((0, 3), np.float32)) if tg.KEYPOINTS in fields else _NO_POINTS
        if tg.KEYPOINTS in fields or tg.TO_ORIG in fields:
            # (the geometry's two reference points last: the source's corners)
            corners = np.asarray([[0, 0], [width, height]], np.float32) if tg.TO_ORIG in fields else _NO_POINTS[:, :2]
            kwargs[tg.KEYPOINTS] = np.concatenate([points[:, :2], corners])
        result = self._compose(fused, **kwargs)
        out = result["image"]
        targets = _passed(arrays, fields)
        kept = np.zeros(0, np.int64)
        if boxes:
            kept = np.asarray(result[tg.BBOX_LABELS], np.int64).reshape(-1)
            if tg.BBOXES in fields:
                targets[tg.BBOXES] = np.asarray(result[tg.BBOXES], np.float32).reshape(-1, 4)
            if tg.BBOX_LABELS in fields:
                targets[tg.BBOX_LABELS] = arrays.get(tg.BBOX_LABELS, np.zeros(0, np.int64))[kept]
        if tg.MASKS in fields:
            # (nearest-neighbour throughout; a pad's fill_mask, 255 in segmentation-eval, is not the object)
            targets[tg.MASKS] = (np.asarray(result["masks"], np.uint8).reshape(-1, *out.shape[:2])[kept] == 1).view(
                np.uint8
            )
        passed = len(kwargs.get(tg.KEYPOINTS, ()))
        moved = np.asarray(result[tg.KEYPOINTS], np.float32).reshape(passed, -1)[:, :2] if passed else _NO_POINTS[:, :2]
        if tg.TO_ORIG in fields:
            targets[tg.TO_ORIG] = _to_orig(moved[-2:], height, width)
            moved = moved[:-2]
        if tg.ORIG_SIZE in fields:
            targets[tg.ORIG_SIZE] = np.asarray([height, width], np.int64)
        if tg.KEYPOINTS in fields:
            xy = moved
            h, w = out.shape[:2]
            inside = (xy[:, 0] >= 0) & (xy[:, 0] < w) & (xy[:, 1] >= 0) & (xy[:, 1] < h)
            rows = np.concatenate([xy, np.where(inside, points[:, 2], 0)[:, None]], axis=1).astype(np.float32)
            owner = arrays.get(tg.KEYPOINT_BOX)
            if owner is not None and boxes:  # the points of a dropped box go with it
                rows = rows[(owner < 0) | np.isin(owner, kept)]
            targets[tg.KEYPOINTS] = rows
        return out, targets, (result["mask"] if mask is not None else None)

    def _fused_crop(self, data: bytes, fmt: str, height: int, width: int, verified: bool) -> np.ndarray:
        crop, rest = self._crop, self._rest
        assert crop is not None and rest is not None, "only for a pipeline that starts with a random-resized crop"
        params = crop.get_params()
        params["shape"] = (height, width, 3)
        coords = crop.get_params_dependent_on_data(params, {})["crop_coords"]
        region = self._region(data, fmt, height, width, coords, verified)
        if self._flip_only is not None:
            return cv2.flip(region, 1) if self._flip_only.should_apply() else region
        return rest(image=region)["image"] if rest.transforms else region

    def _region(
        self, data: bytes, fmt: str, height: int, width: int, coords: tuple[int, int, int, int], verified: bool
    ) -> np.ndarray:
        """The crop ``coords`` of the image, decoded as small as it may be and resized to the output;
        ``verified``: the file decoded without error before (see ``__call__``)."""
        crop = self._crop
        assert crop is not None, "only for a pipeline that starts with a random-resized crop"
        x1, y1, x2, y2 = coords
        out_h, out_w = crop.size
        # Smallest decode that keeps the crop at least the output size.
        min_h = math.ceil(height * out_h / max(y2 - y1, 1))
        min_w = math.ceil(width * out_w / max(x2 - x1, 1))
        box, mins = (x1, y1, x2, y2), (min(min_h, height), min(min_w, width))
        region = dec.decode_crop(data, fmt, height, width, box, *mins, native=self.region_decode, whole=not verified)
        if region.shape[:2] != (out_h, out_w):
            # As albumentations picks it: on the crop's size in the source (area_for_downscale).
            pick = getattr(crop, "_get_interpolation_for_resize", None)
            interpolation = pick((y2 - y1, x2 - x1), "image") if pick else crop.interpolation
            region = cv2.resize(region, (out_w, out_h), interpolation=interpolation)
        return region


class RegionCrop(A.RandomResizedCrop):
    """A pipeline's first RandomResizedCrop when targets go through the compose: it draws its
    window as albumentations does (its targets too are albumentations'), and while ``render``
    is set returns the pixels the fused decode made of that window instead of cropping the
    (then placeholder) image."""

    render: Callable[[tuple[int, int, int, int]], np.ndarray] | None = None

    def apply(self, img: np.ndarray, crop_coords: tuple[int, int, int, int], **params) -> np.ndarray:
        if self.render is not None:
            return self.render(crop_coords)
        return super().apply(img, crop_coords, **params)


class DeferredFit:
    """Mixed into a pipeline's first Longest/SmallestMaxSize when a RandomScale follows: it
    keeps the image (``source``) and passes on an empty placeholder of the fitted shape, so
    that the scale (``ResizeOnce``) resizes the source once, to the very size the two resizes
    give. Targets go through both transforms unchanged (boxes and points are albumentations'
    result: the shapes are the same); the pixels differ from two resizes' by resampling only.
    ``fuse`` False: both resize, as plain albumentations."""

    source: np.ndarray | None = None
    fuse: bool = True

    @staticmethod
    def fits(first, second) -> bool:
        return (
            type(first) in _FIT_KINDS
            and type(second) is A.RandomScale
            and first.p >= 1
            and second.p >= 1
            and first.interpolation == second.interpolation
            and first.area_for_downscale is None
            and second.area_for_downscale is None
        )

    def apply(self, img: np.ndarray, scale: float, **params) -> np.ndarray:
        if not self.fuse:
            return super().apply(img, scale, **params)  # type: ignore[misc]  # the max-size transform's
        self.source = img
        height, width = img.shape[:2]  # the fitted size, as MaxSizeTransform.apply rounds it
        return np.empty((max(1, round(height * scale)), max(1, round(width * scale)), 0), np.uint8)


class _DeferredLongest(DeferredFit, A.LongestMaxSize):
    pass


class _DeferredSmallest(DeferredFit, A.SmallestMaxSize):
    pass


_FIT_KINDS = {A.LongestMaxSize: _DeferredLongest, A.SmallestMaxSize: _DeferredSmallest}


class ResizeOnce(A.RandomScale):
    """The RandomScale after a ``DeferredFit``: its scale drawn as albumentations draws it, the
    output size computed from the fitted size as albumentations computes it, and the fit's
    source resized to that size in one step."""

    fit: DeferredFit

    def apply(self, img: np.ndarray, scale: float, **params) -> np.ndarray:
        source, self.fit.source = self.fit.source, None
        if source is None:  # the fit resized (fuse False)
            return super().apply(img, scale, **params)
        height, width = img.shape[:2]  # the placeholder's: as fgeometric.scale rounds it
        size = (int(height * scale), int(width * scale))
        if size == source.shape[:2]:
            return source
        return cv2.resize(source, (size[1], size[0]), interpolation=self.interpolation)


def _recast(kind: type, transform: A.BasicTransform):
    """``transform`` rebuilt as ``kind``, a subclass of its type, with the same arguments."""
    return kind(**transform.get_transform_init_args())


_NO_POINTS = np.zeros((0, 3), np.float32)


def _to_orig(corners: np.ndarray, height: int, width: int) -> np.ndarray:
    """(sx, sy, tx, ty) taking output pixels back to the source's, from where the source's
    corners (0, 0) and (width, height) went. albumentations flips a point as a pixel centre
    (x to width - 1 - x) and a box as edges (x to width - x): the map is for boxes, so a
    mirrored axis is shifted by the one pixel between the two."""
    (x0, y0), (x1, y1) = corners.tolist()
    fx, fy = (x1 - x0) / width, (y1 - y0) / height  # output pixels per source pixel
    if fx < 0:
        x0 += 1
    if fy < 0:
        y0 += 1
    return np.asarray([1 / fx, 1 / fy, -x0 / fx, -y0 / fy], np.float32)


def _processor_params(compose: A.Compose) -> dict:
    """The bbox_params / keypoint_params a compose was built with."""
    processors = getattr(compose, "processors", {})
    names = (("bboxes", "bbox_params"), ("keypoints", "keypoint_params"))
    return {param: processors[key].params for key, param in names if key in processors}


def _passed(arrays: dict[str, np.ndarray], fields: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The sample's targets that pass through untransformed (``labels``, extra arrays) and that
    the stream asked for."""
    return {name: value for name, value in arrays.items() if name in fields and name not in THROUGH_COMPOSE}
