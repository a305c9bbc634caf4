"""The formats a server reads, one module each, and the one place that tells which reads a path.

Each format module has ``shards_at(storage, name, found, options)``: the shards it makes of what a
``--data`` path names (``found``: a file with its entry, or a folder with the files in it), or
None when the path is not in its format. ``open_shards`` asks the formats in ``FORMATS``'s
order and takes the first answer, so a new format is a new module and its place in that list.
Formats read their bytes through ``server/storage.py`` (a local folder or an object store)
and keep the contract of ``server/catalog.py``.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import fnmatch
import json
import logging
import pathlib
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from types import ModuleType

from remoteloader.server.catalog import CLASSES_FILE, CatalogError, Shard, basename, grouped_warnings
from remoteloader.server.config import ServerConfig
from remoteloader.server.storage import Entry, Storage, StorageError, open_storage

log = logging.getLogger(__name__)

GLOB = "*?["
PROGRESS_SECONDS = 15.0  # where stderr is not a terminal: a progress line this often while indexing


def _defaults() -> ServerConfig:
    return ServerConfig(data=("-",))


@dataclass(frozen=True)
class FormatOptions:
    """How the server reads its formats: where indexes go that cannot be kept beside their files
    (``ServerConfig.index_folder``, or a tool's own folder) and the server's settings, whose
    format flags a format reads from ``config`` as ServerConfig parsed them (``image_root``,
    ``coco_masks``, ``lmdb_unpickle``, ``tfrecord_features``, ``parquet_columns``,
    ``store_timeout``). ``of(config)`` makes the server's."""

    index_folder: str = ""
    config: ServerConfig = field(default_factory=_defaults)

    @classmethod
    def of(cls, config: ServerConfig) -> FormatOptions:
        return cls(config.index_folder, config)


@dataclass(frozen=True)
class Found:
    """What a ``--data`` path names: a "file" (its ``entry``) or a "folder" (the ``files`` in it)."""

    kind: str
    entry: Entry | None = None
    files: list[Entry] = field(default_factory=list)


def _formats() -> tuple[ModuleType, ...]:
    from remoteloader.server.formats import coco, imagefolder, lmdb, parquet, recordio, tar, tfrecord, video

    # ImageFolder last: any other folder is one
    return (coco, tar, tfrecord, recordio, parquet, lmdb, video, imagefolder)


def open_shards(paths: list[str], options: FormatOptions | None = None) -> list[Shard]:
    """Indexes every shard under the given paths (on this machine or object-store URLs; a
    path with ``*``, ``?`` or ``[`` is a glob of files).

    Speaks briefly however many shards there are: a progress bar where stderr is a terminal
    (else a line every ``PROGRESS_SECONDS``), one summary line, and each kind of per-shard
    warning once for all the shards that have it (``catalog.grouped_warnings``)."""
    options = options or FormatOptions()
    shards: list[Shard] = []
    progress = Progress()
    with grouped_warnings(), progress:
        token = _progress.set(progress)
        try:
            for raw in paths:
                storage, name = open_storage(raw, options.config.store_timeout)
                expanded = _expand(storage, name, raw)
                progress.expect(len(expanded))
                for path, found in expanded:
                    for module in _formats():
                        opened = module.shards_at(storage, path, found, options)
                        if opened is not None:
                            shards.extend(opened)
                            break
                    else:
                        raise CatalogError(
                            f"data path {raw!r} is not a folder nor a file of a format this server reads"
                        )
                    progress.done(len(opened), opened)
        finally:
            _progress.reset(token)
    _summarize(shards, progress.started)
    _warn_unsaved_indexes([s for s in shards if s.index_error is not None])
    ids = [s.id for s in shards]
    if len(set(ids)) != len(ids):
        raise CatalogError("the same shard is listed twice in --data")
    return shards


class Progress:
    """How far indexing is: shard files expected and indexed, each counted once.

    A tqdm bar on a terminal (after a second, so a fast start shows none); otherwise a log line
    every ``PROGRESS_SECONDS``, never one per shard."""

    def __init__(self):
        self.started = time.perf_counter()
        self.total = self.indexed = self.scanned = 0
        self._counted = 0  # of the shards of the current path, those already counted one by one
        self._said = self.started
        self._lock = threading.Lock()
        self.classes: dict[tuple[str, str], list[str]] = {}  # (storage, folder) -> its classes.txt, read once
        self._bar = None
        if sys.stderr is not None and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=0, unit="shard", desc="indexing", delay=1.0, leave=False, file=sys.stderr)

    def expect(self, count: int) -> None:
        """``count`` more shard files to index (a folder: those in it, less the one it was counted as)."""
        with self._lock:
            self.total += count
            if self._bar is not None:
                self._bar.total = self.total
                self._bar.refresh()

    def one(self, shard: Shard) -> None:
        """One shard file indexed (from ``file_shards``, as each is opened)."""
        with self._lock:
            self._counted += 1
            self._step(1, shard.scanned)

    def done(self, count: int, shards: list[Shard]) -> None:
        """A path's shards are open: counts those not counted one by one."""
        with self._lock:
            left, self._counted = count - self._counted, 0
            self._step(max(0, left), sum(s.scanned for s in shards[count - left :]) if left > 0 else 0)

    def _step(self, count: int, scanned: int) -> None:
        self.indexed += count
        self.scanned += scanned
        if self._bar is not None:
            self._bar.update(count)
            return
        now = time.perf_counter()
        if now - self._said >= PROGRESS_SECONDS:
            self._said = now
            log.info(
                "indexing: %s of %s shard files so far (%s scanned, the rest from kept indexes), %.0fs",
                f"{self.indexed:,}",
                f"{max(self.total, self.indexed):,}",
                f"{self.scanned:,}",
                now - self.started,
            )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()


