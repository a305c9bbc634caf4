"""How a sample's targets travel: the public field names and ``loader_pb2.Targets``, typed arrays.

The field names are public API (README, "Targets"):

* ``label``: int64 class, as for classification (travels in ``ChunkHeader.labels``);
* ``labels``: int64[k], multi-label tags;
* ``bboxes``: float32[n, 4], pascal_voc pixels of the output image (x_min, y_min, x_max, y_max);
* ``bbox_labels``: int64[n], one per box;
* ``mask``: uint8[H, W], a class id per pixel (it travels with the pixels, not as an array);
* ``keypoints``: float32[k, 3], x and y in output pixels and a visibility (0: left the image);
* any other lower-case name: an extra numeric array, passed through untransformed.

Both sides use this module: the server writes ``to_message``, the client reads ``arrays_of``,
which checks every array (it comes from the network). No pickle.
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
KEYPOINTS = "keypoints"
FIELDS = (LABEL, LABELS, BBOXES, BBOX_LABELS, MASK, KEYPOINTS)
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
    """The typed arrays as a Targets message."""
    message = loader_pb2.Targets(error=error)
    for name, array in arrays.items():
        array = np.ascontiguousarray(array)
        little = array.astype(array.dtype.newbyteorder("<"), copy=False)
        message.arrays.add(name=name, dtype=array.dtype.name, shape=array.shape, data=little.tobytes())
    return message


def arrays_of(message: loader_pb2.Targets) -> dict[str, np.ndarray]:
    """The typed arrays of a Targets message, each checked; TargetError for one that is malformed."""
    arrays: dict[str, np.ndarray] = {}
    for entry in message.arrays:
        if entry.dtype not in DTYPES:
            raise TargetError(f"target {entry.name!r} has dtype {entry.dtype!r}; expected one of {', '.join(DTYPES)}")
        dtype = np.dtype(entry.dtype).newbyteorder("<")
        shape = tuple(entry.shape)
        if len(shape) > 8 or len(entry.data) != math.prod(shape) * dtype.itemsize:
            raise TargetError(f"target {entry.name!r}: {len(entry.data)} bytes do not hold {entry.dtype} {shape}")
        arrays[entry.name] = np.frombuffer(entry.data, dtype).astype(dtype.newbyteorder("=")).reshape(shape)
    return arrays
