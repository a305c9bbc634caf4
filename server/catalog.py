"""What a server holds: shards of samples, indexed once at start-up into numpy arrays.

This module is the contract every format keeps (``server/formats/``, one module each): a
``Shard`` is an indexed set of samples with labels and targets, and ``locate`` says where a
sample's encoded bytes are (a file or an object, and a byte range). Sample keys live in one
bytes blob with an offset array, and so do the samples' targets (each a serialized
``loader_pb2.Targets``): memory grows by the bytes of a sample's key and targets plus 40
bytes (16 to 24 from a kept index, which stores each array in the narrowest integer type that
holds it), and no Python object is kept per sample. A shard's id is a fingerprint of its contents
(names and sizes, or an index of them), so two servers that read the same files, or the same
objects in a store, report the same id and are replicas of each other.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from array import array
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from remoteloader.server import targets as tg
from remoteloader.server.seeds import shard_key
from remoteloader.server.storage import Entry, Storage
from remoteloader.server.video_decode import VIDEO_EXTENSIONS

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
CLASSES_FILE = "classes.txt"
MASK_SUFFIX = ".mask.png"  # a tar sample's semantic mask member: <key>.mask.png
MAX_JSON_BYTES = 4 * tg.MAX_TARGET_BYTES  # a sample's JSON targets (a tar's <key>.json member)


class CatalogError(ValueError):
    """The data path does not hold a usable dataset; the message says what was found."""


class ShardWarning(NamedTuple):
    """A warning about one shard, said once for all the shards that have it (``grouped_warnings``)."""

    logger: str
    many: str  # what the shards have, after their count: "tars have labels but no classes.txt ..."
    example: str  # this shard in that line: its file's name, with its own numbers
    message: str  # the whole warning, as said where it is the only shard that has it


_gathered: contextvars.ContextVar[list[ShardWarning] | None] = contextvars.ContextVar(
    "remoteloader_shard_warnings", default=None
)
EXAMPLES = 3  # shards named in a grouped warning


def warn_shard(logger: logging.Logger, many: str, example: str, message: str) -> None:
    """Warns about one shard: now, or while ``grouped_warnings`` gathers them (a server indexing
    20,000 tars), in one line for all the shards that have the same ``many``."""
    gathered = _gathered.get()
    if gathered is None:
        logger.warning("%s", message)
    else:
        gathered.append(ShardWarning(logger.name, many, example, message))


@contextlib.contextmanager
def grouped_warnings() -> Iterator[None]:
    """Gathers ``warn_shard``'s warnings, then says each kind once: as it is for a single shard,
    or "N <many>: e.g. a.tar (...), b.tar (...), ..." (each shard's own line at DEBUG)."""
    gathered: list[ShardWarning] = []
    token = _gathered.set(gathered)
    try:
        yield
    finally:
        _gathered.reset(token)
        groups: dict[tuple[str, str], list[ShardWarning]] = {}
        for warning in gathered:
            groups.setdefault((warning.logger, warning.many), []).append(warning)
        for (name, many), group in groups.items():
            logger = logging.getLogger(name)
            if len(group) == 1:
                logger.warning("%s", group[0].message)
                continue
            for warning in group:
                logger.debug("%s", warning.message)
            examples = ", ".join(w.example for w in group[:EXAMPLES]) + (", ..." if len(group) > EXAMPLES else "")
            logger.warning("%s %s: e.g. %s", f"{len(group):,}", many, examples)


class Location(NamedTuple):
    """Where a sample's encoded bytes are: a file (or an object's URL), and a byte range in it;
    ``etag``: the version the object must still have (an object store's; "" where unchecked)."""

    path: str
    offset: int
    length: int
    etag: str = ""


class KeyTable:
    """Append-only index under construction: keys in one blob, numbers in typed arrays (or an
    index loaded whole: the same fields as numpy arrays, which ``Shard`` keeps without a copy)."""

    blob: Any
    ends: Any
    labels: Any
    offsets: Any
    sizes: Any
    targets: Any
    target_ends: Any

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

    def rename(self, keys: list[str]) -> None:
        """Gives its samples these keys, one each in order (a format that chose its names once
        it had seen them all: a file's own names where no two are the same)."""
        assert len(keys) == len(self.ends)
        self.blob = bytearray()
        self.ends = array("q")
        for key in keys:
            self.blob += key.encode()
            self.ends.append(len(self.blob))

    def __len__(self) -> int:
        return len(self.ends)

    def with_targets(self, records: Iterable[bytes]) -> KeyTable:
        """The same samples with ``records`` (serialized ``loader_pb2.Targets``, one a sample, in
        order) as their targets."""
        out = KeyTable()
        out.blob, out.ends, out.labels, out.offsets, out.sizes = (
            self.blob,
            self.ends,
            self.labels,
            self.offsets,
            self.sizes,
        )
        for record in records:
            out.targets += record
            out.target_ends.append(len(out.targets))
        return out


class Shard:
    """An indexed set of samples with labels and targets; subclasses say where the bytes are.

    Per sample it keeps the key bytes and the serialized targets plus five integers (key end,
    label, offset, size, targets end): int64 as scanned, about 30 + 40 bytes for an image with
    a label; from a kept index each in the narrowest type that holds it, and the targets' ends
    in no memory where no sample has targets: about 30 + 16 bytes for a sample of a 256 MB tar;
    no Python object.

    ``fields`` names the target fields its samples carry ("label" when any has a class).
    ``source``: for a ``--source`` shard, its position in the server's sources (the worker
    asks that object for the sample); -1 for files.
    """

    source = -1
    # Where every sample is a byte range of one file or object (a tar, a TFRecord file, an LMDB
    # database's data, a Parquet file's extract): its location and version, as ``locate`` gives
    # them; "" where samples are files of their own (their formats override ``locate``).
    path = ""
    etag = ""
    # Where every sample is a range of one file or object (a tar, a TFRecord file): its size and
    # version as indexed; None where samples are files of their own.
    object: Entry | None = None
    # A file shard (a tar, a TFRecord file) scanned at this start: where its index was kept, and
    # why it could not be kept beside the file (formats/index.py).
    index_kept = ""
    index_error: OSError | None = None
    scanned = False  # a file shard read whole at this start (no kept index matched it)
    # Samples known to be bad when indexed (a TFRecord record whose CRC fails), with why: they
    # fail with that reason when served. Few by nature: a dict, not an array per sample.
    failed: dict[int, str] = {}  # (replaced, never changed in place, by the formats that have any)
    # Samples known to decode whole without error, a bool each (tars whose index `remoteloader
    # pack` wrote: the JPEGs it rewrote losslessly), or None: crops of these may decode their
    # region only from the first epoch (render.Renderer), not only once they have decoded whole.
    verified: np.ndarray | None = None
    remote = False  # its bytes are in an object store (object_cache.py fetches them) ...
    storage: Storage | None = None  # ... this one
    # "<file>/" where the names its format gives its samples repeat in another shard of the
    # server (a TFRecord record number, a Parquet path): set at start-up by formats/keys.py,
    # never kept in its index (which holds the format's names as they are).
    key_prefix = ""
    # How its format names its samples, where that changed since indexes were first kept (a
    # TFRecord file's ``image/filename``, once its record's number): kept in its index, whose
    # names are not used by a format that now names them another way (formats/index.py).
    key_rule = ""

    def __init__(self, name: str, table: KeyTable, class_names: list[str], fingerprint: str, fields=()):
        self.name = name
        self.id = fingerprint
        # (shared, not copied: the shards of a folder have one list of class names between them)
        self.class_names = class_names if isinstance(class_names, list) else list(class_names)
        self._key_blob = _bytes(table.blob)
        self._key_ends = _ints(table.ends)
        self.labels = _ints(table.labels)
        self._offsets = _ints(table.offsets)
        self._sizes = _ints(table.sizes)
        self._targets = _bytes(table.targets)
        self._target_ends = _ints(table.target_ends)
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
        """The sample's key: unique within the server's data (formats/keys.py), stable across starts."""
        return self.key_prefix + self.name_of(index)

    def name_of(self, index: int) -> str:
        """The sample's name as its format gives it (a file's path under the shard's root, a
        record's number...): its key without the file that ``key_prefix`` may add."""
        start = int(self._key_ends[index - 1]) if index else 0
        return str(self._key_blob[start : int(self._key_ends[index])], "utf-8")

    def targets(self, index: int) -> bytes:
        """The sample's serialized ``loader_pb2.Targets`` as its source gave them (b"": none)."""
        start = int(self._target_ends[index - 1]) if index else 0
        return bytes(self._targets[start : int(self._target_ends[index])])

    def locate(self, index: int) -> Location:
        """Where the sample's encoded bytes are: by default a byte range of ``path``; the formats
        whose samples are files of their own say it themselves."""
        assert self.path, f"{type(self).__name__} locates its samples itself"
        return Location(self.path, int(self._offsets[index]), int(self._sizes[index]), self.etag)

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


def _ints(values: Any) -> np.ndarray:
    """An index's integers: a loaded array as it is (a kept index stores each in the narrowest
    type that holds it), one under construction (``array("q")``) copied into int64."""
    if isinstance(values, np.ndarray):
        return values
    return np.frombuffer(values, dtype=np.int64).copy()


def _bytes(values: Any) -> bytes | memoryview:
    """An index's blob: a loaded one (a uint8 array) as a view of it, a bytearray copied once."""
    if isinstance(values, np.ndarray):
        return memoryview(values.data).cast("B") if len(values) else b""
    return bytes(values)


def media_of(shards: Iterable[Shard]) -> str:
    """What a server's samples are, by each shard's first key: "images", "videos" or "both" (a
    video is a file of ``VIDEO_EXTENSIONS``, in a folder or a tar; no samples: "images")."""
    kinds = {s.key(0).lower().endswith(VIDEO_EXTENSIONS) for s in shards if len(s)}
    return "both" if len(kinds) == 2 else "videos" if True in kinds else "images"


class Catalog:
    """All of a server's shards as one table, so that a chunk's samples are looked up with array
    operations whatever the number of shards they come from (an order of 256 samples from a set
    of 20,000 small tars touches about 250 shards).

    A sample has a server-wide id: its shard's ``starts`` entry plus its index there. The
    shards' label arrays become views of ``labels`` (no copy kept); per shard it keeps its id,
    size, seed key, and whether it is synthetic or in an object store.
    """

    def __init__(self, shards: list[Shard]):
        self.shards = tuple(shards)
        self.ids = tuple(s.id for s in shards)
        self.positions = {shard_id: k for k, shard_id in enumerate(self.ids)}
        self.lengths = np.fromiter((len(s) for s in shards), np.int64, len(shards))
        self.starts = np.concatenate(([0], np.cumsum(self.lengths)[:-1])).astype(np.int64)
        self.seed_keys = np.fromiter((shard_key(s.id) for s in shards), np.uint64, len(shards))
        self.generated = np.fromiter((isinstance(s, SyntheticShard) for s in shards), np.bool_, len(shards))
        self.remote = np.fromiter((s.remote for s in shards), np.bool_, len(shards))
        self.sources = [s.source for s in shards]
        self._failing = np.fromiter((bool(s.failed) for s in shards), np.bool_, len(shards))
        self.labels = _one_array(shards, "labels")
        # Where every shard's samples are ranges of its file (Shard.locate as it is), the ranges
        # too, so that ``locate`` takes a chunk at once.
        self._ranged = bool(shards) and all(type(s).locate is Shard.locate for s in shards)
        if self._ranged:
            self._offsets = _one_array(shards, "_offsets")
            self._sizes = _one_array(shards, "_sizes")
            self._paths = [s.path for s in shards]
            self._etags = [s.etag for s in shards]

    def __len__(self) -> int:
        return len(self.shards)

    def __contains__(self, shard_id: str) -> bool:
        return shard_id in self.positions

    def get(self, shard_id: str) -> Shard | None:
        position = self.positions.get(shard_id)
        return None if position is None else self.shards[position]

    @property
    def samples(self) -> int:
        return int(self.lengths.sum())

    def locate(self, which: np.ndarray, indices: np.ndarray) -> list[Location]:
        """Where each sample's (shard position, index) encoded bytes are (``Shard.locate``)."""
        if not self._ranged:
            shards = self.shards
            return [shards[w].locate(i) for w, i in zip(which.tolist(), indices.tolist())]
        ids = self.starts[which] + indices
        paths, etags = self._paths, self._etags
        return [
            Location(paths[w], offset, size, etags[w])
            for w, offset, size in zip(which.tolist(), self._offsets[ids].tolist(), self._sizes[ids].tolist())
        ]

    def failures(self, which: np.ndarray, indices: np.ndarray) -> list[str]:
        """Why each sample (shard position, index) is known to be bad ("" for most: ``Shard.failure``)."""
        reasons = [""] * len(which)
        for pos in np.flatnonzero(self._failing[which]).tolist():
            reasons[pos] = self.shards[int(which[pos])].failure(int(indices[pos]))
        return reasons

    def verified(self) -> np.ndarray:
        """Per sample (server-wide id), whether its shard's index knows it decodes whole without
        error (``Shard.verified``): a new array, for its owner to update."""
        parts = [s.verified if s.verified is not None else np.zeros(len(s), np.bool_) for s in self.shards]
        return np.concatenate(parts) if parts else np.zeros(0, np.bool_)


def _one_array(shards: list[Shard], name: str) -> np.ndarray:
    """The shards' arrays ``name`` (one value per sample) as one, in the narrowest type that holds
    them all; each shard's becomes a view of it, so nothing is kept twice."""
    if len(shards) == 1:
        return getattr(shards[0], name)
    if not shards:
        return np.zeros(0, np.int64)
    parts = [getattr(shard, name) for shard in shards]
    kind = np.result_type(*(p.dtype for p in parts))
    table = np.concatenate(parts).astype(kind if kind.kind in "iub" else np.int64, copy=False)  # (u8 with i8: float)
    start = 0
    for shard, part in zip(shards, parts):
        setattr(shard, name, table[start : start + len(part)])
        start += len(part)
    return table


class SyntheticShard(Shard):
    """``count`` samples that exist only as labels: for measuring the transport alone.

    Its keys and empty targets are computed, not stored; its labels take one byte a sample
    (``count`` may be 100 million: a table of keys would take minutes and gigabytes)."""

    def __init__(self, count: int, num_classes: int = 10):
        self.name = f"synthetic-{count}"
        self.id = f"syn-{count}"
        self.class_names = [f"class{c:02d}" for c in range(num_classes)]
        kind = np.int8 if num_classes <= 128 else np.int32
        self.labels = np.tile(np.arange(num_classes, dtype=kind), -(-count // num_classes))[:count]
        self.fields = (tg.LABEL,) if count else ()

    @property
    def nbytes(self) -> int:
        return 0

    def key(self, index: int) -> str:
        return f"synthetic/{index}"

    def targets(self, index: int) -> bytes:
        return b""

    def locate(self, index: int) -> Location:
        return Location("", 0, 0)

    def index_arrays(self) -> dict[str, np.ndarray]:
        raise TypeError("a synthetic shard has no index to keep")


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