_progress: contextvars.ContextVar[Progress | None] = contextvars.ContextVar("remoteloader_progress", default=None)


def _summarize(shards: list[Shard], started: float) -> None:
    """The one line that says what indexing found, and how (none without --data)."""
    if not shards:
        return
    scanned = sum(s.scanned for s in shards)
    kept = sum(s.object is not None and not s.scanned for s in shards)
    how = [f"{kept:,} from kept indexes" if kept else "", f"{scanned:,} scanned" if scanned else ""]
    log.info(
        "indexed %s shard%s, %s samples, in %.1fs%s",
        f"{len(shards):,}",
        "" if len(shards) == 1 else "s",
        f"{sum(len(s) for s in shards):,}",
        time.perf_counter() - started,
        (": " + ", ".join(h for h in how if h)) if kept or scanned else "",
    )


def _expand(storage: Storage, name: str, raw: str) -> list[tuple[str, Found]]:
    """What a path names: itself, or for a glob every file it matches (sorted)."""
    if not any(c in basename(name) for c in GLOB):
        return [(name, _find(storage, name, raw))]
    folder = name.rpartition("/")[0]
    try:
        files = storage.children(folder)[1]
    except FileNotFoundError:
        files = []
    except StorageError as exc:
        raise CatalogError(f"data path {raw!r}: {exc}") from None
    matched = [e for e in files if fnmatch.fnmatchcase(basename(e.name), basename(name))]
    if not matched:
        raise CatalogError(f"data path {raw!r} matches no file")
    return [(e.name, Found("file", e)) for e in matched]


def _find(storage: Storage, name: str, raw: str) -> Found:
    """Whether ``name`` is a file or a folder (CatalogError: neither, saying which)."""
    try:
        if not storage.remote:
            path = pathlib.Path(storage.location(name))
            if path.is_dir():
                return Found("folder", None, storage.children(name)[1])
            if path.is_file():
                return Found("file", storage.head(name))
            why = "is neither a folder nor a file" if path.exists() else "does not exist"
            raise CatalogError(f"data path {raw!r} {why}")
        try:
            return Found("file", storage.head(name))
        except FileNotFoundError:
            pass
        try:
            return Found("folder", None, storage.children(name)[1])
        except FileNotFoundError:
            raise CatalogError(f"data path {raw!r} does not exist") from None
    except StorageError as exc:
        raise CatalogError(f"data path {raw!r}: {exc}") from None


