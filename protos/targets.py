"""How a sample's targets travel: the public field names and ``loader_pb2.Targets``, typed arrays.

The field names are public API (docs/targets.md):

* ``label``: int64 class, as for classification (travels in ``ChunkHeader.labels``);
* ``labels``: int64[k], multi-label tags;
* ``bboxes``: float32[n, 4], pascal_voc pixels of the output image (x_min, y_min, x_max, y_max);
* ``bbox_labels``: int64[n], one per box;
* ``mask``: uint8[H, W], a class id per pixel (it travels with the pixels, not as an array);
* ``masks``: uint8[n, H, W], an instance mask (0 or 1) per box, in the order of ``bboxes``
  (it travels as run lengths, ``loader_pb2.Region``, its shape in the array entry);
* ``keypoints``: float32[k, 3], x and y in output pixels and a visibility (0: left the image);
* ``image_id``: int64[1], the source's id of the image (a COCO file's ``images[].id``);
* ``orig_size``: int64[2], the source image's (height, width);
* ``to_orig``: float32[4], (sx, sy, tx, ty) taking output pixels to the source image's:
  ``x_orig = x * sx + tx``, ``y_orig = y * sy + ty``, for pipelines of resizes, crops, pads
  and flips (e.g. the eval letterbox; a rotation has no such form): exact but for each
  resize's rounding of the image's sides to whole pixels (under an output pixel each);
* any other lower-case name: an extra numeric array, passed through untransformed.

``orig_size`` and ``to_orig`` are ``RENDERED``: any server computes them for any sample when a
stream asks. Both sides use this module: the server writes ``to_message``, the client reads
``arrays_of``, which checks every array (it comes from the network). No pickle.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

import numpy as np

from remoteloader.protos import loader_pb2

LABEL = "label"
LABELS = "labels"
BBOXES = "bboxes"
BBOX_LABELS = "bbox_labels"
MASK = "mask"
MASKS = "masks"
KEYPOINTS = "keypoints"
IMAGE_ID = "image_id"
ORIG_SIZE = "orig_size"
TO_ORIG = "to_orig"
FIELDS = (LABEL, LABELS, BBOXES, BBOX_LABELS, MASK, MASKS, KEYPOINTS, IMAGE_ID, ORIG_SIZE, TO_ORIG)
RENDERED = (ORIG_SIZE, TO_ORIG)  # computed by the server from the pixels, for any sample
FRAME_INDICES = "frame_indices"  # a video clip's source frames, int64 [T] ([K, T]): computed for any clip
# Where servers get each field from (a loader's error names it for a field no server carries).
CARRIED_BY = {
    LABEL: "ImageFolder class folders, a tar's <key>.cls, or a 'label' in the targets",
    MASK: "COCO servers started with --coco-masks, or <key>.mask.png members of tar shards",
    MASKS: "COCO servers started with --coco-masks, or 'masks' in a --source's targets",
    BBOXES: "COCO files, or 'bboxes' in the targets (a tar's <key>.json, TFRecord's image/object/bbox/*)",
    BBOX_LABELS: "COCO files, or 'bbox_labels' in the targets",
    KEYPOINTS: "COCO person_keypoints files, or 'keypoints' in the targets",
    IMAGE_ID: "COCO files",
}
RESERVED = ("images", "ids")  # names a batch dict uses for other things
MAX_FIELDS = 16  # fields one sample, or one Setup, may name
DTYPES = ("uint8", "int32", "int64", "float32", "float64")
# What a sample without a field gets, for the fields whose shape is known: an empty array.
EMPTY = {
    LABELS: ((0,), np.int64),
    BBOXES: ((0, 4), np.float32),
    BBOX_LABELS: ((0,), np.int64),
    KEYPOINTS: ((0, 3), np.float32),
}
# Most pixels a sample's decoded instance masks may take (a client decodes what a server sends).
MAX_MASKS_PIXELS = 256 << 20
LABELLED = (LABELS, BBOX_LABELS)  # fields whose values are class labels (index class_names)
_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}\Z")


class TargetError(ValueError):
    """A sample's targets cannot be used; the message says which and why."""


def check_field_name(name: object) -> str:
    """``name`` if it may name a field (a lower-case identifier, not reserved); TargetError otherwise."""
    if not isinstance(name, str) or not _NAME.match(name) or name in RESERVED:
        raise TargetError(
            f"{name!r} cannot name a target: names are lower-case identifiers of up to 64 characters, "
            f"other than {', '.join(RESERVED)}"
        )
    return name


