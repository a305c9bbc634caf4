"""What a server holds: shards of samples, indexed once at start-up into numpy arrays.

A shard is an ImageFolder tree (``DIR/<class>/<image>``) or one WebDataset-style tar file
(``key.jpg`` + ``key.cls``). Sample keys live in one bytes blob with an offset array, so
memory grows by a few tens of bytes per sample and no Python object is kept per sample.
A shard's id is a fingerprint of its contents' index (names and sizes), so two servers
that mount the same files report the same id.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import pathlib
import tarfile
from array import array
from typing import NamedTuple

import numpy as np

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
CLASSES_FILE = "classes.txt"


class CatalogError(ValueError):
    """The data path does not hold a usable dataset; the message says what was found."""


class Location(NamedTuple):
    """Where a sample's encoded bytes are: a file, and a byte range in it."""

    path: str
    offset: int
    length: int


class KeyTable:
    """Append-only index under construction: keys in one blob, numbers in typed arrays."""

    def __init__(self):
        self.blob = bytearray()
        self.ends = array("q")
        self.labels = array("q")
        self.offsets = array("q")
        self.sizes = array("q")

    def add(self, key: str, label: int, offset: int, size: int) -> int:
        self.blob += key.encode()
        self.ends.append(len(self.blob))
        self.labels.append(label)
        self.offsets.append(offset)
        self.sizes.append(size)
        return len(self.ends) - 1

    def __len__(self) -> int:
        return len(self.ends)


class Shard:
    """An indexed set of samples with labels; subclasses say where the bytes are.

    Per sample it keeps the key bytes plus four int64 (key end, label, offset, size):
    about 30 + 32 bytes, and no Python object.
    """

    def __init__(self, name: str, table: KeyTable, class_names: list[str], fingerprint: str):
        self.name = name
        self.id = fingerprint
        self.class_names = list(class_names)
        self._key_blob = bytes(table.blob)
        self._key_ends = np.frombuffer(table.ends, dtype=np.int64).copy()
        self.labels = np.frombuffer(table.labels, dtype=np.int64).copy()
        self._offsets = np.frombuffer(table.offsets, dtype=np.int64).copy()
        self._sizes = np.frombuffer(table.sizes, dtype=np.int64).copy()

    def __len__(self) -> int:
        return len(self.labels)

    def key(self, index: int) -> str:
        start = int(self._key_ends[index - 1]) if index else 0
        return self._key_blob[start : int(self._key_ends[index])].decode()

    def locate(self, index: int) -> Location:
        raise NotImplementedError


class ImageFolderShard(Shard):
    """``root/<class>/<file>``; labels index the sorted class folder names.

    ``tars_too``: the caller would also have read ``.tar`` shards in ``root`` (a server does;
    ``pack`` does not), which the error for a folder without images then says.
    """

    def __init__(self, root: pathlib.Path, tars_too: bool = True):
        self.root = str(root)
        classes = sorted(d.name for d in os.scandir(root) if d.is_dir() and not d.name.startswith("."))
        table = KeyTable()
        digest = hashlib.sha256()
        # The class list is part of the identity: an extra (even empty) class folder shifts labels.
        digest.update(("\0".join(classes) + "\n").encode("utf-8", "surrogateescape"))
        skipped: list[bytes] = []
        empty: list[str] = []
        other: collections.Counter[str] = collections.Counter()
        for label, cls in enumerate(classes):
            files = [e for e in os.scandir(root / cls) if e.is_file()]
            entries = sorted((e.name, e.stat().st_size) for e in files if e.name.lower().endswith(IMAGE_EXTENSIONS))
            other.update(
                repr(os.path.splitext(e.name)[1].lower() or "")
                for e in files  # dotfiles: .DS_Store
                if not e.name.lower().endswith(IMAGE_EXTENSIONS) and not e.name.startswith(".")
            )
            before = len(table)
            for name, size in entries:
                key = f"{cls}/{name}"
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
        super().__init__(root.name, table, classes, "if-" + digest.hexdigest()[:24])

    def locate(self, index: int) -> Location:
        # The size was read at indexing time; the worker checks it still matches.
        return Location(os.path.join(self.root, self.key(index)), 0, int(self._sizes[index]))


