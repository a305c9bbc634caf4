"""LMDB databases: a folder holding ``data.mdb`` (or the file itself), opened read-only and
lock-free, so that any number of servers share it.

Three layouts of values, told apart by what the database holds:

* Caffe ``Datum`` records (Caffe's ``convert_imageset --encoded``; what DALI's Caffe reader
  reads): the image is the Datum's ``data`` (encoded JPEG or PNG), the label its ``label``.
  Raw-pixel Datums (``encoded`` false) are refused, saying how to convert them.
* WebDataset-style keys, as a tar has members (``formats/members.py``): ``<key>.jpg`` an
  encoded image, ``<key>.cls`` its label, ``<key>.json`` its targets, ``<key>.mask.png`` its
  mask; ``classes.txt`` beside ``data.mdb`` (or a ``classes.txt`` key) names the labels.
* Pickled values (``(image, label)`` tuples, or dicts of an image and a label), only with
  ``--lmdb-unpickle``: unpickling runs code from the file, so without that flag such a
  database is refused with the flag's name.

The lmdb module is needed only to index. The decode workers read each image from ``data.mdb``
by offset, as from a tar: a value's offset in the file is its address in LMDB's map, less the
map's start (read once from ``/proc/self/maps``). The index is kept as a tar's is
(``formats/indexed.py``), so a restart does not walk the database again. A database in an
object store is refused: LMDB maps its file into memory, so it must be on this machine.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from typing import Any

import numpy as np

from remoteloader.server import targets as tg
from remoteloader.server.catalog import MAX_JSON_BYTES, CatalogError, KeyTable, Shard, basename, utf8
from remoteloader.server.formats import FormatOptions, Found, members, protowire, read_classes
from remoteloader.server.formats import index as shard_index
from remoteloader.server.formats.indexed import IndexedFile
from remoteloader.server.storage import Storage

log = logging.getLogger(__name__)

DATA = "data.mdb"
JPEG, PNG, PICKLE = b"\xff\xd8\xff", b"\x89PNG", b"\x80"
CLASSES_KEY = b"classes.txt"


class LmdbShard(IndexedFile):
    """Every image of an LMDB database, in key order.

    Args:
        storage / name: The database's folder (where ``data.mdb`` is).
        options: ``index_folder``, and the config's ``lmdb_unpickle`` (read pickled values).
    """

    kind = "lmdb"

    def __init__(self, storage: Storage, name: str, options: FormatOptions):
        if storage.remote:
            raise CatalogError(
                f"{storage.location(name)}: an LMDB database must be on this machine (LMDB maps its file into "
                f"memory): copy it here, or `remoteloader pack` it into tar shards for the store"
            )
        self.folder = storage.location(name)
        self.path = os.path.join(self.folder, DATA)
        self.storage = storage
        classes = read_classes(storage, name)
        entry = storage.head(storage.join(name, DATA))
        self._open_index(
            storage,
            entry,
            basename(self.folder),
            classes,
            lambda: self._scan(options.config.lmdb_unpickle, entry.size),
            options.index_folder,
            where=self.folder,
        )

    def _scan(self, unpickle: bool, size: int) -> shard_index.Index:
        """Walks the database (the class names a ``classes.txt`` key gives in ``classes``)."""
        try:
            import lmdb
        except ImportError:
            raise CatalogError(
                f"{self.folder}: reading LMDB needs the lmdb module: pip install 'remoteloader[lmdb]'"
            ) from None
        try:
            env = lmdb.open(self.folder, readonly=True, lock=False, readahead=False, subdir=True, max_readers=1)
        except lmdb.Error as exc:
            raise CatalogError(f"{self.folder}: not an LMDB database ({exc})") from None
        try:
            base = _map_start(self.path)
            with env.begin(buffers=True) as txn:
                first = next(iter(txn.cursor()), None)
                if first is None:
                    raise CatalogError(f"{self.folder}: the database holds no records")
                layout = _layout(bytes(first[0]), bytes(first[1][:16]), unpickle, self.folder)
                return _index(txn.cursor(), layout, base, size, self.folder)
        finally:
            env.close()


def _map_start(path: str) -> int:
    """Where this process mapped ``path`` from offset 0 (LMDB maps the whole file)."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == real and int(parts[2], 16) == 0:
                return int(parts[0].split("-")[0], 16)
    raise CatalogError(f"{path}: cannot tell where LMDB mapped it (no /proc/self/maps line)")


def _layout(key: bytes, head: bytes, unpickle: bool, where: str) -> str:
    """ "datum", "members" or "pickle", from the first record."""
    if head.startswith(PICKLE):
        if not unpickle:
            raise CatalogError(
                f"{where}: its values are pickles, which only unpickling can read, and unpickling runs code from "
                f"the file; pass --lmdb-unpickle if you trust it, or convert it (one image per <key>.jpg value "
                f"and its label in <key>.cls, or `remoteloader pack`)"
            )
        return "pickle"
    # A member's value is the image itself (or a label, targets): a Datum's is a protobuf, even
    # where its key ends in .JPEG (convert_imageset's keys do).
    if (
        head.startswith((JPEG, PNG))
        or key == CLASSES_KEY
        or members.kind_of(key.decode("utf-8", "replace"))[1]
        in (
            "cls",
            "json",
            "mask",
        )
    ):
        return "members"
    return "datum"


def _address(value: memoryview, base: int) -> int:
    return int(np.frombuffer(value, np.uint8).ctypes.data) - base if len(value) else 0


