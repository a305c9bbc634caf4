"""Where a server's bytes live: a folder on its own disk, or an object store.

This layer knows nothing of formats (``catalog.py`` and ``coco.py`` say what the bytes mean):
it lists objects, says their size and version, and reads them whole, as ranges or as a
seekable stream. ``open_storage(path)`` returns the storage a ``--data`` path names and the
name of what it names inside it:

* a path on this machine: ``LocalStorage`` (names are paths relative to its root);
* ``s3://bucket/prefix``, ``gs://``, ``az://``, ``https://``: ``ObjectStorage``, read with
  obstore (measured against boto3 and s3fs in ``benchmarks/object_store_clients.py``: 5x and
  3.6x the bytes per CPU-second of theirs). Credentials and endpoints come from the standard
  places, never from a client: for S3 ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_ENDPOINT_URL``, ``AWS_REGION`` (``AWS_ALLOW_HTTP=true`` for a plain-HTTP endpoint), or
  the instance's or pod's identity; for GCS and Azure their ``GOOGLE_*`` / ``AZURE_*`` variables.

Timeouts, 5xx answers and throttling (503 SlowDown) are retried with backoff and jitter for up
to ``retry_seconds``; what still fails raises ``StorageError`` naming the URL, with a hint where
the cause is the operator's to fix (credentials, a missing bucket).
"""

from __future__ import annotations

import datetime
import io
import os
import pathlib
import tempfile
from dataclasses import dataclass
from typing import IO, Any, cast

SCHEMES = ("s3://", "s3a://", "gs://", "az://", "abfs://", "abfss://", "azure://", "http://", "https://")
READ_BUFFER = 4 << 20  # a seekable stream's read size (a tar scanned without an index)


class StorageError(OSError):
    """A store that cannot be read: the message names the URL and, where it can, the fix."""


@dataclass(frozen=True)
class Entry:
    """An object (or file): its name under the storage's root, size and version (its ETag; ""
    on a local disk, where a change is seen by size and modification time)."""

    name: str
    size: int
    etag: str = ""


def is_remote(path: str) -> bool:
    """Whether ``path`` names an object store (a URL) rather than this machine's files."""
    return path.lower().startswith(SCHEMES)


class Storage:
    """Objects (or files) under one root, by name; ``url`` is the root as written."""

    url: str
    remote: bool = False

    def walk(self, prefix: str = "") -> list[Entry]:
        """Every object under ``prefix`` (a folder name, "" for all), sorted by name."""
        raise NotImplementedError

    def children(self, prefix: str = "") -> tuple[list[str], list[Entry]]:
        """What is directly in the folder ``prefix``: its subfolders' names and its objects,
        each sorted by name (FileNotFoundError: no such folder)."""
        raise NotImplementedError

    def head(self, name: str) -> Entry:
        """The object's size and version (FileNotFoundError: there is none)."""
        raise NotImplementedError

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        """The object's bytes from ``start`` to ``end`` (exclusive; None: its end)."""
        raise NotImplementedError

    def open(self, name: str) -> IO[bytes]:
        """A seekable binary reader of the object (a tar scanned without an index)."""
        raise NotImplementedError

    def write(self, name: str, data: bytes) -> None:
        """Stores ``data`` as the object, whole or not at all (an index, ``pack``'s output)."""
        raise NotImplementedError

    def upload(self, name: str, path: str | os.PathLike) -> None:
        """Stores a local file as the object (in parts where it is large)."""
        raise NotImplementedError

    def delete(self, name: str) -> None:
        raise NotImplementedError

    def location(self, name: str) -> str:
        """What a sample's Location names: a file path here, or the object's URL."""
        raise NotImplementedError

    def join(self, *names: str) -> str:
        """A name under the root from parts ("" parts dropped)."""
        return "/".join(part.strip("/") for part in names if part.strip("/"))


