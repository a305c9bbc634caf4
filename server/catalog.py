"""What a server holds: shards of samples, indexed once at start-up into numpy arrays.

This module is the contract every format keeps (``server/formats/``, one module each): a
``Shard`` is an indexed set of samples with labels and targets, and ``locate`` says where a
sample's encoded bytes are (a file or an object, and a byte range). Sample keys live in one
bytes blob with an offset array, and so do the samples' targets (each a serialized
``loader_pb2.Targets``): memory grows by the bytes of a sample's key and targets plus 40
bytes, and no Python object is kept per sample. A shard's id is a fingerprint of its contents
(names and sizes, or an index of them), so two servers that read the same files, or the same
objects in a store, report the same id and are replicas of each other.
"""

from __future__ import annotations

from array import array
from typing import NamedTuple

import numpy as np

from remoteloader.server import targets as tg
from remoteloader.server.storage import Entry, Storage

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
CLASSES_FILE = "classes.txt"
MASK_SUFFIX = ".mask.png"  # a tar sample's semantic mask member: <key>.mask.png
MAX_JSON_BYTES = 4 * tg.MAX_TARGET_BYTES  # a sample's JSON targets (a tar's <key>.json member)


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
    # Where every sample is a range of one file or object (a tar, a TFRecord file): its size and
    # version as indexed; None where samples are files of their own.
    object: Entry | None = None
    # A file shard (a tar, a TFRecord file) scanned at this start: where its index was kept, and
    # why it could not be kept beside the file (formats/index.py).
    index_kept = ""
    index_error: OSError | None = None
    # Samples known to be bad when indexed (a TFRecord record whose CRC fails), with why: they
    # fail with that reason when served. Few by nature: a dict, not an array per sample.
    failed: dict[int, str] = {}  # (replaced, never changed in place, by the formats that have any)
    # Samples known to decode whole without error, a bool each (tars whose index `remoteloader
    # pack` wrote: the JPEGs it rewrote losslessly), or None: crops of these may decode their
    # region only from the first epoch (render.Renderer), not only once they have decoded whole.
    verified: np.ndarray | None = None
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

    def failure(self, index: int) -> str:
        """Why the sample is known to be bad ("" when it is not)."""
        return self.failed.get(index, "") if self.failed else ""

    def index_arrays(self) -> dict[str, np.ndarray]:
        """Its index as arrays: what a saved index holds (``formats/index.py``), and KeyTable takes back."""
        return {
            "blob": np.frombuffer(self._key_blob, dtype=np.uint8),
            "ends": self._key_ends,
            "labels": self.labels,
            "offsets": self._offsets,
            "sizes": self._sizes,
            "targets": np.frombuffer(self._targets, dtype=np.uint8),
            "target_ends": self._target_ends,
        }


class SyntheticShard(Shard):
    """``count`` samples that exist only as labels: for measuring the transport alone."""

    def __init__(self, count: int, num_classes: int = 10):
        table = KeyTable()
        for i in range(count):
            table.add(f"synthetic/{i}", i % num_classes, 0, 0)
        super().__init__(f"synthetic-{count}", table, [f"class{c:02d}" for c in range(num_classes)], f"syn-{count}")

    def locate(self, index: int) -> Location:
        return Location("", 0, 0)


def utf8(text: str) -> bool:
    """Whether a key can travel (protobuf strings must be UTF-8)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def basename(name: str) -> str:
    """The last part of a '/'-separated name."""
    return name.rpartition("/")[2]
