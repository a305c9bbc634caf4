"""A COCO annotation file as a shard: images found by ``file_name``, boxes, keypoints and masks.

What the common COCO loaders do, done once at start-up:

* categories sorted by id become labels 1..C; label 0 is the background (as torchvision's
  detection models and a semantic mask expect), and ``class_names[0]`` is "background";
* boxes go from COCO's (x, y, width, height) to pascal_voc (x_min, y_min, x_max, y_max);
  boxes of no width or height are left out, as torchvision's detection references do;
* ``iscrowd`` annotations are left out of the boxes and keypoints (torchvision's detection
  references) and drawn as 255, the ignore index, into the mask (its segmentation references);
* person keypoints (``person_keypoints`` files) follow their box: a box the pipeline drops
  takes its keypoints with it;
* with ``--coco-masks``, polygons and RLE are kept per sample and drawn when the sample is
  served, at the image's own size: into the semantic mask (``mask``) and, one per box, into
  the instance masks (``masks``, as torchvision's Mask R-CNN takes them);
* each sample carries its ``image_id`` (the file's ``images[].id``), as COCO evaluation needs.

A problem with one image's annotations (an unknown category, a NaN) makes that sample fail
with the reason when served; a file that is not a COCO annotation file fails the start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os

import numpy as np

from remoteloader.protos import loader_pb2
from remoteloader.server import targets as tg
from remoteloader.server.catalog import CatalogError, KeyTable, Location, Shard
from remoteloader.server.formats import FormatOptions, Found
from remoteloader.server.storage import Storage, open_storage

log = logging.getLogger(__name__)

BACKGROUND = "background"


class CocoShard(Shard):
    """Every image of a COCO annotation file, with its annotations as targets.

    Args:
        storage / name: Where the annotation file is (instances_*.json or person_keypoints_*.json).
        image_root: Where the images are (``image_root/file_name``: a folder or a URL); default:
            the file's folder.
        masks: Keep segmentations, to serve the ``mask`` field.
        retry_seconds: How long requests to an object store holding the images are retried.
    """

    def __init__(
        self, storage: Storage, name: str, image_root: str = "", masks: bool = False, retry_seconds: float = 60.0
    ):
        images_at, prefix = (
            open_storage(image_root, retry_seconds) if image_root else (storage, name.rpartition("/")[0])
        )
        root = images_at.location(prefix)
        self.root = root
        self._base = root + "/"
        self.storage, self.remote = images_at, images_at.remote
        path = storage.location(name)
        try:
            raw = storage.read(name)
        except OSError as exc:
            raise CatalogError(f"{path}: cannot read it: {exc}") from None
        try:
            document = json.loads(raw)
        except ValueError as exc:
            raise CatalogError(f"{path}: not a JSON file: {exc}") from None
        if not isinstance(document, dict) or not isinstance(document.get("images"), list):
            raise CatalogError(f"{path}: not a COCO annotation file (expected an object with an 'images' list)")
        categories = document.get("categories") or []
        try:
            ordered = sorted(categories, key=lambda c: int(c["id"]))
            names = [str(c["name"]) for c in ordered]
            labels = {int(c["id"]): i + 1 for i, c in enumerate(ordered)}
        except (TypeError, KeyError, ValueError):
            raise CatalogError(f"{path}: its categories are not objects with an 'id' and a 'name'") from None
        if len(labels) != len(ordered):
            raise CatalogError(f"{path}: two categories share an id")
        by_image: dict[int, list[dict]] = {}
        for ann in document.get("annotations") or []:
            if isinstance(ann, dict) and "image_id" in ann:
                by_image.setdefault(ann["image_id"], []).append(ann)
        table = KeyTable()
        digest = hashlib.sha256(hashlib.sha256(raw).digest())
        digest.update(f"{masks}\n".encode())
        keypoints_seen = False
        missing = dropped = bad = 0
        try:
            images = sorted(document["images"], key=lambda im: int(im["id"]))
        except (TypeError, KeyError, ValueError):
            raise CatalogError(f"{path}: its images are not objects with an 'id'") from None
        sizes = _image_sizes(images_at, prefix)
        for image in images:
            file_name = image.get("file_name")
            if not isinstance(file_name, str) or not file_name:
                raise CatalogError(f"{path}: image {image['id']} has no file_name")
            size = sizes(file_name)
            missing += not size
            message, gone, has_keypoints = _targets(int(image["id"]), by_image.get(image["id"], []), labels, masks)
            bad += bool(message.error)
            if size == 0 and not message.error:
                message = loader_pb2.Targets(error=f"image file {self._base + file_name} is missing or empty")
            keypoints_seen |= has_keypoints
            dropped += gone
            data, fits = tg.stored(message)
            bad += not fits
            table.add(file_name, -1, 0, size, data)
            digest.update(f"{file_name}\0{size}\n".encode())
        if not len(table):
            raise CatalogError(f"{path}: holds no images")
        if missing:
            log.warning("%s: %d image file(s) are not under %s; they fail when served", path, missing, root)
        if dropped:
            log.warning(
                "%s: left out %d box(es) of no width or height, as torchvision's COCO loaders do", path, dropped
            )
        if bad:
            log.warning("%s: %d image(s) have annotations that cannot be used; they fail when served", path, bad)
        fields = [tg.BBOXES, tg.BBOX_LABELS, tg.IMAGE_ID]
        fields += ([tg.KEYPOINTS] if keypoints_seen else []) + ([tg.MASK, tg.MASKS] if masks else [])
        super().__init__(
            name.rpartition("/")[2], table, [BACKGROUND, *names], "coco-" + digest.hexdigest()[:24], fields
        )

    def locate(self, index: int) -> Location:
        return Location(self._base + self.name_of(index), 0, int(self._sizes[index]))


def _image_sizes(storage: Storage, prefix: str):
    """A function from an image's file_name to its size (0: missing): stat per image on this
    machine, one listing of the image folder in an object store."""
    if not storage.remote:
        base = storage.location(prefix)

        def stat(file_name: str) -> int:
            try:
                return os.stat(os.path.join(base, file_name)).st_size
            except OSError:
                return 0

        return stat
    start = len(prefix) + 1 if prefix else 0
    listed = {e.name[start:]: e.size for e in storage.walk(prefix)}
    return lambda file_name: listed.get(file_name, 0)


def _targets(
    image_id: int, annotations: list[dict], labels: dict[int, int], masks: bool
) -> tuple[loader_pb2.Targets, int, bool]:
    """One image's targets, the boxes left out for having no area, and whether it has keypoints."""
    boxes: list[tuple[float, float, float, float]] = []
    box_labels: list[int] = []
    points: list[np.ndarray] = []
    point_box: list[int] = []
    regions: list[loader_pb2.Region] = []
    dropped = 0
    try:
        for ann in annotations:
            label = labels.get(ann.get("category_id"))  # type: ignore[arg-type]
            if label is None:
                raise tg.TargetError(f"annotation {ann.get('id')}: unknown category_id {ann.get('category_id')!r}")
            crowd = bool(ann.get("iscrowd", 0))
            region = None
            if masks and ann.get("segmentation"):
                if label > tg.MASK_CLASSES:
                    raise tg.TargetError(f"label {label} does not fit a uint8 mask (at most {tg.MASK_CLASSES} classes)")
                region = _region(ann["segmentation"], tg.CROWD if crowd else label)
                regions.append(region)
            if crowd:
                continue
            x, y, w, h = (float(v) for v in ann["bbox"])
            if not all(map(math.isfinite, (x, y, w, h))):
                raise tg.TargetError(f"annotation {ann.get('id')}: its bbox holds NaN or infinity")
            if w <= 0 or h <= 0:
                dropped += 1
                continue
            if region is not None:
                region.box = len(boxes) + 1
            keypoints = ann.get("keypoints")
            if keypoints:
                rows = np.asarray(keypoints, np.float32).reshape(-1, 3)
                if not np.all(np.isfinite(rows)):
                    raise tg.TargetError(f"annotation {ann.get('id')}: its keypoints hold NaN or infinity")
                points.append(rows)
                point_box += [len(boxes)] * len(rows)
            boxes.append((x, y, x + w, y + h))
            box_labels.append(label)
    except (KeyError, TypeError, ValueError) as exc:  # TargetError, and a malformed annotation
        if not isinstance(exc, tg.TargetError):
            exc = tg.TargetError(f"a malformed annotation ({type(exc).__name__}: {exc})")
        return loader_pb2.Targets(error=str(exc)), dropped, False
    arrays: dict[str, np.ndarray] = {
        tg.BBOXES: np.asarray(boxes, np.float32).reshape(-1, 4),
        tg.BBOX_LABELS: np.asarray(box_labels, np.int64),
        tg.IMAGE_ID: np.asarray([image_id], np.int64),
    }
    if points:
        arrays[tg.KEYPOINTS] = np.concatenate(points)
        arrays[tg.KEYPOINT_BOX] = np.asarray(point_box, np.int64)
    message = tg.to_message(arrays)
    message.regions.extend(regions)
    return message, dropped, bool(points)


def _region(segmentation, value: int) -> loader_pb2.Region:
    """A COCO segmentation (polygons, or RLE compressed or not) as a Region of mask value ``value``."""
    region = loader_pb2.Region(value=value)
    if isinstance(segmentation, list):
        for polygon in segmentation:
            region.polygons.add(xy=[float(v) for v in polygon])
        return region
    if not isinstance(segmentation, dict) or "counts" not in segmentation or "size" not in segmentation:
        raise tg.TargetError("a segmentation that is neither polygons nor RLE")
    counts = segmentation["counts"]
    runs = tg.decode_coco_rle(counts) if isinstance(counts, str) else [int(c) for c in counts]
    region.rle.extend(runs)
    region.rle_height, region.rle_width = (int(v) for v in segmentation["size"])
    return region


def shards_at(storage: Storage, name: str, found: Found, options: FormatOptions) -> list[Shard] | None:
    """A COCO annotation ``.json`` file is one shard."""
    if found.kind != "file" or not name.lower().endswith(".json"):
        return None
    return [
        CocoShard(storage, name, options.config.image_root, options.config.coco_masks, options.config.store_timeout)
    ]
