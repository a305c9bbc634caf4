"""WebDataset-style tar shards: ``<key>.jpg`` with ``<key>.cls``, ``<key>.json`` targets and
``<key>.mask.png`` masks, as ``remoteloader pack`` and WebDataset write them.

A ``.tar`` file, or a folder of them (with ``classes.txt`` naming the labels), here or in an
object store. A tar is indexed from its ``<tar>.index.npz`` (``formats/index.py``), or
scanned once and its index kept for the next start (``formats/indexed.py``).
"""

from __future__ import annotations

import hashlib
import logging
import tarfile

import numpy as np

from remoteloader.server import targets as tg
from remoteloader.server.catalog import (
    CLASSES_FILE,
    IMAGE_EXTENSIONS,
    MASK_SUFFIX,
    MAX_JSON_BYTES,
    CatalogError,
    KeyTable,
    Shard,
    basename,
    warn_shard,
)
from remoteloader.server.formats import FormatOptions, Found, compressed, file_shards, members
from remoteloader.server.formats import index as shard_index
from remoteloader.server.formats.indexed import IndexedFile
from remoteloader.server.storage import Entry, Storage
from remoteloader.server.video_decode import VIDEO_EXTENSIONS

log = logging.getLogger(__name__)


class TarShard(IndexedFile):
    """A WebDataset tar: members ``<key>.jpg|jpeg|png`` with optional ``<key>.cls`` labels,
    ``<key>.json`` targets (an object of the fields in ``targets.py``) and ``<key>.mask.png``
    semantic masks.

    Indexed in one streaming pass over the tar headers (reading only the small ``.cls`` and
    ``.json`` members); a sample's members are expected next to each other (as WebDataset
    writes them), with a fallback for those that are not. A ``.json`` that is not usable
    makes its sample fail with the reason when served, as a damaged image does.
    """

    kind = "tar"

    def __init__(
        self,
        storage: Storage,
        name: str,
        class_names: list[str],
        index_folder: str = "",
        entry: Entry | None = None,
        verified: np.ndarray | None = None,
    ):
        """``verified``: for a tar without an index, its samples known to decode whole (its
        writer, `remoteloader pack`, knows them): kept in the index it writes."""
        self.path = storage.location(name)
        self.storage, self.remote = storage, storage.remote
        entry = entry or storage.head(name)  # its size and version, as indexed
        self.etag = entry.etag

        def scan() -> shard_index.Index:
            found = self._scan(storage, name)
            if verified is not None:
                assert len(verified) == len(found.table), "one flag per sample, in the tar's order"
                return found._replace(verified=verified)
            return found

        self._open_index(storage, entry, basename(name), class_names, scan, index_folder)
        path = self.path
        unlabelled = int(np.count_nonzero(self.labels < 0))
        # A tar made by hand: without this, every sample is served as class -1 without a word
        # (a tar of other targets needs no class).
        if unlabelled and set(self.fields) <= {tg.LABEL}:
            how = (
                "served with label -1: labels come from <key>.cls members holding the class index as decimal "
                f"text, class names from {CLASSES_FILE} (one per line) beside the shards, as `remoteloader pack` "
                "writes them"
            )
            warn_shard(
                log,
                f"tars have samples with no label (no <key>.cls member beside <key>.jpg, or an empty one), {how}",
                f"{self.name} ({unlabelled} of {len(self)})",
                f"{path}: {unlabelled} of {len(self)} samples have no label (no <key>.cls member beside <key>.jpg, "
                f"or an empty one) and are {how}",
            )
        top = int(self.labels.max()) if len(self) else -1
        if top >= len(class_names):  # no classes.txt, or a short one: class_names[label] fails in training code
            if class_names:
                named, many = (
                    f"{CLASSES_FILE} beside it names {len(class_names)} class(es)",
                    f"beyond the {len(class_names)} class(es) {CLASSES_FILE} beside them names",
                )
            else:
                named, many = f"no {CLASSES_FILE} is beside it to name them", f"but no {CLASSES_FILE} beside them"
            fails = "clients get no name for the others (class_names[label] fails)"
            warn_shard(
                log,
                f"tars have labels {many}: {fails}",
                f"{self.name} (labels up to {top})",
                f"{path}: labels go up to {top} but {named}; {fails}",
            )

    def _scan(self, storage: Storage, name: str) -> shard_index.Index:
        """Reads the tar's headers once (and its small ``.cls`` and ``.json`` members)."""
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
                        if ext in IMAGE_EXTENSIONS or ext in VIDEO_EXTENSIONS:  # (a video: docs/video.md)
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
        fields = members.add_targets(table, extras, path)
        return shard_index.Index(table, digest.hexdigest(), fields, {})


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes | str:
    """A small member's bytes, or why they are not read (a str)."""
    if member.size > MAX_JSON_BYTES:
        return f"{member.name} is {member.size} bytes, over the limit of {MAX_JSON_BYTES}"
    reader = tar.extractfile(member)
    assert reader is not None, "a regular file member has contents"
    return reader.read()


def _read_label(tar: tarfile.TarFile, member: tarfile.TarInfo, path) -> int:
    reader = tar.extractfile(member)
    assert reader is not None, "a regular file member has contents"
    return members.label(reader.read(64), f"{path}: {member.name}")


def shards_at(storage: Storage, name: str, found: Found, options: FormatOptions) -> list[Shard] | None:
    """A ``.tar`` file is a shard, and so is every ``.tar`` in a folder (``.tar.gz`` and ``.tgz``
    too: served from their copy decompressed into --cache-dir, ``formats/compressed.py``)."""

    def make(file: str, names: list[str], entry: Entry | None) -> TarShard:
        if compressed.is_compressed(file):
            local, plain = compressed.decompressed(storage, file, entry, options.index_folder)
            return TarShard(local, plain, names, options.index_folder)
        return TarShard(storage, file, names, options.index_folder, entry)

    return file_shards(storage, name, found, (".tar", *compressed.SUFFIXES), make)
