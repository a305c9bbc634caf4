"""What a server holds: shards of samples, indexed once at start-up into numpy arrays.

A shard is an ImageFolder tree (``DIR/<class>/<image>``) or one WebDataset-style tar file
(``key.jpg`` + ``key.cls``). Sample keys live in one bytes blob with an offset array, so
memory grows by a few tens of bytes per sample and no Python object is kept per sample.
A shard's id is a fingerprint of its contents' index (names and sizes), so two servers
that mount the same files report the same id.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import tarfile
from typing import NamedTuple

import numpy as np

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
CLASSES_FILE = "classes.txt"


class CatalogError(ValueError):
    """The data path does not hold a usable dataset; the message says what was found."""


class Location(NamedTuple):
    """Where a sample's encoded bytes are: a file, and a byte range in it (length -1: all)."""

    path: str
    offset: int
    length: int


class Shard:
    """An indexed set of samples with labels; subclasses say where the bytes are."""

    def __init__(self, name: str, keys: list[str], labels: np.ndarray, class_names: list[str], fingerprint: str):
        encoded = [k.encode() for k in keys]
        self.name = name
        self.id = fingerprint
        self.class_names = list(class_names)
        self.labels = labels.astype(np.int64)
        self._key_offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(k) for k in encoded], out=self._key_offsets[1:])
        self._key_blob = b"".join(encoded)

    def __len__(self) -> int:
        return len(self.labels)

    def key(self, index: int) -> str:
        start, end = self._key_offsets[index], self._key_offsets[index + 1]
        return self._key_blob[start:end].decode()

    def locate(self, index: int) -> Location:
        raise NotImplementedError


class ImageFolderShard(Shard):
    """``root/<class>/<file>``; labels index the sorted class folder names."""

    def __init__(self, root: pathlib.Path):
        self.root = str(root)
        classes = sorted(d.name for d in os.scandir(root) if d.is_dir() and not d.name.startswith("."))
        keys: list[str] = []
        labels: list[int] = []
        sizes: list[int] = []
        digest = hashlib.sha256()
        for label, cls in enumerate(classes):
            entries = sorted((e.name, e.stat().st_size) for e in os.scandir(root / cls)
                             if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS))
            for name, size in entries:
                key = f"{cls}/{name}"
                keys.append(key)
                labels.append(label)
                sizes.append(size)
                digest.update(f"{key}\0{size}\n".encode())
        if not keys:
            raise CatalogError(f"{root} holds no images: expected an ImageFolder tree "
                               f"DIR/<class>/<image> with extensions {', '.join(IMAGE_EXTENSIONS)}, "
                               f"or WebDataset .tar shards")
        self._sizes = np.asarray(sizes, dtype=np.int64)
        super().__init__(root.name, keys, np.asarray(labels), classes, "if-" + digest.hexdigest()[:24])

    def locate(self, index: int) -> Location:
        # The size was read at indexing time; the worker checks it still matches.
        return Location(os.path.join(self.root, self.key(index)), 0, int(self._sizes[index]))


class TarShard(Shard):
    """A WebDataset tar: members ``<key>.jpg|jpeg|png`` with optional ``<key>.cls`` labels."""

    def __init__(self, path: pathlib.Path, class_names: list[str]):
        self.path = str(path)
        images: dict[str, tuple[str, int, int]] = {}
        labels: dict[str, int] = {}
        digest = hashlib.sha256()
        try:
            with tarfile.open(path, "r:") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    stem, _, ext = member.name.rpartition(".")
                    ext = "." + ext.lower()
                    digest.update(f"{member.name}\0{member.size}\0{member.offset_data}\n".encode())
                    if ext in IMAGE_EXTENSIONS:
                        images[stem] = (member.name, member.offset_data, member.size)
                    elif ext == ".cls":
                        raw = tar.extractfile(member).read(64)
                        try:
                            labels[stem] = int(raw.strip() or b"-1")
                        except ValueError:
                            raise CatalogError(f"{path}: {member.name} holds {raw[:20]!r}, not an integer label") from None
        except (tarfile.TarError, OSError) as exc:
            raise CatalogError(f"{path}: cannot read tar shard: {exc}") from None
        if not images:
            raise CatalogError(f"{path} holds no images (expected members <key>.jpg and <key>.cls)")
        stems = list(images)
        self._offsets = np.fromiter((images[s][1] for s in stems), dtype=np.int64, count=len(stems))
        self._sizes = np.fromiter((images[s][2] for s in stems), dtype=np.int64, count=len(stems))
        label_array = np.fromiter((labels.get(s, -1) for s in stems), dtype=np.int64, count=len(stems))
        super().__init__(path.name, [images[s][0] for s in stems], label_array, class_names,
                         "tar-" + digest.hexdigest()[:24])

    def locate(self, index: int) -> Location:
        return Location(self.path, int(self._offsets[index]), int(self._sizes[index]))


class SyntheticShard(Shard):
    """``count`` samples that exist only as labels: for measuring the transport alone."""

    def __init__(self, count: int, num_classes: int = 10):
        labels = np.arange(count, dtype=np.int64) % num_classes
        super().__init__(f"synthetic-{count}", [f"synthetic/{i}" for i in range(count)], labels,
                         [f"class{c:02d}" for c in range(num_classes)], f"syn-{count}")

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
    ids = [s.id for s in shards]
    if len(set(ids)) != len(ids):
        raise CatalogError("the same shard is listed twice in --data")
    return shards


def _read_classes(folder: pathlib.Path) -> list[str]:
    file = folder / CLASSES_FILE
    return file.read_text().split("\n")[:-1] if file.exists() else []
