"""Compressed tar shards (gzip: ``.tar.gz``, ``.tgz``; zstd: ``.tar.zst``, ``.tzst``),
decompressed once into ``--cache-dir``.

A compressed tar cannot be read at a sample's offset, so ``decompressed`` streams it once
(from this machine, a read-only mount or an object store) into ``--cache-dir/tars`` and says
where the plain tar is; the tar format then indexes and serves that file as any tar (its
samples, keys and shard id are those of the same tar uncompressed). Later starts reuse it:
its name carries a digest of where the compressed file is and its version (ETag, or size and
modification time), so a changed file is decompressed again. The tar is written whole or not
at all (a partial file renamed into place), so servers sharing the folder never read half of
one; a cut or damaged file is refused by name (zstd's reader ends quietly at a cut, so its
frames are checked to end). A large file logs its progress every ``PROGRESS_SECONDS``.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import pathlib
import time
import zlib
from collections.abc import Iterator
from typing import IO

from remoteloader.server.catalog import CatalogError, basename
from remoteloader.server.storage import Entry, LocalStorage, Storage

log = logging.getLogger(__name__)

GZIP = (".tar.gz", ".tgz")
ZSTD = (".tar.zst", ".tzst")
SUFFIXES = GZIP + ZSTD
CHUNK = 4 << 20  # decompressed bytes written at a time (gzip)
ZSTD_INPUT = 64 << 10  # compressed bytes decompressed at a time (zstd)
PROGRESS_SECONDS = 10.0


def is_compressed(name: str) -> bool:
    return name.lower().endswith(SUFFIXES)


def decompressed(storage: Storage, name: str, entry: Entry | None, index_folder: str) -> tuple[LocalStorage, str]:
    """Where the compressed tar ``name`` is as a plain tar on this machine: (its folder, its
    name there), decompressing it first unless an earlier start did. ``index_folder``: the
    server's ``--cache-dir/indexes`` (the tars go beside it)."""
    where = storage.location(name)
    if not index_folder:
        raise CatalogError(f"{where}: a compressed tar needs a --cache-dir to be decompressed into")
    entry = entry or storage.head(name)
    version = entry.etag or f"{entry.size}:{_mtime(storage, name)}"
    digest = hashlib.sha256(f"{where}\0{version}".encode()).hexdigest()[:16]
    stem = basename(name)
    stem = stem[: -len(next(s for s in SUFFIXES if stem.lower().endswith(s)))]
    folder = pathlib.Path(index_folder).parent / "tars"
    out = f"{stem}-{digest}.tar"
    if not (folder / out).is_file():
        folder.mkdir(parents=True, exist_ok=True)
        _decompress(storage, name, entry.size, folder / out)
    return LocalStorage(folder), out


def _mtime(storage: Storage, name: str) -> int:
    if storage.remote:
        return 0
    return os.stat(storage.location(name)).st_mtime_ns


def _decompress(storage: Storage, name: str, size: int, out: pathlib.Path) -> None:
    where = storage.location(name)
    partial = out.with_name(f".{out.name}.{os.getpid()}")
    started = last = time.monotonic()
    written = 0
    try:
        with storage.open(name) as raw, open(partial, "wb") as sink:
            for chunk in (_zstd if name.lower().endswith(ZSTD) else _gzip)(raw):
                sink.write(chunk)
                written += len(chunk)
                if time.monotonic() - last >= PROGRESS_SECONDS:
                    last = time.monotonic()
                    log.info(
                        "%s: decompressing, %.0f of %.0f MB read, %.0f MB written",
                        where,
                        raw.tell() / 1e6,
                        size / 1e6,
                        written / 1e6,
                    )
        os.replace(partial, out)  # whole or not at all
    except (EOFError, zlib.error, gzip.BadGzipFile, _ZstdError) as exc:  # (a cut or damaged file)
        partial.unlink(missing_ok=True)
        kind = "zstd" if name.lower().endswith(ZSTD) else "gzip"
        raise CatalogError(f"{where}: not a whole {kind} file ({exc})") from None
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    log.info(
        "%s: decompressed into %s (%.1f MB) in %.1fs; later starts reuse it",
        where,
        out,
        written / 1e6,
        time.monotonic() - started,
    )


class _ZstdError(Exception):
    """zstandard's ZstdError, where zstandard is installed (the server extra)."""


try:
    from zstandard import ZstdError as _ZstdError  # type: ignore[assignment]  # noqa: F811
except ImportError:  # (a .tar.zst then says so)
    pass


def _gzip(raw: IO[bytes]) -> Iterator[bytes]:
    with gzip.GzipFile(fileobj=raw) as unzipped:
        while chunk := unzipped.read(CHUNK):
            yield chunk


def _zstd(raw: IO[bytes]) -> Iterator[bytes]:
    """The decompressed bytes of every zstd frame in ``raw``; EOFError where the last is cut."""
    try:
        import zstandard
    except ImportError:
        raise CatalogError("a .tar.zst needs zstandard: pip install 'remoteloader[server]'") from None
    frame, fed = zstandard.ZstdDecompressor().decompressobj(), False
    while data := raw.read(ZSTD_INPUT):
        while data:
            out = frame.decompress(data)
            fed = True
            if out:
                yield out
            data = b""
            if frame.eof:  # the next frame starts in what is left
                data, frame, fed = frame.unused_data, zstandard.ZstdDecompressor().decompressobj(), False
    if fed and not frame.eof:
        raise EOFError("the file ends inside a zstd frame")