def in_order(names: Iterable[str]) -> tuple[str, ...]:
    """Field names in the order of FIELDS, then the extras by name: how shards and loaders list them."""
    found = set(names)
    return tuple(f for f in FIELDS if f in found) + tuple(sorted(found - set(FIELDS)))


def to_message(arrays: Mapping[str, np.ndarray], error: str = "") -> loader_pb2.Targets:
    """The typed arrays as a Targets message (``masks`` as run lengths)."""
    message = loader_pb2.Targets(error=error)
    for name, array in arrays.items():
        if name == MASKS:
            message.arrays.add(name=name, dtype="uint8", shape=array.shape)
            for one in array:
                message.regions.add(value=1, rle=runs_of(one), rle_height=one.shape[0], rle_width=one.shape[1])
            continue
        array = np.ascontiguousarray(array)
        little = array.astype(array.dtype.newbyteorder("<"), copy=False)
        message.arrays.add(name=name, dtype=array.dtype.name, shape=array.shape, data=little.tobytes())
    return message


def runs_of(mask: np.ndarray) -> np.ndarray:
    """A 0/1 mask's run lengths as COCO's uncompressed RLE: column-major, alternating runs of 0
    and of 1, starting with 0 (a run of none when the first pixel is 1)."""
    flat = np.ascontiguousarray(mask.T).reshape(-1) != 0
    edges = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    bounds = np.concatenate(([0], edges, [flat.size]))
    runs = np.diff(bounds)
    return np.concatenate(([0], runs)) if flat.size and flat[0] else runs


def mask_of_runs(runs: Iterable[int], height: int, width: int) -> np.ndarray:
    """The uint8 0/1 mask of COCO's uncompressed RLE (column-major runs of 0, then 1, ...);
    TargetError when the runs do not cover height x width pixels."""
    counts = np.fromiter(runs, np.int64)
    if int(counts.sum()) != height * width or (len(counts) and counts.min() < 0):
        raise TargetError(f"RLE runs cover {int(counts.sum())} pixels, the mask {height * width}")
    values = np.zeros(len(counts), np.uint8)
    values[1::2] = 1
    return np.repeat(values, counts).reshape(width, height).T.copy()


def arrays_of(message: loader_pb2.Targets) -> dict[str, np.ndarray]:
    """The typed arrays of a Targets message, each checked; TargetError for one that is malformed."""
    arrays: dict[str, np.ndarray] = {}
    for entry in message.arrays:
        if entry.name == MASKS:
            arrays[MASKS] = _masks_of(entry, message.regions)
            continue
        if entry.dtype not in DTYPES:
            raise TargetError(f"target {entry.name!r} has dtype {entry.dtype!r}; expected one of {', '.join(DTYPES)}")
        dtype = np.dtype(entry.dtype).newbyteorder("<")
        shape = tuple(entry.shape)
        if len(shape) > 8 or len(entry.data) != math.prod(shape) * dtype.itemsize:
            raise TargetError(f"target {entry.name!r}: {len(entry.data)} bytes do not hold {entry.dtype} {shape}")
        arrays[entry.name] = np.frombuffer(entry.data, dtype).astype(dtype.newbyteorder("=")).reshape(shape)
    return arrays


def _masks_of(entry: loader_pb2.TargetArray, regions) -> np.ndarray:
    """The instance masks of a ``masks`` entry: its n regions' run lengths, each H x W."""
    shape = tuple(entry.shape)
    if len(shape) != 3 or entry.dtype != "uint8" or entry.data or len(regions) != shape[0]:
        raise TargetError(f"target 'masks' {entry.dtype} {shape} does not come with one run-length region per mask")
    n, height, width = shape
    if n * height * width > MAX_MASKS_PIXELS:
        raise TargetError(f"target 'masks' {shape} is over {MAX_MASKS_PIXELS} pixels")
    out = np.zeros(shape, np.uint8)
    for i, region in enumerate(regions):
        if (region.rle_height, region.rle_width) != (height, width):
            raise TargetError(f"instance mask {i} is {region.rle_width}x{region.rle_height}, not {width}x{height}")
        out[i] = mask_of_runs(region.rle, height, width)
    return out