def file_shards(
    storage: Storage,
    name: str,
    found: Found,
    suffixes: tuple[str, ...],
    make: Callable[[str, list[str], Entry | None], Shard],
) -> list[Shard] | None:
    """The shards of a format whose files are shards: the file ``name`` if it ends with one of
    ``suffixes``, or every such file in the folder ``name``; ``make(name, class_names, entry)``
    opens one (``classes.txt`` beside the files names the labels). None: no such file."""
    if found.kind == "file":
        if not name.lower().endswith(suffixes):
            return None
        folder = name.rpartition("/")[0]
        progress = _progress.get()
        if progress is None:
            return [make(name, read_classes(storage, folder), found.entry)]
        # A glob's files: classes.txt read once per folder, one list shared by its shards
        key = (storage.url, folder)
        if key not in progress.classes:
            progress.classes[key] = read_classes(storage, folder)
        return [make(name, progress.classes[key], found.entry)]
    files = [e for e in found.files if e.name.lower().endswith(suffixes)]
    if not files:
        return None
    names = read_classes(storage, name)
    progress = _progress.get()
    if progress is not None:
        progress.expect(len(files) - 1)

    def one(entry: Entry) -> Shard:
        shard = make(entry.name, names, entry)
        if progress is not None:
            progress.one(shard)
        return shard

    if not storage.remote:  # a local disk is read one file at a time
        return [one(e) for e in files]
    # requests to a store overlap (each in the context that gathers warnings, see open_shards)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        opened = [pool.submit(contextvars.copy_context().run, one, e) for e in files]
        return [f.result() for f in opened]


def named_strings(setting: str, spec: str | Mapping[str, str], known: Collection[str], expected: str) -> dict[str, str]:
    """A setting that maps names among ``known`` to strings (``--tfrecord-features``,
    ``--parquet-columns``): a JSON object, or one parsed already; {} when empty. ValueError
    naming ``setting``: not JSON, not ``expected`` (a JSON object of strings), or a name not known."""
    if not spec:
        return {}
    if isinstance(spec, str):
        try:
            named = json.loads(spec)
        except ValueError as exc:
            raise ValueError(f"{setting}={spec!r} is not JSON: {exc}") from None
    else:
        named = dict(spec)
    if not isinstance(named, dict) or not all(isinstance(v, str) for v in named.values()):
        raise ValueError(f"{setting}={spec!r}: expected {expected}")
    unknown = sorted(set(named) - set(known))
    if unknown:
        raise ValueError(f"{setting}={spec!r}: {', '.join(unknown)} not among {', '.join(known)}")
    return named


def read_classes(storage: Storage, folder: str) -> list[str]:
    """The class names of ``classes.txt`` in a folder of shards, one per line ([] without one)."""
    try:
        text = storage.read(storage.join(folder, CLASSES_FILE)).decode()
    except FileNotFoundError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip()]


def _warn_unsaved_indexes(shards: list[Shard]) -> None:
    """One line for all the files scanned at this start whose index could not be kept beside them."""
    if not shards:
        return
    from remoteloader.server.formats.index import INDEX_SUFFIX

    kept = [s for s in shards if s.index_kept]
    lost = [s for s in shards if not s.index_kept]
    error = shards[0].index_error
    assert error is not None, "only shards whose index could not be kept beside them"
    if kept:
        log.info(
            "%d shard file(s) have no %s index beside them and it cannot be written there (%s): their indexes "
            "are kept in the index folder (--cache-dir), and the next start reads them from there",
            len(kept),
            INDEX_SUFFIX,
            error.strerror or error,
        )
    if lost:
        names = ", ".join(basename(getattr(s, "path", s.name)) for s in lost[:3]) + (" ..." if len(lost) > 3 else "")
        log.warning(
            "%d shard file(s) have no %s index and it can be kept neither beside them nor in an index folder "
            "(%s): indexed in memory, and scanned again at every start (%s). Give the server a writable "
            "--cache-dir, or write the indexes beside the files with `remoteloader pack`",
            len(lost),
            INDEX_SUFFIX,
            error.strerror or error,
            names,
        )