class TarShard(Shard):
    """A WebDataset tar: members ``<key>.jpg|jpeg|png`` with optional ``<key>.cls`` labels.

    Indexed in one streaming pass over the tar headers; a sample's members are expected
    next to each other (as WebDataset writes them), with a fallback for those that are not.
    """

    def __init__(self, path: pathlib.Path, class_names: list[str]):
        self.path = str(path)
        self.index_error: OSError | None = None  # why the scanned index could not be written beside the tar
        cached = load_index(path)
        if cached is not None:
            table, index_digest = cached
            super().__init__(path.name, table, class_names, _tar_id(index_digest, table.labels, class_names))
            self.index_digest = index_digest
        else:
            self._scan(path, class_names)
            self.index_error = save_index(path, self)
        unlabelled = int(np.count_nonzero(self.labels < 0))
        if unlabelled:  # a tar made by hand: without this, every sample is served as class -1 without a word
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

    def _scan(self, path: pathlib.Path, class_names: list[str]) -> None:
        table = KeyTable()
        digest = hashlib.sha256()
        last_stem, last_index = None, -1
        unmatched: dict[str, int] = {}  # .cls not right after its image: before it, or far after
        try:
            with tarfile.open(path, "r:") as tar:
                while True:
                    member = tar.next()
                    if member is None:
                        break
                    # tarfile keeps every header otherwise (in TarFile.members, which typeshed does not list)
                    tar.members.clear()  # type: ignore[attr-defined]
                    if not member.isfile():
                        continue
                    stem, _, ext = member.name.rpartition(".")
                    ext = "." + ext.lower()
                    digest.update(f"{member.name}\0{member.size}\0{member.offset_data}\n".encode())
                    if ext in IMAGE_EXTENSIONS:
                        last_stem = stem
                        last_index = table.add(member.name, unmatched.pop(stem, -1), member.offset_data, member.size)
                    elif ext == ".cls":
                        label = _read_label(tar, member, path)
                        if stem == last_stem:
                            table.labels[last_index] = label
                        else:
                            unmatched[stem] = label
        except (tarfile.TarError, OSError) as exc:
            raise CatalogError(f"{path}: cannot read tar shard: {exc}") from None
        if not len(table):
            raise CatalogError(f"{path} holds no images (expected members <key>.jpg and <key>.cls)")
        self.index_digest = digest.hexdigest()
        super().__init__(path.name, table, class_names, "")
        if unmatched:  # labels whose image came earlier, not just before: match by stem once
            for index in range(len(self)):
                found = unmatched.pop(self.key(index).rpartition(".")[0], None)
                if found is not None:
                    self.labels[index] = found
        self.id = _tar_id(self.index_digest, self.labels, class_names)

    def locate(self, index: int) -> Location:
        return Location(self.path, int(self._offsets[index]), int(self._sizes[index]))


INDEX_SUFFIX = ".index.npz"
_INDEX_VERSION = 2


