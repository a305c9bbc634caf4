"""Where a server's bytes live: a folder on its own disk, or an object store.

This layer knows nothing of formats (``catalog.py`` and ``coco.py`` say what the bytes mean):
it lists objects, says their size and version, and reads them whole, as ranges or as a
seekable stream. ``open_storage(path)`` returns the storage a ``--data`` path names and the
name of what it names inside it:

* a path on this machine: ``LocalStorage`` (names are paths relative to its root);
* ``s3://bucket/prefix``, ``gs://``, ``az://``, ``https://``: ``ObjectStorage``, read with
  obstore (measured against boto3 and s3fs in ``benchmarks/object_store_clients.py``: 5x and
  3.6x the bytes per CPU-second of theirs). Credentials and endpoints come from the standard
  places, never from a client: each store's own variables (``STORES``: ``AWS_*`` for S3,
  ``GOOGLE_*`` for GCS, ``AZURE_*`` for Azure, read by obstore; the client options among them,
  such as ``*_ALLOW_HTTP``, are passed on here), or the instance's or pod's identity.

An endpoint on plain HTTP is refused unless the store's ``*_ALLOW_HTTP=true`` says it is meant
(the error names that variable); where it is allowed, one log line says the traffic is
unencrypted. ETags are kept as the HTTP spec means them: the opaque value, without the quotes
or a weak ``W/`` prefix (listings give it bare, reads quoted, on Azure and GCS), and sent quoted
in ``If-Match``.

Timeouts, 5xx answers and throttling (503 SlowDown) are retried with backoff and jitter for up
to ``retry_seconds``; what still fails raises ``StorageError`` naming the URL, what was tried
and, where the cause is the operator's to fix (credentials, a missing bucket or container, a
plain-HTTP endpoint), the fix for the store in the URL.
"""

from __future__ import annotations

import datetime
import io
import logging
import os
import pathlib
import re
import tempfile
from dataclasses import dataclass
from typing import IO, Any, cast

SCHEMES = ("s3://", "s3a://", "gs://", "az://", "abfs://", "abfss://", "azure://", "http://", "https://")
READ_BUFFER = 4 << 20  # a seekable stream's read size (a tar scanned without an index)
# obstore's client options that a store's variables may set (``<PREFIX>_<OPTION>``): obstore
# reads them from the environment itself only when it is given no client options, and it is.
CLIENT_OPTIONS = (
    "allow_http",
    "allow_invalid_certificates",
    "proxy_url",
    "proxy_ca_certificate",
    "proxy_excludes",
    "timeout",
    "connect_timeout",
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreKind:
    """What the operator sets for one kind of store: the prefix of its variables, the ones that
    give credentials, how its endpoint is changed, and what its bucket is called."""

    name: str
    prefix: str
    credentials: str
    endpoint: str
    bucket: str = "bucket"


STORES = {
    "s3": StoreKind("S3", "AWS_", "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION", "AWS_ENDPOINT_URL"),
    "gs": StoreKind(
        "GCS",
        "GOOGLE_",
        "GOOGLE_APPLICATION_CREDENTIALS or GOOGLE_SERVICE_ACCOUNT (a service-account JSON file) or "
        "GOOGLE_SERVICE_ACCOUNT_KEY (its contents)",
        'a service-account JSON with "gcs_base_url" (and "disable_oauth": true for an emulator) in '
        "GOOGLE_SERVICE_ACCOUNT_KEY",
    ),
    "az": StoreKind(
        "Azure",
        "AZURE_",
        "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY (or AZURE_STORAGE_SAS_KEY, or AZURE_CLIENT_ID, "
        "AZURE_CLIENT_SECRET, AZURE_TENANT_ID)",
        "AZURE_STORAGE_ENDPOINT (for Azurite: AZURE_STORAGE_USE_EMULATOR=true and AZURITE_BLOB_STORAGE_URL)",
        "container",
    ),
    "http": StoreKind("HTTP", "HTTP_", "none (the server reads what the URL serves)", "the URL itself"),
}
_SCHEME_KIND = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gs",
    "az": "az",
    "abfs": "az",
    "abfss": "az",
    "azure": "az",
    "http": "http",
    "https": "http",
}
MISSING_BUCKET = ("NoSuchBucket", "ContainerNotFound", "The specified bucket does not exist", "no bucket named")


