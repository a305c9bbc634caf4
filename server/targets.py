"""A sample's targets as sources give them: checked, typed, stored; drawn and fitted when served.

The field names and the wire form (``loader_pb2.Targets``) are ``protos/targets.py``'s. A
source gives a sample's targets as a mapping (a tar's ``<key>.json``, a ``--source``
object, a COCO annotation); ``from_source`` turns it into typed arrays or says why it
cannot. In a server's catalog a sample's targets are one serialized ``loader_pb2.Targets``
of at most ``MAX_TARGET_BYTES``, and so are its transformed targets in a chunk.
"""

from __future__ import annotations

from collections.abc import Mapping

import cv2
import numpy as np

from remoteloader.protos import limits, loader_pb2
from remoteloader.protos.targets import (
    BBOX_LABELS,
    BBOXES,
    DTYPES,
    FIELDS,
    IMAGE_ID,
    KEYPOINTS,
    LABEL,
    LABELS,
    MASK,
    MASKS,
    MAX_FIELDS,
    ORIG_SIZE,
    RENDERED,
    RESERVED,
    TO_ORIG,
    TargetError,
    arrays_of,
    check_field_name,
    in_order,
    mask_of_runs,
    to_message,
)

__all__ = [
    "BBOXES",
    "BBOX_LABELS",
    "FIELDS",
    "IMAGE_ID",
    "KEYPOINTS",
    "LABEL",
    "LABELS",
    "MASK",
    "MASKS",
    "MAX_FIELDS",
    "ORIG_SIZE",
    "RENDERED",
    "RESERVED",
    "TO_ORIG",
    "TargetError",
    "arrays_of",
    "check_field_name",
    "in_order",
    "to_message",
]

MAX_TARGET_BYTES = limits.TARGET_BYTES  # a sample's serialized targets, in a catalog and in a chunk
# Internal, never sent: the box each keypoint row belongs to (COCO person keypoints), so that
# the keypoints of a box the pipeline drops are dropped with it.
KEYPOINT_BOX = "_keypoint_box"
CROWD = 255  # mask value of COCO crowd regions and overlaps: the usual ignore index
MASK_CLASSES = 254  # labels a uint8 mask can hold besides 0 (background) and CROWD


def split_metadata(raw: object) -> tuple[object, dict[str, object]]:
    """A sample's JSON object as (its targets, its metadata), so that only what will really
    fail fails. A known field (``FIELDS``) is a target whatever its value (a bad one fails the
    sample, named), and so is a number or an array of numbers under a name a field may have (an
    extra field); the rest (text, null, objects, lists of them, names no field may have: a
    caption, a URL, a file name) is metadata, kept out of the targets. A JSON with metadata and
    no known field (timm's, img2dataset's: a file name, width, height, caption, url) is metadata
    whole: its width and height are not extra fields that would turn a loader's (images,
    labels) batches into dicts. A JSON that worked before keeps its targets. Anything but an
    object is returned whole, for ``from_source``."""
    if not isinstance(raw, Mapping):
        return raw, {}
    targets: dict[str, object] = {}
    metadata: dict[str, object] = {}
    for name, value in raw.items():
        if name in FIELDS or (_numbers(value, 9) and _may_name(name)):
            targets[name] = value
        else:
            metadata[str(name)] = value
    if metadata and not any(name in FIELDS for name in targets):
        return {}, {str(name): value for name, value in raw.items()}
    return targets, metadata


def _may_name(name: object) -> bool:
    try:
        check_field_name(name)
    except TargetError:
        return False
    return True


def _numbers(value: object, depth: int) -> bool:
    """Whether ``value`` is a number or (nested, at most ``depth`` deep) lists of numbers only."""
    if isinstance(value, (bool, int, float)):
        return True
    if isinstance(value, (list, tuple)) and depth > 0:
        return all(_numbers(v, depth - 1) for v in value)
    return False


