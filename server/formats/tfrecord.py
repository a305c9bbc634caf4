"""TFRecord files of ``tf.train.Example``, read without TensorFlow.

``--data`` a ``.tfrecord`` file (or ``.tfrecords``, ``.record``), a folder of them or a glob.
Each Example is a sample; its features are read by the names TensorFlow's own pipelines use,
and ``--tfrecord-features`` names others (JSON: ``{"image": "jpeg", "label": "cls"}``):

* ``image``: ``image/encoded`` (a JPEG or PNG; the first value);
* ``label``: ``image/class/label`` (an int64);
* ``filename``: ``image/filename`` (as ``build_image_data.py`` writes it): the sample's key where
  every record of the file has one and no two the same, else the record's number in its file,
  ``record-00000000``... (``formats/keys.py`` adds the file where these recur across files);
* boxes, as the TF Object Detection API writes them: ``image/object/bbox/xmin``, ``ymin``,
  ``xmax``, ``ymax`` (floats normalised to 0..1, made pixels with the image's size, from
  ``image/width``/``image/height`` or its header) and ``image/object/class/label`` (int64s):
  served as the ``bboxes`` and ``bbox_labels`` fields.

A file is indexed in one pass that checks both CRCs of every record (TFRecord's masked
CRC32C) and parses each Example by hand (``protowire.py``) to find where its image bytes lie,
so that the decode workers read them by offset as from a tar; the index is kept as a tar's is
(``formats/indexed.py``: beside the file, or in the index folder on a read-only mount), as DALI's
``tfrecord2idx`` does. A record whose data CRC fails, or whose Example is malformed or lacks
an image, is a sample that fails with the reason when served; a bad length CRC ends the
file's usable records there, with a warning. ``classes.txt`` beside the files names labels.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from remoteloader.server import targets as tg
from remoteloader.server.catalog import CatalogError, KeyTable, Shard, basename, warn_shard
from remoteloader.server.decode import DecodeError, read_size
from remoteloader.server.formats import FormatOptions, Found, file_shards, named_strings, protowire
from remoteloader.server.formats import index as shard_index
from remoteloader.server.formats.indexed import IndexedFile
from remoteloader.server.storage import Entry, Storage, read_up_to

google_crc32c: Any
try:
    import google_crc32c
except ImportError:  # (the server extra installs it; an error says so where a file needs it)
    google_crc32c = None

log = logging.getLogger(__name__)

SUFFIXES = (".tfrecord", ".tfrecords", ".record")
FEATURES = {
    "image": "image/encoded",
    "label": "image/class/label",
    "xmin": "image/object/bbox/xmin",
    "ymin": "image/object/bbox/ymin",
    "xmax": "image/object/bbox/xmax",
    "ymax": "image/object/bbox/ymax",
    "bbox_label": "image/object/class/label",
    "width": "image/width",
    "height": "image/height",
    "filename": "image/filename",
}
_MASK_DELTA = 0xA282EAD8


def renamed_features(spec: str | Mapping[str, str]) -> dict[str, str]:
    """The renamings of ``--tfrecord-features`` (a JSON object, or one parsed already), checked
    (ValueError: not such an object, or a key FEATURES does not have)."""
    return named_strings("tfrecord_features", spec, FEATURES, 'a JSON object of feature names, e.g. {"image": "jpeg"}')


def masked_crc(data: bytes | memoryview) -> int:
    """TFRecord's CRC: CRC32C, rotated right by 15 bits, plus a constant."""
    crc = google_crc32c.value(bytes(data))
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


class TFRecordShard(IndexedFile):
    """Every Example of one TFRecord file, in file order.

    Args:
        storage / name: The file (here or in an object store).
        class_names: Names of the labels (``classes.txt`` beside the files), may be empty.
        options: ``index_folder`` and the config's ``tfrecord_features`` (parsed there).
        entry: Its size and version, where the caller listed them.
    """

    kind = "tfrecord"
    key_rule = "filename"  # image/filename where unique in the file (record numbers before)

    def __init__(
        self, storage: Storage, name: str, class_names: list[str], options: FormatOptions, entry: Entry | None = None
    ):
        self.path = storage.location(name)
        self.storage, self.remote = storage, storage.remote
        entry = entry or storage.head(name)
        self.etag = entry.etag
        names = {**FEATURES, **options.config.tfrecord_features}
        self._open_index(
            storage,
            entry,
            basename(name),
            class_names,
            lambda: _scan(storage, name, self.path, names),
            options.index_folder,
        )
        failed = self.failed
        if failed:
            fails = "each fails with the reason when served"
            warn_shard(
                log,
                f"TFRecord files have records that cannot be used: {fails}",
                f"{basename(name)} ({len(failed)}: {failed[min(failed)]})",
                f"{self.path}: {len(failed)} record(s) cannot be used (e.g. record {min(failed)}: "
                f"{failed[min(failed)]}); {fails}",
            )


