"""The WebDataset member convention, shared by the formats that store samples as named members
(tar shards, LMDB keys): ``<key>.jpg|jpeg|png`` the image (or ``<key>.mp4|mkv|webm|avi|mov``, a
video: docs/video.md), ``<key>.cls`` its label as decimal text, ``<key>.json`` its targets (an
object of the fields in ``server/targets.py``) and ``<key>.mask.png`` its semantic mask; and the
shard id made of such an index.
"""

from __future__ import annotations

import hashlib
import json
import logging
from array import array

import numpy as np

from remoteloader.server import targets as tg
from remoteloader.server.catalog import IMAGE_EXTENSIONS, MASK_SUFFIX, CatalogError, KeyTable, warn_shard
from remoteloader.server.video_decode import VIDEO_EXTENSIONS

log = logging.getLogger(__name__)


def kind_of(name: str) -> tuple[str, str]:
    """(stem, kind) of a member's name: kind "image", "cls", "json", "mask", or "" (other)."""
    if name.lower().endswith(MASK_SUFFIX):
        return name[: -len(MASK_SUFFIX)], "mask"
    stem, _, ext = name.rpartition(".")
    ext = "." + ext.lower()
    if ext in IMAGE_EXTENSIONS or ext in VIDEO_EXTENSIONS:  # a video member is the sample's pixels too (docs/video.md)
        return stem, "image"
    return stem, {".cls": "cls", ".json": "json"}.get(ext, "")


def label(raw: bytes, where: str) -> int:
    """A ``.cls`` member's label (-1 when empty)."""
    try:
        return int(raw.strip() or b"-1")
    except ValueError:
        raise CatalogError(f"{where} holds {raw[:20]!r}, not an integer label") from None


def fingerprint(kind: str, index_digest: str, labels, class_names: list[str], targets=b"") -> str:
    """A shard's id: its members, sizes and offsets (the index digest), labels, targets and class
    names, all that a client sees; ``kind`` names the format ("tar", "lmdb"...)."""
    digest = hashlib.sha256(index_digest.encode())
    digest.update(np.asarray(labels, dtype=np.int64).tobytes())
    digest.update("\0".join(class_names).encode())
    if len(targets):  # (bytes, a bytearray or a loaded index's uint8 array)
        digest.update(hashlib.sha256(targets).digest())
    return f"{kind}-" + digest.hexdigest()[:24]


def add_targets(table: KeyTable, extras: dict[int, dict[str, object]], path) -> tuple[str, ...]:
    """Fills the table's targets from the samples' ``.json`` and ``.mask.png`` members; returns
    the fields they carry. A sample whose JSON is not usable gets a record with the error."""
    if not extras:
        return ()  # every sample's record is empty already
    table.targets, table.target_ends = bytearray(), array("q")
    fields: dict[str, None] = {}
    described: dict[str, None] = {}  # the metadata keys seen (a .json's text, URLs, file names)
    bad = carry_metadata = 0
    for index in range(len(table)):
        pieces = extras.get(index, {})
        arrays: dict[str, np.ndarray] = {}
        error = ""
        raw = pieces.get("json")
        if raw is not None:
            try:
                if isinstance(raw, str):
                    raise tg.TargetError(raw)
                found, metadata = tg.split_metadata(json.loads(raw))  # type: ignore[arg-type]
                described.update(dict.fromkeys(metadata))
                carry_metadata += bool(metadata)
                label, arrays = tg.from_source(found)
                if tg.MASK in arrays:
                    raise tg.TargetError("a mask goes in a <key>.mask.png member, not in the JSON")
                if label is not None:
                    if table.labels[index] >= 0 and table.labels[index] != label:
                        raise tg.TargetError(f"its .json says label {label}, its .cls {table.labels[index]}")
                    table.labels[index] = label
            except (ValueError, RecursionError) as exc:  # TargetError, and JSON that does not parse
                error = f"<key>.json: {exc}"
                arrays = {}
                bad += 1
        message = tg.to_message(arrays, error)
        mask = pieces.get("mask")
        if mask is not None:
            message.mask_offset, message.mask_length = mask  # type: ignore[misc]
            fields[tg.MASK] = None
        fields.update(dict.fromkeys(arrays))
        data, fits = tg.stored(message)
        bad += not fits
        table.targets += data
        table.target_ends.append(len(table.targets))
    if carry_metadata:
        keys = ", ".join(sorted(described)[:12]) + (", ..." if len(described) > 12 else "")
        log.debug(
            "%s: %d sample(s) carry metadata in their .json, kept out of the targets: %s", path, carry_metadata, keys
        )
    if bad:
        fails = "each fails with the reason when a loader asks for target fields; image batches serve it"
        warn_shard(
            log,
            f"shard files have samples whose targets cannot be used: {fails}",
            f"{str(path).rpartition('/')[2]} ({bad})",
            f"{path}: {bad} sample(s) have targets that cannot be used; {fails}",
        )
    return tuple(fields)