def store_kind(url: str) -> StoreKind:
    """The kind of store a URL names (its scheme's)."""
    return STORES[_SCHEME_KIND.get(url.partition("://")[0].lower(), "http")]


def bare_etag(etag: str | None) -> str:
    """An ETag's opaque value: without a weak ``W/`` prefix and the quotes (RFC 9110 8.8.3), as
    the stores' listings give it, so that a listing's and a read's ETags compare."""
    value = (etag or "").strip()
    if value[:2].upper() == "W/":
        value = value[2:]
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    return value


class StorageError(OSError):
    """A store that cannot be read: the message names the URL and, where it can, the fix."""


@dataclass(frozen=True)
class Entry:
    """An object (or file): its name under the storage's root, size and version (its ETag; ""
    on a local disk, where a change is seen by size and modification time)."""

    name: str
    size: int
    etag: str = ""


def read_up_to(file: Any, size: int) -> bytes:
    """``size`` bytes of a reader ``Storage.open`` gave, fewer only at the end of the file (a raw
    reader, an object store's among them, may return less at once)."""
    data = file.read(size)
    while data and len(data) < size:
        more = file.read(size - len(data))
        if not more:
            break
        data += more
    return data


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
        self.kind = store_kind(self.url)
        options = {"timeout": "30s", "connect_timeout": "5s", **client_options(self.kind)}
        if self.url.lower().startswith("http://"):
            options["allow_http"] = "true"  # (the URL itself says plain HTTP)
        _say_plain_http(self.kind, options)
        try:
            self.store: Any = from_url(self.url, client_options=cast(Any, options), retry_config=cast(Any, retry))
        except Exception as exc:
            raise StorageError(f"{self.url}: cannot use this store: {_reason(exc)}{self._hint(exc)}") from None

    def walk(self, prefix: str = "") -> list[Entry]:
        import obstore

        try:
            pages = obstore.list(self.store, prefix + "/" if prefix else None)
            entries = [_entry(m) for page in pages for m in page]
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
        files = [_entry(m) for m in listed["objects"]]
        if not folders and not files:
            raise FileNotFoundError(f"{self.location(prefix)}: no objects under it")
        return folders, sorted(files, key=lambda e: e.name)

    def head(self, name: str) -> Entry:
        import obstore

        try:
            meta = obstore.head(self.store, name)
        except Exception as exc:
            raise self.error(exc, name) from None
        return _entry(meta)

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
        size and (bare) ETag; ``etag``: fail unless it still has that one."""
        import obstore

        options: dict[str, Any] = {"range": (start, end)}
        if etag:
            options["if_match"] = f'"{bare_etag(etag)}"'  # (an entity-tag is quoted: RFC 9110 13.1.1)
        result = await obstore.get_async(self.store, name, options=options)  # type: ignore[arg-type]
        data = await result.bytes_async()  # (a buffer: written to disk as it is, not copied)
        meta = result.meta
        return data, meta["size"], bare_etag(meta.get("e_tag"))

    async def fetch_ranges(self, name: str, ranges: list[tuple[int, int]]) -> list[Any]:
        """The bytes of each ``[start, end)`` of ``ranges`` of one object, in one call: a request
        each (ten at a time, none merged), for about half the CPU per range of ``fetch`` (its
        awaits cost more than its request). No version is checked: see ``version``."""
        import obstore

        starts, ends = [start for start, _ in ranges], [end for _, end in ranges]
        return await obstore.get_ranges_async(self.store, name, starts=starts, ends=ends, coalesce=0)

    async def version(self, name: str) -> tuple[int, str]:
        """The object's size and (bare) ETag now."""
        import obstore

        meta = await obstore.head_async(self.store, name)
        return meta["size"], bare_etag(meta.get("e_tag"))

    def error(self, exc: BaseException, name: str) -> OSError:
        """What an obstore failure means for ``name``, as an OSError naming the URL, what was
        tried and, where the operator can fix it, how (for the store in the URL)."""
        from obstore import exceptions

        where = self.location(name) if name else self.url
        text, full = _reason(exc), str(exc)
        if any(code in full for code in MISSING_BUCKET):
            return StorageError(
                f"{where}: no such {self.kind.bucket} ({text}); check the URL, or create the {self.kind.bucket}"
                f"{self._endpoint_hint()}"
            )
        if isinstance(exc, (FileNotFoundError, exceptions.NotFoundError)):
            return FileNotFoundError(f"{where}: no such object")
        return StorageError(f"{where}: {text}{self._hint(exc)}")

    def _hint(self, exc: BaseException) -> str:
        """The fix for an operator's mistake that ``exc`` shows ("" where it shows none)."""
        from obstore import exceptions

        full, kind = str(exc), self.kind
        if "builder error" in full and "http://" in full:  # reqwest refused a plain-HTTP URL
            return (
                f"; the endpoint is plain HTTP, refused unless allowed: set {kind.prefix}ALLOW_HTTP=true to send "
                f"unencrypted traffic to it, or give an https:// endpoint ({kind.endpoint})"
            )
        if "169.254.169.254" in full or "MissingAccount" in full or "Account must be specified" in full:
            return (  # no credentials in the environment: it asked the instance metadata service
                f"; no credentials for the {kind.name} store were found: set {kind.credentials} (the endpoint: "
                f"{kind.endpoint}), or give the machine an identity that may read it"
            )
        if kind.prefix == "AWS_" and any(
            code in full for code in ("PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraint")
        ):
            return "; the bucket is in another region: set AWS_REGION to the bucket's region"
        if any(code in full for code in ("error sending request", "Connection refused", "dns error", "timed out")):
            return f"; the store did not answer: check its endpoint ({kind.endpoint}) and that it is up and reachable"
        if isinstance(exc, (exceptions.PermissionDeniedError, exceptions.UnauthenticatedError)) or any(
            code in full
            for code in (
                "403 Forbidden",
                "401 Unauthorized",
                "SignatureDoesNotMatch",
                "AccessDenied",
                "AuthorizationFailure",
                "AuthenticationFailed",
            )
        ):
            return (
                f"; the store refused these credentials: set {kind.credentials} (the endpoint: {kind.endpoint}), "
                f"or the machine's identity, to one that may read it"
            )
        return ""

    def _endpoint_hint(self) -> str:
        endpoint = os.environ.get(f"{self.kind.prefix}ENDPOINT_URL") or os.environ.get(f"{self.kind.prefix}ENDPOINT")
        return f" (the endpoint {endpoint}, from {self.kind.prefix}ENDPOINT_URL)" if endpoint else ""


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


