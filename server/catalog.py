"""What a server holds: shards of samples, indexed once at start-up into numpy arrays.

A shard is an ImageFolder tree (``DIR/<class>/<image>``), one WebDataset-style tar file
(``key.jpg`` + ``key.cls``, ``key.json`` targets, ``key.mask.png``), a COCO annotation
file (``coco.py``) or an operator's ``--source`` object (``sources.py``). The files may be on
this machine or in an object store: formats read them through ``storage.py`` and never ask
which. A tar's index is read from ``<tar>.index.npz`` beside it (``pack`` writes one), or
from the index folder (``--cache-dir``), or made by scanning the tar once and kept beside it
where it can be written (a local folder), else in the index folder. Sample keys live
in one bytes blob with an offset array, and so do the samples' targets (each a serialized
``loader_pb2.Targets``): memory grows by the bytes of a sample's key and targets plus
40 bytes, and no Python object is kept per sample. A shard's id is a fingerprint of its
contents' index (names and sizes), so two servers that mount the same files report the same id.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import io
import json
import logging
import os
import pathlib
import tarfile
import time
from array import array
from typing import NamedTuple

import numpy as np

from remoteloader.server import targets as tg
from remoteloader.server.storage import Entry, LocalStorage, Storage, StorageError, open_storage

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
CLASSES_FILE = "classes.txt"
MASK_SUFFIX = ".mask.png"  # a tar sample's semantic mask member: <key>.mask.png
MAX_JSON_BYTES = 4 * tg.MAX_TARGET_BYTES  # a tar sample's <key>.json member


class CatalogError(ValueError):
    """The data path does not hold a usable dataset; the message says what was found."""


class Location(NamedTuple):
    """Where a sample's encoded bytes are: a file (or an object's URL), and a byte range in it;
    ``etag``: the version the object must still have (an object store's; "" where unchecked)."""

    path: str
    offset: int
    length: int
    etag: str = ""


class KeyTable:
    """Append-only index under construction: keys in one blob, numbers in typed arrays."""

    def __init__(self):
        self.blob = bytearray()
        self.ends = array("q")
        self.labels = array("q")
        self.offsets = array("q")
        self.sizes = array("q")
        self.targets = bytearray()  # serialized loader_pb2.Targets, one after the other
        self.target_ends = array("q")

    def add(self, key: str, label: int, offset: int, size: int, targets: bytes = b"") -> int:
        self.blob += key.encode()
        self.ends.append(len(self.blob))
        self.labels.append(label)
        self.offsets.append(offset)
        self.sizes.append(size)
        self.targets += targets
        self.target_ends.append(len(self.targets))
        return len(self.ends) - 1

    def __len__(self) -> int:
        return len(self.ends)


class Shard:
    """An indexed set of samples with labels and targets; subclasses say where the bytes are.

    Per sample it keeps the key bytes and the serialized targets plus five int64 (key end,
    label, offset, size, targets end): about 30 + 40 bytes for an image with a label, and
    no Python object.

    ``fields`` names the target fields its samples carry ("label" when any has a class).
    ``source``: for a ``--source`` shard, its position in the server's sources (the worker
    asks that object for the sample); -1 for files.
    """

    source = -1
    remote = False  # its bytes are in an object store (object_cache.py fetches them) ...
    storage: Storage | None = None  # ... this one

    def __init__(self, name: str, table: KeyTable, class_names: list[str], fingerprint: str, fields=()):
        self.name = name
        self.id = fingerprint
        self.class_names = list(class_names)
        self._key_blob = bytes(table.blob)
        self._key_ends = np.frombuffer(table.ends, dtype=np.int64).copy()
        self.labels = np.frombuffer(table.labels, dtype=np.int64).copy()
        self._offsets = np.frombuffer(table.offsets, dtype=np.int64).copy()
        self._sizes = np.frombuffer(table.sizes, dtype=np.int64).copy()
        self._targets = bytes(table.targets)
        self._target_ends = np.frombuffer(table.target_ends, dtype=np.int64).copy()
        found = set(fields) | ({tg.LABEL} if len(self.labels) and bool(np.any(self.labels >= 0)) else set())
        # In the order of tg.FIELDS, then the extras by name.
        self.fields: tuple[str, ...] = tg.in_order(found)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def nbytes(self) -> int:
        """Bytes of its samples' encoded files (a tar: of the tar, TarShard.object.size)."""
        return int(self._sizes.sum())

    def key(self, index: int) -> str:
        start = int(self._key_ends[index - 1]) if index else 0
        return self._key_blob[start : int(self._key_ends[index])].decode()

    def targets(self, index: int) -> bytes:
        """The sample's serialized ``loader_pb2.Targets`` as its source gave them (b"": none)."""
        start = int(self._target_ends[index - 1]) if index else 0
        return self._targets[start : int(self._target_ends[index])]

    def locate(self, index: int) -> Location:
        raise NotImplementedError


class ImageFolderShard(Shard):
    """``root/<class>/<file>``; labels index the sorted class folder names.

    ``tars_too``: the caller would also have read ``.tar`` shards in ``root`` (a server does;
    ``pack`` does not), which the error for a folder without images then says.
    """

    def __init__(self, storage: Storage, name: str, tars_too: bool = True):
        root = storage.location(name)
        self._base = root + "/"  # a sample's file: base + key
        self.storage, self.remote = storage, storage.remote
        classes = [c for c in storage.children(name)[0] if not c.startswith(".")]
        table = KeyTable()
        digest = hashlib.sha256()
        # The class list is part of the identity: an extra (even empty) class folder shifts labels.
        digest.update(("\0".join(classes) + "\n").encode("utf-8", "surrogateescape"))
        skipped: list[bytes] = []
        empty: list[str] = []
        other: collections.Counter[str] = collections.Counter()
        for label, cls in enumerate(classes):
            files = storage.children(storage.join(name, cls))[1]
            entries = []
            for entry in files:
                file = entry.name.rpartition("/")[2]
                if file.lower().endswith(IMAGE_EXTENSIONS):
                    entries.append((file, entry.size))
                elif not file.startswith("."):  # dotfiles: .DS_Store
                    other[repr(os.path.splitext(file)[1].lower() or "")] += 1
            before = len(table)
            for file, size in entries:
                key = f"{cls}/{file}"
                if not _utf8(key):  # keys travel as protobuf strings, which must be UTF-8
                    skipped.append(key.encode("utf-8", "surrogateescape"))
                    continue
                table.add(key, label, 0, size)
                digest.update(f"{key}\0{size}\n".encode())
            if len(table) == before:
                empty.append(cls)
        if skipped:
            log.warning("%s: skipped %d file(s) whose names are not UTF-8, e.g. %r", root, len(skipped), skipped[0])
        if other:  # e.g. .webp or .bmp images, which would otherwise be missing without a word
            log.warning(
                "%s: left out %d file(s) that are not %s images: %s",
                root,
                sum(other.values()),
                "/".join(IMAGE_EXTENSIONS),
                ", ".join(f"{n} {ext}" for ext, n in other.most_common(5)),
            )
        if not len(table):
            raise CatalogError(
                f"{root} holds no images: expected an ImageFolder tree "
                f"DIR/<class>/<image> with extensions {', '.join(IMAGE_EXTENSIONS)}"
                f"{', or WebDataset .tar shards' if tars_too else ''}"
            )
        if empty:  # kept as classes: dropping one would shift the labels of every class after it
            log.warning(
                "%s: %d class folder(s) hold no %s images: %s; each is still a class (labels follow the "
                "sorted folder names), with no samples; remove the folder if it is not one",
                root,
                len(empty),
                "/".join(IMAGE_EXTENSIONS),
                ", ".join(empty[:5]) + (" ..." if len(empty) > 5 else ""),
            )
        if storage.remote:
            log.warning(
                "%s: an ImageFolder in an object store costs one request per image (%d of them per epoch): "
                "`remoteloader pack FOLDER %s-shards/` on a copy of it writes tar shards to the store, which "
                "servers read in large ranges instead",
                root,
                len(table),
                root,
            )
        super().__init__(name.rpartition("/")[2] or root, table, classes, "if-" + digest.hexdigest()[:24])

    def locate(self, index: int) -> Location:
        # The size was read at indexing time; the worker checks it still matches.
        return Location(self._base + self.key(index), 0, int(self._sizes[index]))


class TarShard(Shard):
    """A WebDataset tar: members ``<key>.jpg|jpeg|png`` with optional ``<key>.cls`` labels,
    ``<key>.json`` targets (an object of the fields in ``targets.py``) and ``<key>.mask.png``
    semantic masks.

    Indexed in one streaming pass over the tar headers (reading only the small ``.cls`` and
    ``.json`` members); a sample's members are expected next to each other (as WebDataset
    writes them), with a fallback for those that are not. A ``.json`` that is not usable
    makes its sample fail with the reason when served, as a damaged image does.
    """

    def __init__(
        self, storage: Storage, name: str, class_names: list[str], index_folder: str = "", entry: Entry | None = None
    ):
        self.path = storage.location(name)
        self.storage, self.remote = storage, storage.remote
        self.object = entry or storage.head(name)  # its size and version, as indexed
        self.etag = self.object.etag
        self.index_error: OSError | None = None  # why a scanned index could be kept neither beside it nor in the folder
        self.index_kept = ""  # where a scanned index was kept
        cached = load_index(storage, self.object, index_folder)
        path = self.path
        if cached is not None:
            table, index_digest, fields = cached
            super().__init__(
                _basename(name),
                table,
                class_names,
                _tar_id(index_digest, table.labels, class_names, table.targets),
                fields,
            )
            self.index_digest = index_digest
        else:
            started = time.perf_counter()
            self._scan(storage, name, class_names)
            log.info(
                "%s has no index: scanned it (%d samples, %.1f MB) in %.1fs",
                self.path,
                len(self),
                self.object.size / 1e6,
                time.perf_counter() - started,
            )
            self.index_kept, self.index_error = save_index(storage, self.object, self, index_folder)
        unlabelled = int(np.count_nonzero(self.labels < 0))
        # A tar made by hand: without this, every sample is served as class -1 without a word
        # (a tar of other targets needs no class).
        if unlabelled and set(self.fields) <= {tg.LABEL}:
            log.warning(
                "%s: %d of %d samples have no label (no <key>.cls member beside <key>.jpg, or an empty one) "
                "and are served with label -1: labels come from <key>.cls members holding the class index "
                "as decimal text, class names from %s (one per line) beside the shards, as `remoteloader "
                "pack` writes them",
                path,
                unlabelled,
                len(self),
                CLASSES_FILE,
            )
        top = int(self.labels.max()) if len(self) else -1
        if top >= len(class_names):  # no classes.txt, or a short one: class_names[label] fails in training code
            log.warning(
                "%s: labels go up to %d but %s beside it names %d class(es); clients get no name for the "
                "others (class_names[label] fails)",
                path,
                top,
                CLASSES_FILE,
                len(class_names),
            )

    def _scan(self, storage: Storage, name: str, class_names: list[str]) -> None:
        path = self.path
        table = KeyTable()
        digest = hashlib.sha256()
        last_stem, last_index = None, -1
        # Members not right after their image (before it, or far after): matched by stem at the end.
        unmatched: dict[str, dict[str, object]] = {}
        extras: dict[int, dict[str, object]] = {}  # sample index -> its "json" bytes and "mask" (offset, size)
        try:
            with storage.open(name) as file, tarfile.open(fileobj=file, mode="r:") as tar:
                while True:
                    member = tar.next()
                    if member is None:
                        break
                    # tarfile keeps every header otherwise (in TarFile.members, which typeshed does not list)
                    tar.members.clear()  # type: ignore[attr-defined]
                    if not member.isfile():
                        continue
                    digest.update(f"{member.name}\0{member.size}\0{member.offset_data}\n".encode())
                    if member.name.lower().endswith(MASK_SUFFIX):
                        stem, kind = member.name[: -len(MASK_SUFFIX)], "mask"
                        value: object = (member.offset_data, member.size)
                    else:
                        stem, _, ext = member.name.rpartition(".")
                        ext = "." + ext.lower()
                        if ext in IMAGE_EXTENSIONS:
                            last_stem = stem
                            pieces = unmatched.pop(stem, {})
                            label = pieces.pop("cls", -1)
                            last_index = table.add(member.name, label, member.offset_data, member.size)  # type: ignore[arg-type]
                            if pieces:
                                extras[last_index] = pieces
                            continue
                        if ext == ".cls":
                            kind, value = "cls", _read_label(tar, member, path)
                        elif ext == ".json":
                            kind, value = "json", _read_member(tar, member)
                        else:
                            continue
                    if stem == last_stem:
                        if kind == "cls":
                            table.labels[last_index] = value
                        else:
                            extras.setdefault(last_index, {})[kind] = value
                    else:
                        unmatched.setdefault(stem, {})[kind] = value
        except (tarfile.TarError, OSError) as exc:
            raise CatalogError(f"{path}: cannot read tar shard: {exc}") from None
        if not len(table):
            raise CatalogError(f"{path} holds no images (expected members <key>.jpg and <key>.cls)")
        if unmatched:  # members whose image came earlier, not just before: match by stem once
            for index in range(len(table)):
                start = table.ends[index - 1] if index else 0
                stem = table.blob[start : table.ends[index]].decode().rpartition(".")[0]
                pieces = unmatched.pop(stem, {})
                if pieces:
                    if "cls" in pieces:
                        table.labels[index] = pieces.pop("cls")
                    if pieces:
                        extras.setdefault(index, {}).update(pieces)
        fields = _add_tar_targets(table, extras, path)
        self.index_digest = digest.hexdigest()
        super().__init__(_basename(name), table, class_names, "", fields)
        self.id = _tar_id(self.index_digest, self.labels, class_names, table.targets)

    def locate(self, index: int) -> Location:
        return Location(self.path, int(self._offsets[index]), int(self._sizes[index]), self.etag)


INDEX_SUFFIX = ".index.npz"
_INDEX_VERSION = 3


def _tar_id(index_digest: str, labels, class_names: list[str], targets: bytes | bytearray = b"") -> str:
    """Members, sizes and offsets (the index digest), labels, targets and class names: all that a
    client sees."""
    digest = hashlib.sha256(index_digest.encode())
    digest.update(np.asarray(labels, dtype=np.int64).tobytes())
    digest.update("\0".join(class_names).encode())
    if targets:
        digest.update(hashlib.sha256(targets).digest())
    return "tar-" + digest.hexdigest()[:24]


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes | str:
    """A small member's bytes, or why they are not read (a str)."""
    if member.size > MAX_JSON_BYTES:
        return f"{member.name} is {member.size} bytes, over the limit of {MAX_JSON_BYTES}"
    reader = tar.extractfile(member)
    assert reader is not None, "a regular file member has contents"
    return reader.read()


def _add_tar_targets(table: KeyTable, extras: dict[int, dict[str, object]], path) -> tuple[str, ...]:
    """Fills the table's targets from the samples' ``.json`` and ``.mask.png`` members; returns
    the fields they carry. A sample whose JSON is not usable gets a record with the error."""
    if not extras:
        return ()  # every sample's record is empty already
    table.targets, table.target_ends = bytearray(), array("q")
    fields: dict[str, None] = {}
    bad = 0
    for index in range(len(table)):
        pieces = extras.get(index, {})
        arrays: dict[str, np.ndarray] = {}
        error = ""
        raw = pieces.get("json")
        if raw is not None:
            try:
                if isinstance(raw, str):
                    raise tg.TargetError(raw)
                label, arrays = tg.from_source(json.loads(raw))  # type: ignore[arg-type]
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
    if bad:
        log.warning(
            "%s: %d sample(s) have targets that cannot be used; each fails with the reason when served", path, bad
        )
    return tuple(fields)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _basename(name: str) -> str:
    return name.rpartition("/")[2]


def _tar_signature(storage: Storage, entry: Entry) -> np.ndarray:
    """Size and a hash of the first and last 64 KiB: survives copies (to a bucket too), catches rewrites."""
    size = entry.size
    head = storage.read(entry.name, 0, min(size, 65536))
    tail = storage.read(entry.name, max(0, size - 65536), size)
    digest = hashlib.sha256(head + tail).digest()
    return np.frombuffer(size.to_bytes(8, "little") + digest, dtype=np.uint8)


def _folder_index(index_folder: str, storage: Storage, entry: Entry) -> pathlib.Path:
    """Where the index folder keeps a tar's index: named by the tar's location."""
    key = hashlib.sha256(storage.location(entry.name).encode()).hexdigest()[:32]
    return pathlib.Path(index_folder) / f"{key}{INDEX_SUFFIX}"


def load_index(storage: Storage, entry: Entry, index_folder: str = "") -> tuple[KeyTable, str, tuple[str, ...]] | None:
    """The tar's index, if one matches it: ``<tar>.index.npz`` beside it (written by pack or a
    first start), else the one kept in ``index_folder``."""
    raw = None
    with contextlib.suppress(OSError):
        raw = storage.read(entry.name + INDEX_SUFFIX)
    if raw is not None:
        found = _parse_index(raw, storage, entry)
        if found is not None:
            return found
    if index_folder:
        with contextlib.suppress(OSError):
            return _parse_index(_folder_index(index_folder, storage, entry).read_bytes(), storage, entry)
    return None


def _parse_index(raw: bytes, storage: Storage, entry: Entry) -> tuple[KeyTable, str, tuple[str, ...]] | None:
    """An index's table, digest and fields, if it is whole and made from this very tar (its ETag,
    where it saved one, else its size and first and last 64 KiB)."""
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as data:
            if int(data["version"]) != _INDEX_VERSION:
                return None
            etag = str(data["etag"]) if "etag" in data.files else ""
            if not (etag and etag == entry.etag):
                if not np.array_equal(data["signature"], _tar_signature(storage, entry)):
                    return None
            table = KeyTable()
            table.blob = bytearray(data["blob"].tobytes())
            table.targets = bytearray(data["targets"].tobytes())
            for name in ("ends", "labels", "offsets", "sizes", "target_ends"):
                setattr(table, name, array("q", data[name].astype(np.int64).tobytes()))
            digest = str(data["index_digest"])
            fields = tuple(str(f) for f in data["fields"])
    except Exception:  # unreadable, damaged or foreign: index the tar itself
        return None
    ends = np.frombuffer(table.ends, dtype=np.int64)
    offsets, sizes = np.frombuffer(table.offsets, dtype=np.int64), np.frombuffer(table.sizes, dtype=np.int64)
    target_ends = np.frombuffer(table.target_ends, dtype=np.int64)
    consistent = (
        len(ends) == len(table.labels) == len(offsets) == len(sizes) == len(target_ends) > 0
        and target_ends[-1] == len(table.targets)
        and bool(np.all(np.diff(target_ends) >= 0))
        and target_ends[0] >= 0
        and ends[-1] == len(table.blob)
        and bool(np.all(np.diff(ends) > 0))
        and ends[0] > 0
        and bool(np.all(offsets >= 0))
        and bool(np.all(offsets + sizes <= entry.size))
    )
    return (table, digest, fields) if consistent else None


def index_bytes(shard: TarShard, signature: np.ndarray, etag: str = "") -> bytes:
    """A tar's index as ``<tar>.index.npz`` holds it (``etag``: the object's, where it has one)."""
    out = io.BytesIO()
    np.savez(
        out,
        version=_INDEX_VERSION,
        signature=signature,
        etag=np.str_(etag),
        index_digest=np.str_(shard.index_digest),
        blob=np.frombuffer(shard._key_blob, dtype=np.uint8),
        ends=shard._key_ends,
        labels=shard.labels,
        offsets=shard._offsets,
        sizes=shard._sizes,
        targets=np.frombuffer(shard._targets, dtype=np.uint8),
        target_ends=shard._target_ends,
        fields=np.array([f for f in shard.fields if f != tg.LABEL], dtype=np.str_),
    )
    return out.getvalue()


def save_index(storage: Storage, entry: Entry, shard: TarShard, index_folder: str = "") -> tuple[str, OSError | None]:
    """Keeps a scanned tar's index (best effort): beside the tar on a writable local folder, else in
    ``index_folder`` (never in an object store: the server only reads the operator's bucket).
    Returns where it was kept ("" if nowhere) and why it was not kept beside the tar, or None.

    A read-only folder (a ``:ro`` compose volume, a ``readOnly`` Kubernetes mount) is normal:
    the index then lives in the index folder, or in memory only, and the next start scans again.
    """
    data = index_bytes(shard, _tar_signature(storage, entry), entry.etag)
    error: OSError | None = None
    if not storage.remote:
        try:
            storage.write(entry.name + INDEX_SUFFIX, data)
            return storage.location(entry.name + INDEX_SUFFIX), None
        except OSError as exc:
            error = exc
    if index_folder:
        target = _folder_index(index_folder, storage, entry)
        try:
            LocalStorage(target.parent).write(target.name, data)
            return str(target), error
        except OSError as exc:
            error = error or exc
    return "", error or OSError("no index folder (--cache-dir)")


def _read_label(tar: tarfile.TarFile, member: tarfile.TarInfo, path) -> int:
    reader = tar.extractfile(member)
    assert reader is not None, "a regular file member has contents"
    raw = reader.read(64)
    try:
        return int(raw.strip() or b"-1")
    except ValueError:
        raise CatalogError(f"{path}: {member.name} holds {raw[:20]!r}, not an integer label") from None


class SyntheticShard(Shard):
    """``count`` samples that exist only as labels: for measuring the transport alone."""

    def __init__(self, count: int, num_classes: int = 10):
        table = KeyTable()
        for i in range(count):
            table.add(f"synthetic/{i}", i % num_classes, 0, 0)
        super().__init__(f"synthetic-{count}", table, [f"class{c:02d}" for c in range(num_classes)], f"syn-{count}")

    def locate(self, index: int) -> Location:
        return Location("", 0, 0)


def open_shards(
    paths: list[str],
    image_root: str = "",
    coco_masks: bool = False,
    index_folder: str = "",
    retry_seconds: float = 60.0,
) -> list[Shard]:
    """Indexes every shard under the given paths (folders on this machine or object-store URLs).

    A path may be a tar file, a folder of tar files (with an optional ``classes.txt``
    naming the labels, one per line), an ImageFolder tree, or a COCO annotation ``.json``
    (its images under ``image_root``, default its folder; ``coco_masks``: serve masks).
    ``index_folder`` keeps the indexes of tars scanned where none could be written beside them.
    """
    from remoteloader.server.coco import CocoShard  # it builds on Shard, defined here

    shards: list[Shard] = []
    for raw in paths:
        storage, name = open_storage(raw, retry_seconds)
        kind, entry = _kind(storage, name, raw)
        if kind == "file" and name.lower().endswith(".json"):
            shards.append(CocoShard(storage, name, image_root, coco_masks, retry_seconds))
        elif kind == "file" and name.endswith(".tar"):
            parent = name.rpartition("/")[0]
            shards.append(TarShard(storage, name, _read_classes(storage, parent), index_folder, entry))
        elif kind == "folder":
            tars = [e for e in storage.children(name)[1] if e.name.endswith(".tar")]
            if tars:
                names = _read_classes(storage, name)
                with concurrent.futures.ThreadPoolExecutor(16 if storage.remote else 1) as pool:
                    # (requests to a store overlap; a local disk is read one tar at a time)
                    opened = [pool.submit(TarShard, storage, e.name, names, index_folder, e) for e in tars]
                    shards.extend(f.result() for f in opened)
            else:
                shards.append(ImageFolderShard(storage, name))
        else:
            raise CatalogError(
                f"data path {raw!r} is neither a folder, a .tar file nor a COCO .json file"
                if kind
                else f"data path {raw!r} does not exist"
            )
    _warn_unsaved_indexes([s for s in shards if isinstance(s, TarShard) and s.index_error is not None])
    ids = [s.id for s in shards]
    if len(set(ids)) != len(ids):
        raise CatalogError("the same shard is listed twice in --data")
    return shards


def _kind(storage: Storage, name: str, raw: str) -> tuple[str, Entry | None]:
    """Whether ``name`` is a "file", a "folder" or nothing (""), with the file's entry."""
    if not storage.remote:
        path = pathlib.Path(storage.location(name))
        if path.is_dir():
            return "folder", None
        return ("file", storage.head(name)) if path.is_file() else ("other" if path.exists() else "", None)
    try:
        return "file", storage.head(name)
    except FileNotFoundError:
        pass
    except StorageError as exc:
        raise CatalogError(f"data path {raw!r}: {exc}") from None
    try:
        storage.children(name)
        return "folder", None
    except FileNotFoundError:
        return "", None
    except StorageError as exc:
        raise CatalogError(f"data path {raw!r}: {exc}") from None


def _warn_unsaved_indexes(shards: list[TarShard]) -> None:
    """One warning for all the tars scanned at this start whose index could be kept nowhere."""
    if not shards:
        return
    kept = [s for s in shards if s.index_kept]
    lost = [s for s in shards if not s.index_kept]
    error = shards[0].index_error
    assert error is not None, "only shards whose index could not be written beside them"
    if kept:
        log.info(
            "%d tar shard(s) have no %s index beside them and it cannot be written there (%s): their indexes "
            "are kept in the index folder (--cache-dir), and the next start reads them from there",
            len(kept),
            INDEX_SUFFIX,
            error.strerror or error,
        )
    if lost:
        names = ", ".join(_basename(s.path) for s in lost[:3]) + (" ..." if len(lost) > 3 else "")
        log.warning(
            "%d tar shard(s) have no %s index and it can be kept neither beside them nor in an index folder "
            "(%s): indexed in memory, and scanned again at every start (%s). Give the server a writable "
            "--cache-dir, or write the indexes beside the tars with `remoteloader pack`",
            len(lost),
            INDEX_SUFFIX,
            error.strerror or error,
            names,
        )


def _read_classes(storage: Storage, folder: str) -> list[str]:
    """The class names of ``classes.txt`` in a folder of tars, one per line ([] without one)."""
    try:
        text = storage.read(storage.join(folder, CLASSES_FILE)).decode()
    except FileNotFoundError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip()]