def _scan(storage: Storage, name: str, where: str, names: dict[str, str]) -> shard_index.Index:
    """Reads the file once: every record's image location, label and boxes; the bad ones' reasons."""
    table = KeyTable()
    digest = hashlib.sha256(json.dumps(names, sort_keys=True).encode())
    failed: dict[int, str] = {}
    filenames: list[str] = []  # each record's image/filename ("": none)
    boxes = False
    if google_crc32c is None:
        raise CatalogError(f"{where}: checking TFRecord CRCs needs google-crc32c: pip install 'remoteloader[server]'")
    with storage.open(name) as reader:
        offset = 0
        while True:
            head = read_up_to(reader, 12)
            if not head:
                break
            key = f"record-{len(table):08d}"
            if len(head) < 12:
                log.warning(
                    "%s: ends in the middle of a record's header at byte %d; the rest is left out", where, offset
                )
                break
            (length,) = struct.unpack("<Q", head[:8])
            if masked_crc(head[:8]) != struct.unpack("<I", head[8:12])[0]:
                log.warning(
                    "%s: the length of the record at byte %d fails its CRC; the %s records after it are left out",
                    where,
                    offset,
                    "file's",
                )
                break
            data = read_up_to(reader, length)
            footer = read_up_to(reader, 4)
            if len(data) < length or len(footer) < 4:
                log.warning("%s: the record at byte %d is cut short (a truncated file); left out", where, offset)
                break
            start = offset + 12
            offset += 16 + length
            problem = ""
            if masked_crc(data) != struct.unpack("<I", footer)[0]:
                problem = f"record {len(table)} at byte {start - 12}: its data fails its CRC (a damaged file)"
            try:
                image, label, targets, filename = _example(memoryview(data), names)
            except (protowire.WireError, ValueError) as exc:
                image, label, targets, filename = None, -1, None, ""
                problem = problem or f"record {len(table)} at byte {start - 12}: not a tf.train.Example ({exc})"
            if image is None:
                problem = problem or f"record {len(table)} at byte {start - 12}: no {names['image']!r} feature"
                image = (0, 0)
            stored = b""
            if targets is not None:
                boxes = True
                stored, _ = tg.stored(tg.to_message(targets))
            index = table.add(key, label, start + image[0], image[1] - image[0], stored)
            filenames.append("" if problem else filename)  # (a damaged record's name is not trusted)
            if problem:
                failed[index] = problem
            digest.update(f"{start + image[0]}\0{image[1] - image[0]}\0{label}\n".encode())
    if not len(table):
        raise CatalogError(f"{where}: no TFRecord records in it")
    if all(filenames) and len(set(filenames)) == len(filenames):
        table.rename(filenames)
    fields = (tg.BBOXES, tg.BBOX_LABELS) if boxes else ()
    if boxes:  # every sample gets a record: an empty one where it has no boxes
        table = _with_empty_targets(table)
    return shard_index.Index(table, digest.hexdigest(), fields, failed)