def from_source(raw: object) -> tuple[int | None, dict[str, np.ndarray]]:
    """A source's targets as (class label or None, typed arrays); raises TargetError.

    ``raw`` maps field names to values: numbers, nested lists or numpy arrays. A ``mask``
    here must be an array (a tar's mask is its ``<key>.mask.png`` member instead); ``masks``
    one 0/1 array [n, H, W] with a mask per box.
    """
    if not isinstance(raw, Mapping):
        raise TargetError(f"targets must be an object (a mapping of field names), not {type(raw).__name__}")
    if len(raw) > MAX_FIELDS:
        raise TargetError(f"{len(raw)} target fields, over the limit of {MAX_FIELDS}")
    label = None
    arrays: dict[str, np.ndarray] = {}
    for name, value in raw.items():
        check_field_name(name)
        if name == LABEL:
            label = _integer(value, LABEL)
        elif name == LABELS:
            arrays[name] = _ints(value, name).reshape(-1)
        elif name == BBOXES:
            arrays[name] = _boxes(value)
        elif name == BBOX_LABELS:
            arrays[name] = _ints(value, name).reshape(-1)
        elif name == KEYPOINTS:
            arrays[name] = _keypoints(value)
        elif name == MASK:
            arrays[name] = _mask(value)
        elif name == MASKS:
            arrays[name] = _instance_masks(value)
        elif name in RENDERED:
            raise TargetError(f"{name} is computed by the server when a loader asks for it; a source cannot give it")
        else:
            arrays[name] = _extra(name, value)
    if BBOXES in arrays or BBOX_LABELS in arrays:
        boxes = arrays.get(BBOXES, np.zeros((0, 4), np.float32))
        box_labels = arrays.get(BBOX_LABELS)
        if box_labels is None:
            raise TargetError(f"{len(boxes)} bboxes without bbox_labels (one class label per box)")
        if len(box_labels) != len(boxes):
            raise TargetError(f"{len(boxes)} bboxes but {len(box_labels)} bbox_labels; expected one label per box")
        arrays[BBOXES] = boxes
    if MASKS in arrays and len(arrays[MASKS]) != len(arrays.get(BBOXES, ())):
        raise TargetError(
            f"{len(arrays[MASKS])} instance masks but {len(arrays.get(BBOXES, ()))} bboxes; expected one mask per box"
        )
    return label, arrays


