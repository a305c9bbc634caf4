"""A file shard's index kept between starts: ``<file>.index.npz`` beside it, or in an index folder.

Indexing a tar (or a TFRecord file) means reading all of it; its index is saved so that the
next start reads only that. It is kept beside the file where that can be written (a local
folder; ``pack`` writes one too), else in the index folder (``--cache-dir/indexes``: a
read-only mount, or an object store, which the server only reads). An index is used only when
it was made from this very file: its ETag where the store gave one, else its size and a hash
of its first and last 64 KiB (which survive a copy, to a bucket too, and catch a rewrite).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import pathlib
from array import array
from typing import Any, NamedTuple

import numpy as np

from remoteloader.server import targets as tg
from remoteloader.server.catalog import KeyTable, Shard
from remoteloader.server.storage import Entry, LocalStorage, Storage

INDEX_SUFFIX = ".index.npz"
VERSION = 3
_ARRAYS = ("ends", "labels", "offsets", "sizes", "target_ends")


class Index(NamedTuple):
    """A loaded index: the shard's table, the digest of the file's members, its target fields,
    the samples known to be bad with why (``Shard.failed``) and those known to decode whole
    (``Shard.verified``)."""

    table: KeyTable
    digest: str
    fields: tuple[str, ...]
    failed: dict[int, str]
    verified: np.ndarray | None = None


def signature(storage: Storage, entry: Entry) -> np.ndarray:
    """Size and a hash of the first and last 64 KiB."""
    size = entry.size
    head = storage.read(entry.name, 0, min(size, 65536))
    tail = storage.read(entry.name, max(0, size - 65536), size)
    digest = hashlib.sha256(head + tail).digest()
    return np.frombuffer(size.to_bytes(8, "little") + digest, dtype=np.uint8)


def _in_folder(folder: str, storage: Storage, entry: Entry) -> pathlib.Path:
    """Where the index folder keeps a file's index: named by the file's location."""
    key = hashlib.sha256(storage.location(entry.name).encode()).hexdigest()[:32]
    return pathlib.Path(folder) / f"{key}{INDEX_SUFFIX}"


def load(
    storage: Storage, entry: Entry, folder: str = "", beside: bool = True, extent: int | None = None
) -> Index | None:
    """The file's index, if one matches it: beside it (unless not ``beside``), else in ``folder``.
    ``extent``: the bytes its samples' offsets lie in, where that is not the file itself (a
    Parquet file's extract); default the file's size."""
    extent = entry.size if extent is None else extent
    raw = None
    with contextlib.suppress(OSError):
        if beside:
            raw = storage.read(entry.name + INDEX_SUFFIX)
    if raw is not None:
        found = _parse(raw, storage, entry, extent)
        if found is not None:
            return found
    if folder:
        with contextlib.suppress(OSError):
            return _parse(_in_folder(folder, storage, entry).read_bytes(), storage, entry, extent)
    return None


def _parse(raw: bytes, storage: Storage, entry: Entry, extent: int) -> Index | None:
    """An index, if it is whole and made from this very file."""
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as data:
            if int(data["version"]) != VERSION:
                return None
            etag = str(data["etag"]) if "etag" in data.files else ""
            if not (etag and etag == entry.etag):
                if not np.array_equal(data["signature"], signature(storage, entry)):
                    return None
            table = KeyTable()
            table.blob = bytearray(data["blob"].tobytes())
            table.targets = bytearray(data["targets"].tobytes())
            for name in _ARRAYS:
                setattr(table, name, array("q", data[name].astype(np.int64).tobytes()))
            digest = str(data["index_digest"])
            fields = tuple(str(f) for f in data["fields"])
            failed = (
                {int(i): str(why) for i, why in zip(data["failed"], data["failures"])} if "failed" in data.files else {}
            )
            verified = (
                np.unpackbits(data["verified"], count=len(table.labels)).astype(np.bool_)
                if "verified" in data.files
                else None
            )
    except Exception:  # unreadable, damaged or foreign: index the file itself
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
        and bool(np.all(offsets + sizes <= extent))
    )
    return Index(table, digest, fields, failed, verified) if consistent else None


def serialize(shard: Shard, digest: str, signed: np.ndarray, etag: str = "") -> bytes:
    """A shard's index as ``<file>.index.npz`` holds it (``etag``: the object's, where it has one)."""
    arrays: dict[str, Any] = {
        "version": VERSION,
        "signature": signed,
        "etag": np.str_(etag),
        "index_digest": np.str_(digest),
        "fields": np.array([f for f in shard.fields if f != tg.LABEL], dtype=np.str_),
        "failed": np.array(sorted(shard.failed), dtype=np.int64),
        "failures": np.array([shard.failed[i] for i in sorted(shard.failed)], dtype=np.str_),
        **shard.index_arrays(),
    }
    if shard.verified is not None:
        arrays["verified"] = np.packbits(shard.verified)
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def save(
    storage: Storage, entry: Entry, shard: Shard, digest: str, folder: str = "", beside: bool = True
) -> tuple[str, OSError | None]:
    """Keeps a scanned file's index (best effort): beside the file on a writable local folder
    (unless not ``beside``), else in ``folder`` (never in an object store: the server only reads
    the operator's bucket).
    Returns where it was kept ("" if nowhere) and why it was not kept beside the file, or None.

    A read-only folder (a ``:ro`` compose volume, a ``readOnly`` Kubernetes mount) is normal:
    the index then lives in the index folder, or in memory only, and the next start scans again.
    """
    data = serialize(shard, digest, signature(storage, entry), entry.etag)
    error: OSError | None = None
    if beside and not storage.remote:
        try:
            storage.write(entry.name + INDEX_SUFFIX, data)
            return storage.location(entry.name + INDEX_SUFFIX), None
        except OSError as exc:
            error = exc
    if folder:
        target = _in_folder(folder, storage, entry)
        try:
            LocalStorage(target.parent).write(target.name, data)
            return str(target), error
        except OSError as exc:
            error = error or exc
    return "", error or OSError("no index folder (--cache-dir)")