def _with_empty_targets(table: KeyTable) -> KeyTable:
    """The table with an empty boxes record for each sample that has none."""
    empty, _ = tg.stored(
        tg.to_message({tg.BBOXES: np.zeros((0, 4), np.float32), tg.BBOX_LABELS: np.zeros(0, np.int64)})
    )
    ends = np.frombuffer(table.target_ends, np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    return table.with_targets(table.targets[s:e] if e > s else empty for s, e in zip(starts.tolist(), ends.tolist()))


def _example(data: memoryview, names: dict[str, str]) -> tuple[tuple[int, int] | None, int, dict | None, str]:
    """From a serialized tf.train.Example: the image's (start, end) in ``data``, the label (-1:
    none), the boxes' targets (None: no boxes) and its file name ("": none)."""
    wanted = set(names.values())
    found: dict[str, tuple[int, int, int]] = {}  # feature name -> (kind 1 bytes/2 floats/3 ints, start, end)
    for number, kind, a, b in protowire.fields(data):
        if number != 1 or kind != protowire.LENGTH:  # Example.features
            continue
        for entry_number, entry_kind, ea, eb in protowire.fields(data, a, b):
            if entry_number != 1 or entry_kind != protowire.LENGTH:  # Features.feature (map entry)
                continue
            key, value = "", (0, 0)
            for field, field_kind, fa, fb in protowire.fields(data, ea, eb):
                if field == 1 and field_kind == protowire.LENGTH:
                    key = bytes(data[fa:fb]).decode("utf-8", "replace")
                elif field == 2 and field_kind == protowire.LENGTH:
                    value = (fa, fb)
            if key in wanted:
                for list_kind, _, la, lb in protowire.fields(data, *value):  # Feature: the one list it has
                    found[key] = (list_kind, la, lb)
    image = _first_bytes(data, found.get(names["image"]))
    filename = _text(data, _first_bytes(data, found.get(names["filename"])))
    label = -1
    ints = {k: _ints(data, *found[n][1:]) for k, n in names.items() if n in found and found[n][0] == 3}
    if ints.get("label"):
        label = ints["label"][0]
    corners = [names[k] for k in ("xmin", "ymin", "xmax", "ymax")]
    if not all(c in found for c in corners):
        return image, label, None, filename
    xmin, ymin, xmax, ymax = (np.asarray(_floats(data, *found[c][1:]), np.float32) for c in corners)
    if not len(xmin) == len(ymin) == len(xmax) == len(ymax):
        raise ValueError("its box coordinates are lists of different lengths")
    width, height = (ints.get(k, [0])[0] for k in ("width", "height"))
    if image is not None and not (width and height):
        try:
            _, height, width = read_size(bytes(data[image[0] : image[1]]), 1 << 40)
        except DecodeError as exc:
            raise ValueError(f"its image's size cannot be read ({exc})") from None
    labels = np.asarray(ints.get("bbox_label", []), np.int64)
    if len(labels) != len(xmin):
        raise ValueError(f"{len(xmin)} boxes but {len(labels)} box labels")
    pixels = np.stack([xmin * width, ymin * height, xmax * width, ymax * height], axis=1).reshape(-1, 4)
    return image, label, {tg.BBOXES: pixels.astype(np.float32), tg.BBOX_LABELS: labels}, filename


def _first_bytes(data: memoryview, feature: tuple[int, int, int] | None) -> tuple[int, int] | None:
    """The (start, end) of a BytesList feature's first value (None: no such feature or value)."""
    if feature is None:
        return None
    for field, kind, va, vb in protowire.fields(data, feature[1], feature[2]):  # BytesList.value
        if field == 1 and kind == protowire.LENGTH:
            return va, vb
    return None


def _text(data: memoryview, span: tuple[int, int] | None) -> str:
    """A bytes value as text ("": none, or not UTF-8, which a key must be)."""
    if span is None:
        return ""
    try:
        return bytes(data[span[0] : span[1]]).decode("utf-8")
    except UnicodeDecodeError:
        return ""


def _ints(data: memoryview, start: int, end: int) -> list[int]:
    """An Int64List's values (packed, or not)."""
    out: list[int] = []
    for field, kind, a, b in protowire.fields(data, start, end):
        if field == 1:
            out += (
                [protowire.signed(v) for v in protowire.packed_varints(data, a, b)]
                if kind == protowire.LENGTH
                else [protowire.signed(a)]
            )
    return out


def _floats(data: memoryview, start: int, end: int) -> list[float]:
    """A FloatList's values (packed, or not)."""
    out: list[float] = []
    for field, kind, a, b in protowire.fields(data, start, end):
        if field == 1:
            out += (
                protowire.packed_floats(data, a, b)
                if kind == protowire.LENGTH
                else list(struct.unpack("<f", data[a:b]))
            )
    return out


def shards_at(storage: Storage, name: str, found: Found, options: FormatOptions) -> list[Shard] | None:
    """A TFRecord file is a shard, and so is every one in a folder."""
    return file_shards(
        storage, name, found, SUFFIXES, lambda file, names, entry: TFRecordShard(storage, file, names, options, entry)
    )