def _tar_id(index_digest: str, labels, class_names: list[str]) -> str:
    """Members, sizes and offsets (the index digest), labels and class names: all that a client sees."""
    digest = hashlib.sha256(index_digest.encode())
    digest.update(np.asarray(labels, dtype=np.int64).tobytes())
    digest.update("\0".join(class_names).encode())
    return "tar-" + digest.hexdigest()[:24]


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _tar_signature(path: pathlib.Path) -> np.ndarray:
    """Size and a hash of the first and last 64 KiB: survives copies, catches rewrites."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(65536)
        f.seek(max(0, size - 65536))
        tail = f.read(65536)
    digest = hashlib.sha256(head + tail).digest()
    return np.frombuffer(size.to_bytes(8, "little") + digest, dtype=np.uint8)


def load_index(path: pathlib.Path) -> tuple[KeyTable, str] | None:
    """The sidecar index ``<tar>.index.npz`` (written by pack or a first start), if it matches the tar."""
    sidecar = pathlib.Path(str(path) + INDEX_SUFFIX)
    if not sidecar.is_file():
        return None
    try:
        with np.load(sidecar, allow_pickle=False) as data:
            if int(data["version"]) != _INDEX_VERSION or not np.array_equal(data["signature"], _tar_signature(path)):
                return None
            table = KeyTable()
            table.blob = bytearray(data["blob"].tobytes())
            for name in ("ends", "labels", "offsets", "sizes"):
                setattr(table, name, array("q", data[name].astype(np.int64).tobytes()))
            digest = str(data["index_digest"])
    except Exception:  # unreadable, damaged or foreign: index the tar itself
        return None
    ends = np.frombuffer(table.ends, dtype=np.int64)
    offsets, sizes = np.frombuffer(table.offsets, dtype=np.int64), np.frombuffer(table.sizes, dtype=np.int64)
    size = path.stat().st_size
    consistent = (
        len(ends) == len(table.labels) == len(offsets) == len(sizes) > 0
        and ends[-1] == len(table.blob)
        and bool(np.all(np.diff(ends) > 0))
        and ends[0] > 0
        and bool(np.all(offsets >= 0))
        and bool(np.all(offsets + sizes <= size))
    )
    return (table, digest) if consistent else None


def save_index(path: pathlib.Path, shard: TarShard) -> OSError | None:
    """Writes the sidecar index beside the tar (best effort); returns why it could not, or None.

    A read-only folder (a ``:ro`` compose volume, a ``readOnly`` Kubernetes mount) is normal:
    the index then lives in memory only, and the next start scans the tar again.
    """
    sidecar = pathlib.Path(str(path) + INDEX_SUFFIX)
    partial = sidecar.with_name(f".{sidecar.name}.{os.getpid()}")
    try:
        with open(partial, "wb") as f:
            np.savez(
                f,
                version=_INDEX_VERSION,
                signature=_tar_signature(path),
                index_digest=np.str_(shard.index_digest),
                blob=np.frombuffer(shard._key_blob, dtype=np.uint8),
                ends=shard._key_ends,
                labels=shard.labels,
                offsets=shard._offsets,
                sizes=shard._sizes,
            )
        os.replace(partial, sidecar)  # atomic: servers sharing the folder never read half a file
        return None
    except OSError as exc:
        with contextlib.suppress(OSError):  # on a read-only mount even unlinking a missing file fails (EROFS)
            partial.unlink(missing_ok=True)
        return exc


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


def open_shards(paths: list[str]) -> list[Shard]:
    """Indexes every shard under the given paths.

    A path may be a tar file, a directory of tar files (with an optional ``classes.txt``
    naming the labels, one per line), or an ImageFolder tree.
    """
    shards: list[Shard] = []
    for raw in paths:
        path = pathlib.Path(raw)
        if path.is_file() and path.suffix == ".tar":
            shards.append(TarShard(path, _read_classes(path.parent)))
        elif path.is_dir():
            tars = sorted(path.glob("*.tar"))
            if tars:
                names = _read_classes(path)
                shards.extend(TarShard(t, names) for t in tars)
            else:
                shards.append(ImageFolderShard(path))
        else:
            raise CatalogError(f"data path {raw!r} is neither a directory nor a .tar file")
    _warn_unsaved_indexes([s for s in shards if isinstance(s, TarShard) and s.index_error is not None])
    ids = [s.id for s in shards]
    if len(set(ids)) != len(ids):
        raise CatalogError("the same shard is listed twice in --data")
    return shards


def _warn_unsaved_indexes(shards: list[TarShard]) -> None:
    """One warning for all the tars scanned at this start whose index could not be kept beside them."""
    if not shards:
        return
    error = shards[0].index_error
    assert error is not None, "only shards whose index could not be written"
    names = ", ".join(pathlib.Path(s.path).name for s in shards[:3]) + (" ..." if len(shards) > 3 else "")
    log.warning(
        "%d tar shard(s) have no %s index beside them and it cannot be written there (%s): indexed in "
        "memory, and scanned again at every start (%s). To start without scanning, run a server once on "
        "a writable copy of the folder and copy the <tar>%s files it writes beside these tars",
        len(shards),
        INDEX_SUFFIX,
        error.strerror or error,
        names,
        INDEX_SUFFIX,
    )


def _read_classes(folder: pathlib.Path) -> list[str]:
    file = folder / CLASSES_FILE
    if not file.exists():
        return []
    return [line.strip() for line in file.read_text().splitlines() if line.strip()]
