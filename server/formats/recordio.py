"""MXNet RecordIO files (``.rec``, with their ``.idx``), read without MXNet.

``--data`` a ``.rec`` file, a folder of them or a glob: ImageNet lists packed by
``im2rec.py``, InsightFace's face sets (MS1M, Glint360K), multi-label sets. The framing is
dmlc's: each record a magic word (``0xced7230a``), a word of 3 continuation bits and a 29-bit
length, the data, padding to 4 bytes. The writer splits a record where its data holds the
magic word at an aligned offset (continuation 1 the first part, 2 the middle ones, 3 the last,
the magic word dropped between them); the parts are joined again here. Each record's data
starts with MXNet's ``IRHeader`` (``flag``, a float ``label``, ``id``, ``id2``: 24 bytes),
then ``flag`` float labels when ``flag`` > 0, then the image:

* an image record is a sample: a single label (``flag`` 0, or one label) is its class, a label
  vector (``flag`` labels) fills the ``labels`` field (whole numbers only: another value makes
  the sample fail, named, when a loader asks for it);
* a record without an image (InsightFace's header, record 0, whose label is the identity
  records' range, and its identity records, whose labels are the ranges of their images) is
  recognised and left out; the images carry their identity as their class.

A sample's key is its ``.idx`` key when the ``.idx`` is beside the file, else its record's
number. The file is read in one pass (the ``.idx`` gives the keys; every record's framing is
checked) and the index kept as a TFRecord file's is (``formats/index.py``). A bad magic word or
a record cut short stops the server at start-up naming the file and the byte. A split record's
image is not in one piece in the file: for a file on this machine it is joined into
``--cache-dir/recordio`` (such a file is read again at each start, its index not kept); in an
object store it fails, named, when served. ``classes.txt`` beside the files names labels.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import struct
import time
from dataclasses import dataclass, field
from typing import IO

import numpy as np

from remoteloader.server import targets as tg
from remoteloader.server.catalog import CatalogError, KeyTable, Location, Shard, basename
from remoteloader.server.formats import FormatOptions, Found, file_shards, members
from remoteloader.server.formats import index as shard_index
from remoteloader.server.storage import Entry, Storage, read_up_to

log = logging.getLogger(__name__)

SUFFIXES = (".rec",)
MAGIC = 0xCED7230A
HEADER = struct.Struct("<IfQQ")  # IRHeader: flag, label, id, id2
MAX_LABELS = 4096  # a label vector longer than this is not an IRHeader's (a damaged record)


@dataclass
class _Scan:
    """What one pass over a file found."""

    table: KeyTable = field(default_factory=KeyTable)
    failed: dict[int, str] = field(default_factory=dict)
    joined: dict[int, bytes] = field(default_factory=dict)  # a split record's image, by sample
    left_out: int = 0  # records without an image (InsightFace's header and identities)
    multi_label: bool = False


class RecordIOShard(Shard):
    """The image records of one RecordIO file, in file order.

    Args:
        storage / name: The file (here or in an object store).
        class_names: Names of the labels (``classes.txt`` beside the files), may be empty.
        options: ``index_folder`` (kept indexes, and split records' images beside it).
        entry: Its size and version, where the caller listed them.
    """

    def __init__(
        self, storage: Storage, name: str, class_names: list[str], options: FormatOptions, entry: Entry | None = None
    ):
        self.path = storage.location(name)
        self.storage, self.remote = storage, storage.remote
        self.object = entry or storage.head(name)
        self.etag = self.object.etag
        self._joined: dict[int, Location] = {}
        cached = shard_index.load(storage, self.object, options.index_folder)
        if cached is not None:
            table, digest, fields, failed = cached.table, cached.digest, cached.fields, cached.failed
        else:
            started = time.perf_counter()
            scan, digest = _scan(storage, name, self.path)
            table, failed = scan.table, scan.failed
            fields = (tg.LABELS,) if scan.multi_label else ()
            self.scanned = True
            self._join(scan, storage, options.index_folder)
            log.debug(
                "%s has no index: read it (%d images, %d records without one left out) in %.1fs",
                self.path,
                len(table),
                scan.left_out,
                time.perf_counter() - started,
            )
        ident = members.fingerprint("recordio", digest, table.labels, class_names, table.targets)
        super().__init__(basename(name), table, class_names, ident, fields)
        self.failed = failed
        if cached is None and not self._joined:  # (split records' images are joined at each start)
            self.index_kept, self.index_error = shard_index.save(
                storage, self.object, self, digest, options.index_folder
            )

    def _join(self, scan: _Scan, storage: Storage, index_folder: str) -> None:
        """Writes the split records' images, joined, where the workers read them; or, where
        they cannot be (an object store, no --cache-dir), makes them fail with the reason."""
        if not scan.joined:
            return
        if storage.remote or not index_folder:
            for index in scan.joined:
                scan.failed[index] = (
                    "its writer split the record (its data holds RecordIO's magic word), and a "
                    "split record is served from a file on the server's disk only"
                )
            return
        folder = pathlib.Path(index_folder).parent / "recordio"
        folder.mkdir(parents=True, exist_ok=True)
        out = folder / (hashlib.sha256(self.path.encode()).hexdigest()[:16] + ".joined")
        partial = out.with_name(f".{out.name}.{os.getpid()}")
        offset = 0
        with open(partial, "wb") as sink:
            for index, image in scan.joined.items():
                sink.write(image)
                self._joined[index] = Location(str(out), offset, len(image))
                offset += len(image)
        os.replace(partial, out)

    def locate(self, index: int) -> Location:
        joined = self._joined.get(index)
        if joined is not None:
            return joined
        return Location(self.path, int(self._offsets[index]), int(self._sizes[index]), self.etag)


def _records(reader: IO[bytes], where: str):
    """Each record as (its offset, its data's parts: (offset, bytes) each); CatalogError at a bad
    magic word or a record cut short."""
    offset = 0
    parts: list[tuple[int, bytes]] = []
    start = 0
    while True:
        head = read_up_to(reader, 8)
        if not head:
            if parts:
                raise CatalogError(f"{where}: ends inside the record at byte {start} (its last part is missing)")
            return
        if len(head) < 8:
            raise CatalogError(f"{where}: ends in the middle of a record's header at byte {offset} (a cut file)")
        magic, word = struct.unpack("<II", head)
        if magic != MAGIC:
            raise CatalogError(f"{where}: no RecordIO magic word at byte {offset} (a damaged file, or not RecordIO)")
        flag, length = word >> 29, word & ((1 << 29) - 1)
        data = read_up_to(reader, length)
        if len(data) < length:
            raise CatalogError(f"{where}: the record at byte {offset} is cut short: {len(data)} of {length} bytes")
        read_up_to(reader, -length % 4)
        if flag in (0, 1):
            if parts:
                raise CatalogError(f"{where}: the record at byte {start} has no last part")
            start = offset
        elif not parts:
            raise CatalogError(f"{where}: a record's continuation at byte {offset} follows no first part")
        parts.append((offset + 8, data))
        offset += 8 + length + (-length % 4)
        if flag in (0, 3):
            yield start, parts
            parts = []


def _keys(storage: Storage, name: str) -> dict[int, str]:
    """The ``.idx`` beside the file: record offset -> key ({} without one)."""
    index = name[: -len(".rec")] + ".idx" if name.lower().endswith(".rec") else name + ".idx"
    try:
        text = storage.read(index).decode("utf-8", "replace")
    except FileNotFoundError:
        return {}
    keys = {}
    for line in text.splitlines():
        key, _, offset = line.strip().partition("\t")
        if offset.strip().isdigit():
            keys[int(offset)] = key
    return keys


def _scan(storage: Storage, name: str, where: str) -> tuple[_Scan, str]:
    """Reads the file once: every image record's location, label and label vector."""
    scan = _Scan()
    keys = _keys(storage, name)
    digest = hashlib.sha256(b"recordio 1\n")
    vectors: list[tuple[int, np.ndarray]] = []
    with storage.open(name) as reader:
        for number, (start, parts) in enumerate(_records(reader, where)):
            data = parts[0][1] if len(parts) == 1 else struct.pack("<I", MAGIC).join(p for _, p in parts)
            if len(data) < HEADER.size:
                raise CatalogError(f"{where}: the record at byte {start} is too short for an IRHeader")
            flag, label, _id, _id2 = HEADER.unpack_from(data)
            if flag > MAX_LABELS or HEADER.size + 4 * flag > len(data):
                raise CatalogError(f"{where}: the record at byte {start} has a bad IRHeader (flag {flag})")
            skip = HEADER.size + 4 * flag
            if skip == len(data):  # no image: InsightFace's header or an identity's range
                scan.left_out += 1
                continue
            values = np.frombuffer(data, np.float32, flag, HEADER.size) if flag else np.asarray([label], np.float32)
            key = keys.get(start, f"record-{number:08d}")
            problem, label_of = _label(values)
            offset = parts[0][0] + skip
            index = scan.table.add(key, label_of, offset, len(data) - skip)
            if len(values) > 1:
                scan.multi_label = True
                vectors.append((index, values))
            if problem:
                scan.failed[index] = f"record at byte {start}: {problem}"
            if len(parts) > 1:
                scan.joined[index] = data[skip:]
            digest.update(f"{key}\0{offset}\0{len(data) - skip}\0{label_of}\0{values.tobytes().hex()}\n".encode())
    if not len(scan.table):
        raise CatalogError(f"{where}: no image records in it")
    if scan.multi_label:
        scan.table = _with_labels(scan.table, dict(vectors))
    return scan, digest.hexdigest()


def _label(values: np.ndarray) -> tuple[str, int]:
    """(why the class cannot be had or "", the class: -1 for a label vector)."""
    if len(values) > 1:
        return "", -1
    value = float(values[0])
    if not np.isfinite(value) or value != round(value) or value < -1:
        return f"its label {value} is not a class number", -1
    return "", int(value)


def _with_labels(table: KeyTable, vectors: dict[int, np.ndarray]) -> KeyTable:
    """The table with each sample's label vector as its ``labels`` target (empty: none)."""
    return table.with_targets(_label_record(vectors.get(index)) for index in range(len(table)))


def _label_record(values: np.ndarray | None) -> bytes:
    """A sample's stored targets: its label vector (or why it cannot be one)."""
    values = np.zeros(0, np.float32) if values is None else values
    try:
        message = tg.to_message(tg.from_source({tg.LABELS: values.tolist()})[1])
    except tg.TargetError as exc:
        message = tg.to_message({}, f"its label vector: {exc}")
    return tg.stored(message)[0]


def shards_at(storage: Storage, name: str, found: Found, options: FormatOptions) -> list[Shard] | None:
    """A RecordIO file is a shard, and so is every one in a folder."""
    return file_shards(
        storage, name, found, SUFFIXES, lambda file, names, entry: RecordIOShard(storage, file, names, options, entry)
    )
