"""Parquet files of images, as Hugging Face ``datasets`` writes them (``Dataset.to_parquet``).

``--data`` a ``.parquet`` file, a folder of them or a glob, here or in an object store. The
columns are found by their types and Hugging Face's names, or named with ``--parquet-columns``
(JSON, e.g. ``{"image": "img", "label": "fine_label", "bbox_format": "pascal_voc"}``):

* ``image``: a binary column, or a ``{bytes, path}`` struct (Hugging Face's ``Image``); the
  first such column unless named. A sample's key is its image's ``path`` where every row of the
  file has one and no two the same, else its row's number in the file, ``row-00000000``...
  (``formats/keys.py`` adds the file where these recur across files);
* ``label``: ``label`` (an integer; Hugging Face's ``ClassLabel`` names become the class names);
* ``labels``: a list of integers per row, served as the multi-label ``labels`` field;
* ``objects``: Hugging Face's detection struct, ``{bbox: [[...] x N], category: [N]}``, served as
  ``bboxes`` (pascal_voc pixels) and ``bbox_labels`` (category + 1, 0 being the background as
  for COCO); its boxes are ``bbox_format`` (``coco``: x, y, width, height, the default, as
  Hugging Face's detection datasets have them; or ``pascal_voc``).

A Parquet file stores its images in pages (compressed or not), not at offsets a decode worker
could read: at the first start a file is read row group by row group, its images copied one
after the other into ``--cache-dir/parquet`` and indexed there like a tar; later starts reuse
both (the file's ETag, or its size and a hash of its ends, must still match). So the first
start reads every image once, and the disk holds them once more: ``remoteloader pack`` makes
tar shards that need neither. Catalog memory is a tar's: no Python object per row.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from remoteloader.server import targets as tg
from remoteloader.server.catalog import CatalogError, KeyTable, Shard, basename
from remoteloader.server.formats import FormatOptions, Found, file_shards, named_strings
from remoteloader.server.formats import index as shard_index
from remoteloader.server.formats.indexed import IndexedFile
from remoteloader.server.storage import Entry, Storage

log = logging.getLogger(__name__)

SUFFIXES = (".parquet",)
COLUMNS = ("image", "label", "labels", "objects", "bbox_format")
BBOX_FORMATS = ("coco", "pascal_voc")
# An extract starts with this line: no image at offset 0, which a worker reads as a whole file.
EXTRACT_HEAD = b"remoteloader parquet images 1\n"


def columns(spec: str | Mapping[str, str]) -> dict[str, str]:
    """The columns ``--parquet-columns`` names (a JSON object, or one parsed already; {} when
    empty), checked. ValueError: not such an object."""
    named = named_strings("parquet_columns", spec, COLUMNS, 'a JSON object, e.g. {"image": "img", "label": "y"}')
    if named.get("bbox_format", "coco") not in BBOX_FORMATS:
        raise ValueError(f"parquet_columns={spec!r}: bbox_format is one of {', '.join(BBOX_FORMATS)}")
    return named


class ParquetShard(IndexedFile):
    """Every row of one Parquet file, in file order, its images extracted once (see above).

    Args:
        storage / name: The file (here or in an object store).
        class_names: ``classes.txt`` beside the files, if any (else the ClassLabel names).
        options: ``index_folder`` (the extracts go beside it) and the config's ``parquet_columns``
            (parsed there).
        entry: Its size and version, where the caller listed them.
    """

    kind = "parquet"
    key_rule = "path"  # the image's path where unique in the file, else row numbers (before: mixed)

    def __init__(
        self, storage: Storage, name: str, class_names: list[str], options: FormatOptions, entry: Entry | None = None
    ):
        if not options.index_folder:
            raise CatalogError(f"{storage.location(name)}: a Parquet file needs a --cache-dir for its images")
        self.origin = storage.location(name)  # (not .source: that is the --source index)
        self.storage, self.object = storage, entry or storage.head(name)
        key = hashlib.sha256(self.origin.encode()).hexdigest()[:32]
        folder = pathlib.Path(options.index_folder).parent / "parquet"
        self.path = str(folder / f"{key}.images")  # the extract the workers read
        self.extract = self.path  # (for the log)
        named = options.config.parquet_columns
        names = class_names or _class_names(storage, name, named)
        # The index is kept with the extract, never beside the Parquet file; it is used only with
        # the whole extract (a missing one holds no samples: extent 0).
        extracted = os.path.getsize(self.path) if os.path.isfile(self.path) else 0
        self._open_index(
            storage,
            self.object,
            basename(name),
            names,
            lambda: _extract(storage, name, self.path, named),
            str(folder),
            beside=False,
            extent=extracted,
            where=self.origin,
        )


def _parquet(storage: Storage, name: str) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CatalogError(
            f"{storage.location(name)}: reading Parquet needs pyarrow: pip install 'remoteloader[parquet]'"
        ) from None
    try:
        return pq.ParquetFile(storage.open(name))
    except Exception as exc:  # pyarrow's ArrowInvalid etc.: not a Parquet file, or a damaged one
        raise CatalogError(f"{storage.location(name)}: not a readable Parquet file ({exc})") from None


def _hf_features(schema: Any) -> dict:
    """Hugging Face's feature descriptions from the schema's metadata ({} without them)."""
    metadata = schema.metadata or {}
    try:
        return json.loads(metadata.get(b"huggingface", b"{}")).get("info", {}).get("features", {})
    except (ValueError, AttributeError):
        return {}


def _class_names(storage: Storage, name: str, named: dict[str, str]) -> list[str]:
    """Hugging Face's ClassLabel names: the label column's, else the objects' categories' after
    "background" (bbox_labels are category + 1)."""
    features = _hf_features(_parquet(storage, name).schema_arrow)
    label = features.get(named.get("label", "label"), {})
    if isinstance(label, dict) and label.get("names"):
        return [str(n) for n in label["names"]]
    objects = features.get(named.get("objects", "objects"), {})
    category = objects.get("category", {}) if isinstance(objects, dict) else {}
    names = category.get("feature", category).get("names", []) if isinstance(category, dict) else []
    return ["background", *map(str, names)] if names else []


def _find_columns(schema: Any, named: dict[str, str], where: str) -> dict[str, str]:
    """The columns to read: those named, else found by type and Hugging Face's names."""
    import pyarrow as pa

    def is_image(t: Any) -> bool:
        return (
            pa.types.is_binary(t)
            or pa.types.is_large_binary(t)
            or (pa.types.is_struct(t) and t.get_field_index("bytes") >= 0)
        )

    found: dict[str, str] = {}
    image = named.get("image") or next((f.name for f in schema if is_image(f.type)), "")
    if not image or schema.get_field_index(image) < 0 or not is_image(schema.field(image).type):
        have = ", ".join(f"{f.name} ({f.type})" for f in schema)
        raise CatalogError(
            f"{where}: no image column{f' {image!r}' if named.get('image') else ''}: expected binary or a "
            f"{{bytes, path}} struct (it has {have}); name it with --parquet-columns '{{\"image\": ...}}'"
        )
    found["image"] = image
    for role, default, check in (
        ("label", "label", pa.types.is_integer),
        ("labels", "labels", lambda t: pa.types.is_list(t) and pa.types.is_integer(t.value_type)),
        ("objects", "objects", pa.types.is_struct),
    ):
        column = named.get(role, default)
        if schema.get_field_index(column) >= 0:
            if not check(schema.field(column).type):
                raise CatalogError(
                    f"{where}: column {column!r} is {schema.field(column).type}, not what a {role} column holds"
                )
            found[role] = column
        elif role in named:
            raise CatalogError(f"{where}: no column {column!r} (--parquet-columns {role})")
    return found