def _integer(value: object, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TargetError(f"{name} is {value!r}, not an integer")
    if not -(2**63) <= int(value) < 2**63:
        raise TargetError(f"{name} {value} does not fit int64")
    return int(value)


def _numeric(value: object, name: str) -> np.ndarray:
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as exc:  # ragged lists
        raise TargetError(f"{name} is not a rectangular array of numbers ({exc})") from None
    if array.dtype == object or array.dtype.kind not in "biuf":
        raise TargetError(f"{name} holds {array.dtype} values, not numbers")
    return array


def _ints(value: object, name: str) -> np.ndarray:
    array = _numeric(value, name)
    if array.dtype.kind == "f":
        if not np.all(np.isfinite(array)) or not np.all(array == np.round(array)):
            raise TargetError(f"{name} holds values that are not integers")
    return array.astype(np.int64)


def _finite(value: object, name: str, columns: tuple[int, ...]) -> np.ndarray:
    array = _numeric(value, name).astype(np.float32)
    if array.size == 0:
        array = array.reshape(0, columns[0])
    if array.ndim != 2 or array.shape[1] not in columns:
        raise TargetError(f"{name} has shape {array.shape}; expected [n, {' or '.join(map(str, columns))}]")
    bad = np.flatnonzero(~np.all(np.isfinite(array), axis=1))
    if len(bad):
        raise TargetError(f"{name} {int(bad[0])} holds NaN or infinity: {array[bad[0]].tolist()}")
    return array


def _boxes(value: object) -> np.ndarray:
    boxes = _finite(value, BBOXES, (4,))
    negative = np.flatnonzero((boxes[:, 2] <= boxes[:, 0]) | (boxes[:, 3] <= boxes[:, 1]))
    if len(negative):
        x1, y1, x2, y2 = boxes[negative[0]].tolist()
        raise TargetError(
            f"box {int(negative[0])} ({x1:g}, {y1:g}, {x2:g}, {y2:g}) has a width or height of zero or less: "
            f"boxes are pascal_voc (x_min, y_min, x_max, y_max) in pixels"
        )
    return boxes


def _keypoints(value: object) -> np.ndarray:
    points = _finite(value, KEYPOINTS, (2, 3))
    if points.shape[1] == 2:  # no visibility given: every point labelled and visible (COCO's 2)
        points = np.concatenate([points, np.full((len(points), 1), 2, np.float32)], axis=1)
    return points


def _mask(value: object) -> np.ndarray:
    if isinstance(value, (bytes, bytearray, str)):
        raise TargetError("mask must be a uint8 array [H, W] (in a tar, a <key>.mask.png member)")
    array = _numeric(value, MASK)
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim != 2 or array.dtype != np.uint8:
        raise TargetError(f"mask is {array.dtype} {array.shape}; expected uint8 [H, W]")
    return np.ascontiguousarray(array)


def _instance_masks(value: object) -> np.ndarray:
    array = _numeric(value, MASKS)
    if array.ndim != 3 or array.dtype.kind not in "biu" or (array.size and array.max() > 1) or array.min(initial=0) < 0:
        raise TargetError(f"masks is {array.dtype} {array.shape}; expected 0/1 values [n, H, W], one mask per box")
    return np.ascontiguousarray(array, np.uint8)


def _extra(name: str, value: object) -> np.ndarray:
    array = _numeric(value, name)
    if array.ndim > 8:
        raise TargetError(f"{name} has {array.ndim} dimensions; at most 8")
    if array.dtype.kind == "b":
        array = array.astype(np.uint8)
    elif array.dtype.kind == "f" and array.dtype != np.float64:
        array = array.astype(np.float32)
    elif array.dtype.kind in "iu" and array.dtype.name not in DTYPES:
        array = array.astype(np.int64)
    if isinstance(value, (list, tuple, int, float)) and array.dtype == np.float64:
        array = array.astype(np.float32)  # JSON numbers: float32, as the other float targets
    return array


# ---- storage -------------------------------------------------------------------------------
def stored(message: loader_pb2.Targets) -> tuple[bytes, bool]:
    """The message as a catalog keeps it, and whether it fits: one over MAX_TARGET_BYTES is kept
    as that error instead (its sample then fails with it when served)."""
    data = message.SerializeToString()
    if len(data) <= MAX_TARGET_BYTES:
        return data, True
    return to_message(
        {}, f"targets of {len(data)} bytes, over the limit of {MAX_TARGET_BYTES}"
    ).SerializeToString(), False


def check_size(message: loader_pb2.Targets, where: str) -> bytes:
    """The serialized message; raises TargetError when it is over MAX_TARGET_BYTES."""
    data = message.SerializeToString()
    if len(data) > MAX_TARGET_BYTES:
        raise TargetError(
            f"{where} targets take {len(data)} bytes, over the limit of {MAX_TARGET_BYTES} per sample "
            f"(remoteloader.server.targets.MAX_TARGET_BYTES)"
        )
    return data


# ---- at render time ----------------------------------------------------------------------------
def fit_boxes(boxes: np.ndarray, height: int, width: int, slack: float = 1.0) -> np.ndarray:
    """Boxes clipped to a ``height`` x ``width`` image; TargetError for one lying outside it by more
    than ``slack`` pixels (annotation tools round coordinates; more is a box for another image)."""
    outside = np.flatnonzero(
        (boxes[:, 0] < -slack) | (boxes[:, 1] < -slack) | (boxes[:, 2] > width + slack) | (boxes[:, 3] > height + slack)
    )
    if len(outside):
        x1, y1, x2, y2 = boxes[outside[0]].tolist()
        raise TargetError(
            f"box {int(outside[0])} ({x1:g}, {y1:g}, {x2:g}, {y2:g}) lies outside the {width}x{height} image"
        )
    clipped = boxes.copy()
    np.clip(clipped[:, 0::2], 0, width, out=clipped[:, 0::2])
    np.clip(clipped[:, 1::2], 0, height, out=clipped[:, 1::2])
    return clipped


def draw_regions(regions, height: int, width: int) -> np.ndarray:
    """The semantic mask of COCO regions: polygons filled, RLE decoded; pixels where regions of
    different values overlap, and crowd regions, get CROWD (as torchvision's segmentation
    references do)."""
    mask = np.zeros((height, width), np.uint8)
    covered = np.zeros((height, width), np.uint8)
    for region in regions:
        one = _drawn(region, height, width)
        inside = one.astype(bool)
        clash = inside & (covered > 0) & (mask != region.value)
        mask[inside] = region.value
        mask[clash] = CROWD
        covered |= one
    return mask


def draw_instances(regions, boxes: int, height: int, width: int) -> np.ndarray:
    """The instance masks of COCO regions, uint8 [boxes, H, W]: mask i is the region of box i
    (``Region.box`` = i + 1), zeros for a box without one; crowd regions have no box."""
    masks = np.zeros((boxes, height, width), np.uint8)
    for region in regions:
        if 0 < region.box <= boxes:
            masks[region.box - 1] |= _drawn(region, height, width)
    return masks


def _drawn(region, height: int, width: int) -> np.ndarray:
    """A region's pixels as a uint8 0/1 mask: its RLE decoded, its polygons filled."""
    if region.rle:
        if (region.rle_height, region.rle_width) != (height, width):
            raise TargetError(
                f"an RLE mask is {region.rle_width}x{region.rle_height} but the image is {width}x{height}"
            )
        one = mask_of_runs(region.rle, height, width)
    else:
        one = np.zeros((height, width), np.uint8)
    for polygon in region.polygons:
        points = np.asarray(polygon.xy, np.float32).reshape(-1, 2)
        if len(points) >= 3:
            cv2.fillPoly(one, [np.round(points).astype(np.int32)], 1)
    return one


def check_instances(masks: np.ndarray, boxes: int, height: int, width: int) -> np.ndarray:
    if masks.shape != (boxes, height, width):
        raise TargetError(f"its instance masks are {masks.shape}; expected [{boxes}, {height}, {width}] (one per box)")
    return masks


def decode_coco_rle(counts: str) -> list[int]:
    """The runs of COCO's compressed RLE string (its ``counts`` as pycocotools writes them)."""
    runs: list[int] = []
    pos = 0
    data = counts.encode("ascii")
    while pos < len(data):
        value, shift, more = 0, 0, True
        while more:
            if pos >= len(data):
                raise TargetError("a compressed RLE string ends inside a number")
            c = data[pos] - 48
            value |= (c & 0x1F) << (5 * shift)
            more = bool(c & 0x20)
            pos += 1
            shift += 1
            if not more and c & 0x10:
                value |= -1 << (5 * shift)
        if len(runs) > 2:
            value += runs[-2]
        if value < 0:
            raise TargetError("a compressed RLE string has a negative run")
        runs.append(value)
    return runs


def read_mask_png(data: bytes, height: int, width: int) -> np.ndarray:
    """A sample's mask from its PNG: single-channel uint8 of the image's size, or TargetError."""
    mask = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    if mask is None:
        raise TargetError("its mask PNG does not decode")
    if mask.ndim == 3:
        raise TargetError(f"its mask PNG has {mask.shape[2]} channels; expected one (a class id per pixel)")
    if mask.dtype != np.uint8:
        raise TargetError(f"its mask PNG is {mask.dtype}; expected 8-bit class ids")
    return check_mask(mask, height, width)


def check_mask(mask: np.ndarray, height: int, width: int) -> np.ndarray:
    if mask.shape != (height, width):
        raise TargetError(f"its mask is {mask.shape[1]}x{mask.shape[0]} but the image is {width}x{height}")
    return mask
