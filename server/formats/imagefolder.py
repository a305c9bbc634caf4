"""ImageFolder trees: ``DIR/<class>/<image>``, labels in the sorted order of the class folders.

On this machine or in an object store (one request per image there: the log says so and
points to ``pack``).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os

from remoteloader.server.catalog import IMAGE_EXTENSIONS, CatalogError, KeyTable, Location, Shard, utf8
from remoteloader.server.formats import FormatOptions, Found
from remoteloader.server.storage import Storage

log = logging.getLogger(__name__)


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
                if not utf8(key):  # keys travel as protobuf strings, which must be UTF-8
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
            loose = sum(e.name.lower().endswith(IMAGE_EXTENSIONS) for e in storage.children(name)[1])
            if loose:
                raise CatalogError(
                    f"{root} holds {loose} image(s) directly, not in class folders: an ImageFolder is "
                    f"DIR/<class>/<image> (the folder names are the labels); move them into one folder "
                    f"per class, or all into one (e.g. {root}/all/) for data without labels"
                )
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
        return Location(self._base + self.name_of(index), 0, int(self._sizes[index]))


def shards_at(storage: Storage, name: str, found: Found, options: FormatOptions) -> list[Shard] | None:
    """Any folder that no other format read is an ImageFolder tree (or an error saying what is in it)."""
    return [ImageFolderShard(storage, name)] if found.kind == "folder" else None