class LocalStorage(Storage):
    """A folder on this machine (names are '/'-separated paths under it)."""

    def __init__(self, root: str | os.PathLike):
        self.root = pathlib.Path(root)
        self.url = str(self.root)

    def _path(self, name: str) -> pathlib.Path:
        return self.root / name if name else self.root

    def walk(self, prefix: str = "") -> list[Entry]:
        base = self._path(prefix)
        out = []
        for folder, _dirs, files in os.walk(base):
            for file in files:
                path = pathlib.Path(folder) / file
                try:
                    size = path.stat().st_size
                except OSError:  # gone meanwhile, or a dangling link
                    continue
                out.append(Entry(path.relative_to(self.root).as_posix(), size))
        return sorted(out, key=lambda e: e.name)

    def children(self, prefix: str = "") -> tuple[list[str], list[Entry]]:
        folders, files = [], []
        for entry in os.scandir(self._path(prefix)):
            if entry.is_dir():
                folders.append(entry.name)
            elif entry.is_file():
                files.append(Entry(self.join(prefix, entry.name), entry.stat().st_size))
        return sorted(folders), sorted(files, key=lambda e: e.name)

    def head(self, name: str) -> Entry:
        return Entry(name, self._path(name).stat().st_size)

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        with open(self._path(name), "rb") as f:
            f.seek(start)
            return f.read() if end is None else f.read(max(0, end - start))

    def open(self, name: str) -> IO[bytes]:
        return open(self._path(name), "rb")

    def write(self, name: str, data: bytes) -> None:
        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            partial.write_bytes(data)
            os.replace(partial, path)  # atomic: servers sharing the folder never read half a file
        except OSError:
            partial.unlink(missing_ok=True)
            raise

    def location(self, name: str) -> str:
        return str(self._path(name))


class ObjectStorage(Storage):
    """An object store under a URL's bucket and prefix, read with obstore.

    Args:
        url: ``s3://bucket/prefix`` (or gs://, az://, https://).
        retry_seconds: How long a request is retried (timeouts, 5xx, throttling) before it fails.
    """

    remote = True

    def __init__(self, url: str, retry_seconds: float = 60.0):
        from obstore.store import from_url

        self.url = url.rstrip("/")
        self.retry_seconds = retry_seconds
        retry = {
            "max_retries": 1_000,  # bounded by retry_timeout, not by a count
            "retry_timeout": datetime.timedelta(seconds=retry_seconds),
            "backoff": {
                "init_backoff": datetime.timedelta(milliseconds=100),
                "max_backoff": datetime.timedelta(seconds=5),
                "base": 2.0,
            },
        }
        options = {"timeout": "30s", "connect_timeout": "5s"}
        if os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true", "yes"):
            options["allow_http"] = "true"
        try:
            self.store: Any = from_url(self.url, client_options=cast(Any, options), retry_config=cast(Any, retry))
        except Exception as exc:
            raise StorageError(f"{self.url}: cannot use this store: {_reason(exc)}") from None

    def walk(self, prefix: str = "") -> list[Entry]:
        import obstore

        try:
            pages = obstore.list(self.store, prefix + "/" if prefix else None)
            entries = [Entry(m["path"], m["size"], m.get("e_tag") or "") for page in pages for m in page]
        except Exception as exc:
            raise self.error(exc, prefix) from None
        return sorted(entries, key=lambda e: e.name)

    def children(self, prefix: str = "") -> tuple[list[str], list[Entry]]:
        import obstore

        try:
            listed = obstore.list_with_delimiter(self.store, prefix or None)
        except Exception as exc:
            raise self.error(exc, prefix) from None
        folders = sorted(p.rstrip("/").rpartition("/")[2] for p in listed["common_prefixes"])
        files = [Entry(m["path"], m["size"], m.get("e_tag") or "") for m in listed["objects"]]
        if not folders and not files:
            raise FileNotFoundError(f"{self.location(prefix)}: no objects under it")
        return folders, sorted(files, key=lambda e: e.name)

    def head(self, name: str) -> Entry:
        import obstore

        try:
            meta = obstore.head(self.store, name)
        except Exception as exc:
            raise self.error(exc, name) from None
        return Entry(meta["path"], meta["size"], meta.get("e_tag") or "")

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        import obstore

        try:
            if start == 0 and end is None:
                return bytes(obstore.get(self.store, name).bytes())
            if end is None:
                end = self.head(name).size
            if end <= start:
                return b""
            return bytes(obstore.get_range(self.store, name, start=start, end=end))
        except StorageError:
            raise
        except Exception as exc:
            raise self.error(exc, name) from None

    def open(self, name: str) -> IO[bytes]:
        import obstore

        try:
            return cast(IO[bytes], _Reader(obstore.open_reader(self.store, name, buffer_size=READ_BUFFER)))
        except Exception as exc:
            raise self.error(exc, name) from None

    def write(self, name: str, data: bytes) -> None:
        import obstore

        try:
            obstore.put(self.store, name, data)
        except Exception as exc:
            raise self.error(exc, name) from None

    def upload(self, name: str, path: str | os.PathLike) -> None:
        import obstore

        try:
            obstore.put(self.store, name, pathlib.Path(path))
        except Exception as exc:
            raise self.error(exc, name) from None

    def delete(self, name: str) -> None:
        import obstore

        try:
            obstore.delete(self.store, name)
        except Exception as exc:
            raise self.error(exc, name) from None

    def location(self, name: str) -> str:
        return f"{self.url}/{name}"

    async def fetch(self, name: str, start: int, end: int, etag: str = "") -> tuple[Any, int, str]:
        """The bytes of ``[start, end)`` (fewer where the object is shorter), with the object's
        size and ETag as the store gave them; ``etag``: fail unless it still has that one."""
        import obstore

        options: dict[str, Any] = {"range": (start, end)}
        if etag:
            options["if_match"] = etag
        result = await obstore.get_async(self.store, name, options=options)  # type: ignore[arg-type]
        data = await result.bytes_async()  # (a buffer: written to disk as it is, not copied)
        meta = result.meta
        return data, meta["size"], meta.get("e_tag") or ""

    def error(self, exc: BaseException, name: str) -> OSError:
        """What an obstore failure means for ``name``, as an OSError naming the URL."""
        from obstore import exceptions

        where = self.location(name) if name else self.url
        text, full = _reason(exc), str(exc)
        if "NoSuchBucket" in full:
            return StorageError(f"{self.url}: no such bucket ({text}); check the URL, or create the bucket")
        if isinstance(exc, (FileNotFoundError, exceptions.NotFoundError)):
            return FileNotFoundError(f"{where}: no such object")
        if "169.254.169.254" in full:  # no credentials in the environment: it asked the instance metadata service
            return StorageError(
                f"{where}: no credentials for the store ({text}); set its standard variables (for S3: "
                f"AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION) or give the machine an "
                f"identity that may read it"
            )
        if isinstance(exc, (exceptions.PermissionDeniedError, exceptions.UnauthenticatedError)) or any(
            code in full for code in ("403 Forbidden", "401 Unauthorized", "SignatureDoesNotMatch", "AccessDenied")
        ):
            return StorageError(
                f"{where}: the store refused these credentials ({text}); set the store's standard variables "
                f"(for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION) or the "
                f"machine's identity to one that may read it"
            )
        return StorageError(f"{where}: {text}")