def _extract(storage: Storage, name: str, out: str, named: dict[str, str]) -> shard_index.Index:
    """Copies every image into ``out`` (whole, or not at all), row group by row group; returns
    its index."""
    where = storage.location(name)
    file = _parquet(storage, name)
    found = _find_columns(file.schema_arrow, named, where)
    box_format = named.get("bbox_format", "coco")
    fields = ([tg.LABELS] if "labels" in found else []) + ([tg.BBOXES, tg.BBOX_LABELS] if "objects" in found else [])
    table = KeyTable()
    digest = hashlib.sha256(json.dumps(found, sort_keys=True).encode())
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    partial = f"{out}.{os.getpid()}.partial"
    written = len(EXTRACT_HEAD)
    paths: set[str] = set()  # the images' paths ("": a row without one)
    try:
        with open(partial, "wb") as sink:
            sink.write(EXTRACT_HEAD)
            for group in range(file.num_row_groups):
                for row in file.read_row_group(group, columns=list(found.values())).to_pylist():
                    image, path = _image(row[found["image"]])
                    key = path or f"row-{len(table):08d}"
                    paths.add(path)
                    label = row.get(found.get("label", ""), -1)
                    label = -1 if label is None else int(label)
                    record = b""
                    if fields:
                        row_targets: dict[str, np.ndarray] = {}
                        if "labels" in found:
                            row_targets[tg.LABELS] = np.asarray(row[found["labels"]] or [], np.int64)
                        if "objects" in found:
                            row_targets.update(_objects(row[found["objects"]] or {}, box_format, where, len(table)))
                        record, _ = tg.stored(tg.to_message(row_targets))
                    sink.write(image)
                    table.add(key, label, written, len(image), record)
                    digest.update(f"{key}\0{len(image)}\0{label}\n".encode())
                    written += len(image)
        # Its time is the epoch's start, not now: a file written after the server began indexing
        # is never region-decoded (worker_process), and this one changes only with the index.
        os.utime(partial, ns=(0, 0))
        os.replace(partial, out)  # whole or not at all: a later start reuses only a whole extract
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    if not len(table):
        raise CatalogError(f"{where}: it holds no rows")
    if "" in paths or len(paths) < len(table):  # a path that names no row, or two: every row its number
        table.rename([f"row-{i:08d}" for i in range(len(table))])
    log.info(
        "%s: extracted %d images (%.1f MB) into %s; later starts reuse them", where, len(table), written / 1e6, out
    )
    return shard_index.Index(table, digest.hexdigest(), tuple(fields), {})


