"""A file shard's index kept between starts: ``<file>.index.npz`` beside it, or in an index folder.

Indexing a tar (or a TFRecord file) means reading all of it; its index is saved so that the
next start reads only that (the rule, load else scan and save, is ``formats/indexed.py``'s).
It is kept beside the file where that can be written (a local folder; ``pack`` writes one
too), else in the index folder (``--cache-dir/indexes``: a read-only mount, or an object
store, which the server only reads). An index is used only when it was made from this very
file: its ETag where the store gave one; on a local disk its size
and modification time; else (a copy, which has a new one) its size and a hash of its first and
last 64 KiB (which survive a copy, to a bucket too, and catch a rewrite): a copy's index found
so is written again with the copy's time, where it can be, so that later starts skip the hash.

It is read at every start, up to tens of thousands of them per server: it is one ``.npy``
member in an ``.npz`` (``np.load`` opens it), whose bytes are a small JSON header and the raw
arrays, which the server reads straight from the file's bytes (``_parse``) without unzipping,
and keeps as they are (views, no copy). Version 3 indexes (one ``.npy`` per array, each of
whose headers numpy parses on its own: 1 ms an index) are still read, and written again as
version 4 where they can be.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pathlib
import struct
import zlib
from typing import NamedTuple

import numpy as np

from remoteloader.server import targets as tg
from remoteloader.server.catalog import KeyTable, Shard
from remoteloader.server.storage import Entry, LocalStorage, Storage

INDEX_SUFFIX = ".index.npz"
VERSION = 4
_ARRAYS = ("ends", "labels", "offsets", "sizes", "target_ends")
_MAGIC = b"RLINDEX4"  # where version 4's own bytes start, inside the .npy member
# The arrays in their order; each is stored in the narrowest of these types its values fit (and kept
# in memory so: a sample of a 256 MB tar costs its key plus 16 bytes, not 40).
_LAYOUT = ("blob", "ends", "labels", "offsets", "sizes", "targets", "target_ends", "verified")
_TYPES = ("u1", "<u4", "<i4", "<i8")


class Index(NamedTuple):
    """A loaded (or scanned) index: the shard's table, the digest of the file's members, its
    target fields, the samples known to be bad with why (``Shard.failed``) and those known to
    decode whole (``Shard.verified``); from a scan, the class names the file itself gives (an
    LMDB's ``classes.txt`` key), which the kept index does not hold."""

    table: KeyTable
    digest: str
    fields: tuple[str, ...]
    failed: dict[int, str]
    verified: np.ndarray | None = None
    classes: tuple[str, ...] = ()
    keys: str = ""  # how its format named the samples (``IndexedFile.key_rule``): "" the first way


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


def _mtime(storage: Storage, entry: Entry, path: str = "") -> int | None:
    """A local file's modification time (ns), None in an object store (or where it cannot be read)."""
    if storage.remote:
        return None
    try:
        return os.stat(path or storage.location(entry.name)).st_mtime_ns
    except OSError:
        return None


def _read_beside(storage: Storage, entry: Entry, path: str) -> bytes:
    """The index beside the file (``path``: the file's, on a local disk, read without the storage:
    this runs once per shard, up to tens of thousands of times a start)."""
    if path:
        with open(path + INDEX_SUFFIX, "rb") as file:
            return file.read()
    return storage.read(entry.name + INDEX_SUFFIX)


def load(
    storage: Storage,
    entry: Entry,
    folder: str = "",
    beside: bool = True,
    extent: int | None = None,
    keys: str = "",
) -> Index | None:
    """The file's index, if one matches it: beside it (unless not ``beside``), else in ``folder``.
    ``extent``: the bytes its samples' offsets lie in, where that is not the file itself (a
    Parquet file's extract); default the file's size. ``keys``: the way its format names samples
    now; an index whose keys were named another way is not used (the file is scanned again)."""
    extent = entry.size if extent is None else extent
    path = "" if storage.remote else storage.location(entry.name)
    mtime = _mtime(storage, entry, path)
    raw = None
    with contextlib.suppress(OSError):
        if beside:
            raw = _read_beside(storage, entry, path)
    if raw is not None:
        found = _parse(raw, storage, entry, extent, mtime)
        if found is not None and found[0].keys == keys:
            if found[1] and not storage.remote:  # a copy's, or version 3: written again, to read fast
                with contextlib.suppress(OSError):
                    storage.write(entry.name + INDEX_SUFFIX, _serialize(found[0], entry, mtime, found[2]))
            return found[0]
    if folder:
        with contextlib.suppress(OSError):
            target = _in_folder(folder, storage, entry)
            found = _parse(target.read_bytes(), storage, entry, extent, mtime)
            if found is not None and found[0].keys == keys:
                if found[1]:
                    with contextlib.suppress(OSError):
                        LocalStorage(target.parent).write(target.name, _serialize(found[0], entry, mtime, found[2]))
                return found[0]
    return None


def _parse(
    raw: bytes, storage: Storage, entry: Entry, extent: int, mtime: int | None
) -> tuple[Index, bool, np.ndarray] | None:
    """An index, if it is whole and made from this very file; whether to write it again (it was
    matched by its hash, or is version 3), and the file's signature (an empty one where not read)."""
    start = raw.find(_MAGIC, 0, 1024)
    try:
        if start < 0:
            return _parse_v3(raw, storage, entry, extent)
        (length,) = struct.unpack_from("<I", raw, start + len(_MAGIC))
        at = start + len(_MAGIC) + 4
        header = json.loads(raw[at : at + length])
        if header["version"] != VERSION or header["size"] != entry.size:
            return None
        signed = np.frombuffer(bytes.fromhex(header["signature"]), dtype=np.uint8)
        stale = False
        if not (header["etag"] and header["etag"] == entry.etag) and not (
            mtime is not None and header["mtime_ns"] == mtime
        ):
            signed = signature(storage, entry)  # a copy, or a file changed in place
            if not np.array_equal(np.frombuffer(bytes.fromhex(header["signature"]), dtype=np.uint8), signed):
                return None
            stale = mtime is not None
        arrays: dict[str, np.ndarray] = {}
        at = _aligned(at + length, start)
        counts, types = header["counts"], header["types"]
        if len(counts) != len(_LAYOUT) or len(types) != len(_LAYOUT) or not set(types) <= set(_TYPES):
            return None
        body = sum((count * np.dtype(kind).itemsize + 7) // 8 * 8 for kind, count in zip(types, counts))
        if zlib.crc32(memoryview(raw)[at : at + body]) != header["crc32"]:
            return None  # damaged (the zip's own directory follows the member)
        for name, kind, count in zip(_LAYOUT, types, counts):
            arrays[name] = np.frombuffer(raw, dtype=kind, count=count, offset=at)
            at = _aligned(at + count * np.dtype(kind).itemsize, start)
        if not len(arrays["targets"]):  # no sample has targets: every record ends at 0, in no memory
            arrays["target_ends"] = np.broadcast_to(np.zeros(1, np.int64), arrays["labels"].shape)
        table = KeyTable()
        for name in ("blob", *_ARRAYS, "targets"):
            setattr(table, name, arrays[name])
        failed = {int(i): str(why) for i, why in header["failed"]}
        verified = (
            np.unpackbits(arrays["verified"], count=len(table.labels)).astype(np.bool_) if header["verified"] else None
        )
        found = Index(
            table, str(header["index_digest"]), tuple(header["fields"]), failed, verified, keys=header.get("keys", "")
        )
        # Its bytes are as written (the CRC): written from a scan, it holds together; what is checked
        # here is only what the file it indexes could break (an extent smaller than at writing).
        labels = table.labels
        whole = (
            0 < len(labels) == len(table.ends) == len(table.offsets) == len(table.sizes) == len(table.target_ends)
            and table.ends[-1] == len(table.blob)
            and table.target_ends[-1] == len(table.targets)
            and (extent >= header["extent"] or int((table.offsets.astype(np.int64) + table.sizes).max()) <= extent)
        )
    except Exception:  # unreadable, damaged or foreign: index the file itself
        return None
    return (found, stale, signed) if whole else None


def _aligned(at: int, start: int) -> int:
    """The next 8-byte boundary after ``at``, counted from the start of version 4's bytes."""
    return start + (at - start + 7) // 8 * 8


def _parse_v3(raw: bytes, storage: Storage, entry: Entry, extent: int) -> tuple[Index, bool, np.ndarray] | None:
    """A version 3 index (one ``.npy`` per array), to be written again as version 4."""
    with np.load(io.BytesIO(raw), allow_pickle=False) as data:
        if int(data["version"]) != 3:
            return None
        etag = str(data["etag"]) if "etag" in data.files else ""
        signed = data["signature"]
        if not (etag and etag == entry.etag):
            if not np.array_equal(signed, signature(storage, entry)):
                return None
        table = KeyTable()
        table.blob = data["blob"].astype(np.uint8)
        table.targets = data["targets"].astype(np.uint8)
        for name in _ARRAYS:
            setattr(table, name, data[name].astype(np.int64))
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
    found = Index(table, digest, fields, failed, verified)
    return (found, True, signed) if _consistent(table, extent) else None


def _consistent(table: KeyTable, extent: int) -> bool:
    """Whether a loaded index holds together (lengths, ends, offsets within the file)."""
    ends, labels = np.asarray(table.ends), np.asarray(table.labels)
    offsets, sizes = np.asarray(table.offsets), np.asarray(table.sizes)
    target_ends = np.asarray(table.target_ends)
    return bool(
        len(ends) == len(labels) == len(offsets) == len(sizes) == len(target_ends) > 0
        and target_ends[-1] == len(table.targets)
        and np.all(np.diff(target_ends) >= 0)
        and target_ends[0] >= 0
        and ends[-1] == len(table.blob)
        and np.all(np.diff(ends) > 0)
        and ends[0] > 0
        and np.all(offsets >= 0)
        and np.all(offsets + sizes <= extent)
    )


def serialize(shard: Shard, digest: str, entry: Entry, signed: np.ndarray, mtime: int | None = None) -> bytes:
    """A shard's index as ``<file>.index.npz`` holds it: made from the file ``entry`` (its size,
    and ETag where it has one), whose signature is ``signed`` and modification time ``mtime`` (ns;
    None in an object store)."""
    found = Index(_table(shard.index_arrays()), digest, shard.fields, shard.failed, shard.verified, keys=shard.key_rule)
    return _serialize(found, entry, mtime, signed)


def _table(arrays: dict[str, np.ndarray]) -> KeyTable:
    table = KeyTable()
    for name, values in arrays.items():
        setattr(table, name, values)
    return table


def _narrowest(values: np.ndarray) -> str:
    """The narrowest of _TYPES that holds every value (int64 arrays)."""
    if not len(values):
        return "<u4"
    low, high = int(values.min()), int(values.max())
    if low >= 0 and high < 2**32:
        return "<u4"
    return "<i4" if -(2**31) <= low and high < 2**31 else "<i8"


def _serialize(found: Index, entry: Entry, mtime: int | None, signed: np.ndarray) -> bytes:
    """Version 4: one uint8 ``.npy`` member ("index") holding _MAGIC, the header's length and JSON,
    then the arrays of _LAYOUT, each from an 8-byte boundary."""
    table = found.table
    arrays: dict[str, np.ndarray] = {
        "blob": np.asarray(table.blob, dtype=np.uint8),
        **{name: np.asarray(getattr(table, name), dtype=np.int64) for name in _ARRAYS},
        "targets": np.asarray(table.targets, dtype=np.uint8),
        "verified": np.packbits(found.verified) if found.verified is not None else np.zeros(0, np.uint8),
    }
    if not len(arrays["targets"]):
        arrays["target_ends"] = np.zeros(0, np.int64)  # all 0: said by the empty targets
    types = [_narrowest(arrays[name]) if name in _ARRAYS else "u1" for name in _LAYOUT]
    pieces = []
    for name, kind in zip(_LAYOUT, types):  # each from an 8-byte boundary
        data = arrays[name].astype(kind, copy=False).tobytes()
        pieces.append(data + b"\0" * (-len(data) % 8))
    body = b"".join(pieces)
    header = json.dumps(
        {
            "version": VERSION,
            "size": entry.size,
            "mtime_ns": mtime,
            "etag": entry.etag,
            "signature": np.asarray(signed, dtype=np.uint8).tobytes().hex(),
            "index_digest": found.digest,
            "fields": [f for f in found.fields if f != tg.LABEL],
            "failed": [[i, found.failed[i]] for i in sorted(found.failed)],
            "verified": found.verified is not None,
            "keys": found.keys,
            "counts": [len(arrays[name]) for name in _LAYOUT],
            "types": types,
            # the bytes its samples lie in (offsets + sizes), and a CRC of the arrays' bytes as written
            "extent": int((arrays["offsets"] + arrays["sizes"]).max(initial=0)),
            "crc32": zlib.crc32(body),
        }
    ).encode()
    head = _MAGIC + struct.pack("<I", len(header)) + header
    out = io.BytesIO()
    np.savez(out, index=np.frombuffer(head + b"\0" * (-len(head) % 8) + body, dtype=np.uint8))
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
    data = serialize(shard, digest, entry, signature(storage, entry), _mtime(storage, entry))
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