class _Reader(io.RawIOBase):
    """obstore's buffered reader as a Python binary file (its reads return buffers, not bytes)."""

    def __init__(self, file: Any):
        self._file = file

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._file.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


def _reason(exc: BaseException) -> str:
    """The first line of an obstore error (its later lines are a Rust debug dump)."""
    text = str(exc).strip().splitlines()
    return text[0][:500] if text else type(exc).__name__


def open_storage(path: str, retry_seconds: float = 60.0) -> tuple[Storage, str]:
    """The storage a ``--data`` path is in, and the name of what it names there ("" for the
    storage's root). A URL's bucket is its storage (its path the name); a local path's parent
    folder is (its file or folder name the name), so that what lies beside it (a tar's index,
    ``classes.txt``) is reachable."""
    if is_remote(path):
        scheme, _, rest = path.partition("://")
        bucket, _, name = rest.partition("/")
        return ObjectStorage(f"{scheme}://{bucket}", retry_seconds), name.strip("/")
    resolved = pathlib.Path(path).absolute()
    return LocalStorage(resolved.parent), resolved.name


def scratch_folder() -> str:
    """A default ``--cache-dir``: ``$XDG_CACHE_HOME/remoteloader`` (~/.cache), else a temp folder."""
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if os.access(os.path.dirname(home) or "/", os.W_OK) or os.path.isdir(home):
        return os.path.join(home, "remoteloader")
    return os.path.join(tempfile.gettempdir(), "remoteloader-cache")