def _empty(field: str) -> np.ndarray:
    return np.zeros((0, 4), np.float32) if field == tg.BBOXES else np.zeros(0, np.int64)


def _image(value: Any) -> tuple[bytes, str]:
    """A row's image bytes and its path ("" without one)."""
    if isinstance(value, dict):
        return bytes(value.get("bytes") or b""), str(value.get("path") or "")
    return bytes(value or b""), ""


def _objects(objects: dict, box_format: str, where: str, row: int) -> dict[str, np.ndarray]:
    """Hugging Face's ``objects`` of a row as bboxes (pascal_voc) and bbox_labels (category + 1)."""
    boxes = np.asarray(objects.get("bbox") or [], np.float32).reshape(-1, 4)
    categories = np.asarray(objects.get("category") or [], np.int64)
    if len(categories) != len(boxes):
        raise CatalogError(f"{where}: row {row} has {len(boxes)} boxes but {len(categories)} categories")
    if box_format == "coco":
        boxes = np.concatenate([boxes[:, :2], boxes[:, :2] + boxes[:, 2:]], axis=1)
    return {tg.BBOXES: boxes.astype(np.float32), tg.BBOX_LABELS: categories + 1}


def shards_at(storage: Storage, name: str, found: Found, options: FormatOptions) -> list[Shard] | None:
    """A Parquet file is a shard, and so is every one in a folder."""
    return file_shards(
        storage, name, found, SUFFIXES, lambda file, names, entry: ParquetShard(storage, file, names, options, entry)
    )