def _index(cursor: Any, layout: str, base: int, size: int, where: str) -> shard_index.Index:
    table = KeyTable()
    digest = hashlib.sha256(layout.encode())
    extras: dict[int, dict[str, object]] = {}
    classes: list[str] = []
    pending: dict[str, dict[str, object]] = {}  # a stem's members until its image comes
    last_stem, last_index = None, -1
    raw_datums = 0
    for raw_key, value in cursor:
        key = bytes(raw_key).decode("utf-8", "surrogateescape")
        if not utf8(key):  # keys travel as protobuf strings: name it by its bytes
            key = "lmdb:" + bytes(raw_key).hex()
        offset = _address(value, base)
        if not 0 <= offset <= size - len(value):
            raise CatalogError(f"{where}: record {key!r} is not inside {DATA}")
        if layout == "members":
            if raw_key == CLASSES_KEY:
                classes = [line.strip() for line in bytes(value).decode().splitlines() if line.strip()]
                continue
            stem, kind = members.kind_of(key)
            if kind == "image":
                pieces = pending.pop(stem, {})
                last_stem, last_index = stem, table.add(key, int(pieces.pop("cls", -1)), offset, len(value))  # type: ignore[call-overload]
                digest.update(f"{key}\0{offset}\0{len(value)}\n".encode())
                if pieces:
                    extras[last_index] = pieces
                continue
            if kind == "cls":
                piece: object = members.label(bytes(value[:64]), f"{where}: {key}")
            elif kind == "json":
                piece = (
                    bytes(value)
                    if len(value) <= MAX_JSON_BYTES
                    else f"{key} is {len(value)} bytes, over {MAX_JSON_BYTES}"
                )
            elif kind == "mask":
                piece = (offset, len(value))
            else:
                continue
            if stem == last_stem:  # after its image (keys sort X.jpg before X.json and X.mask.png)
                if kind == "cls":
                    table.labels[last_index] = piece
                else:
                    extras.setdefault(last_index, {})[kind] = piece
            else:  # before it (X.cls sorts before X.jpg)
                pending.setdefault(stem, {})[kind] = piece
            continue
        if layout == "pickle":
            image, label = _unpickled(bytes(value), key, where)
            start = bytes(value).find(image)
            if start < 0:
                raise CatalogError(f"{where}: record {key!r}: its image bytes are not stored as they are")
            table.add(key, label, offset + start, len(image))
            digest.update(f"{key}\0{offset + start}\0{len(image)}\n".encode())
            continue
        try:
            datum = _datum(value)
        except protowire.WireError as exc:
            raise CatalogError(f"{where}: record {key!r} is not a Caffe Datum ({exc})") from None
        if datum is None:
            raw_datums += 1
            continue
        start, end, label = datum
        table.add(key, label, offset + start, end - start)
        digest.update(f"{key}\0{offset + start}\0{end - start}\n".encode())
    if raw_datums:
        raise CatalogError(
            f"{where}: {raw_datums} Datum(s) hold raw pixels (encoded=false), which this server does not decode: "
            f"make the database with `convert_imageset --encoded` (JPEG or PNG in each Datum)"
        )
    if not len(table):
        raise CatalogError(f"{where}: the database holds no images")
    fields = members.add_targets(table, extras, where)
    return shard_index.Index(
        table, digest.hexdigest(), tuple(f for f in fields if f != tg.LABEL), {}, None, tuple(classes)
    )


def _datum(value: memoryview) -> tuple[int, int, int] | None:
    """(start, end, label) of a Caffe Datum's encoded image; None for raw pixels."""
    start = end = -1
    label, encoded = -1, None
    for number, _kind, a, b in protowire.fields(value):
        if number == 4:  # data
            start, end = a, b
        elif number == 5:  # label (int32)
            label = protowire.signed(a)
        elif number == 7:  # encoded
            encoded = bool(a)
    if start < 0:
        raise protowire.WireError("no data field")
    if encoded is False or not bytes(value[start : start + 4]).startswith((JPEG, PNG)):
        return None
    return start, end, label


def _unpickled(value: bytes, key: str, where: str) -> tuple[bytes, int]:
    """The image bytes and label of a pickled value: a (image, label) sequence or a dict of them."""
    item = pickle.loads(value)  # noqa: S301 (only with --lmdb-unpickle: the operator trusts the file)
    if isinstance(item, dict):
        image = next(
            (v for k, v in item.items() if k in ("image", "img", "jpg", "data") and isinstance(v, bytes)), None
        )
        label = next((v for k, v in item.items() if k in ("label", "cls", "target", "class")), -1)
    elif isinstance(item, (tuple, list)) and len(item) >= 2:
        image, label = item[0], item[1]
    else:
        image, label = None, -1
    if not isinstance(image, bytes) or not image.startswith((JPEG, PNG)):
        raise CatalogError(
            f"{where}: record {key!r} unpickles to {type(item).__name__}, not an (image bytes, label) pair or a "
            f"dict with an 'image' and a 'label'"
        )
    try:
        return image, int(label)
    except (TypeError, ValueError):
        raise CatalogError(f"{where}: record {key!r}: its label {label!r} is not an integer") from None


def shards_at(storage: Storage, name: str, found: Found, options: FormatOptions) -> list[Shard] | None:
    """A folder holding ``data.mdb``, or the ``data.mdb`` file, is one shard."""
    if found.kind == "file" and basename(name) == DATA:
        return [LmdbShard(storage, name.rpartition("/")[0], options)]
    if found.kind == "folder" and any(basename(e.name) == DATA for e in found.files):
        return [LmdbShard(storage, name, options)]
    return None