_said_plain_http: set[str] = set()


def _say_plain_http(kind: StoreKind, options: dict[str, str]) -> None:
    """One log line per kind of store whose plain-HTTP endpoints are allowed: their traffic is
    unencrypted (an emulator's: Azurite's too)."""
    emulator = kind.prefix == "AZURE_" and _true(os.environ.get("AZURE_STORAGE_USE_EMULATOR"))
    if kind.name in _said_plain_http or not (_true(options.get("allow_http")) or emulator):
        return
    _said_plain_http.add(kind.name)
    why = "AZURE_STORAGE_USE_EMULATOR" if emulator else f"{kind.prefix}ALLOW_HTTP"
    log.info("%s endpoints on plain HTTP are allowed (%s): the traffic to one is unencrypted", kind.name, why)


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _entry(meta: Any) -> Entry:
    return Entry(meta["path"], meta["size"], bare_etag(meta.get("e_tag")))


def client_options(kind: StoreKind) -> dict[str, str]:
    """The client options the store's own variables set (``GOOGLE_ALLOW_HTTP=true``...)."""
    out = {}
    for option in CLIENT_OPTIONS:
        value = os.environ.get(kind.prefix + option.upper())
        if value:
            out[option] = value
    return out


def _reason(exc: BaseException) -> str:
    """The first line of an obstore error (its later lines are a Rust debug dump), with an XML
    error body (Azure's, S3's) reduced to its code."""
    full = str(exc).strip()
    lines = full.splitlines()
    text = lines[0] if lines else type(exc).__name__
    if "<?xml" in text:
        code = re.search(r"<Code>([^<]{1,100})</Code>", full)
        text = text[: text.index("<?xml")].rstrip(": ") + (f": {code.group(1)}" if code else "")
    return text[:500]


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
