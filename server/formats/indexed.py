"""A shard whose samples are byte ranges of one file, indexed once: the kept-index rule.

Every such format (tar, TFRecord, LMDB, Parquet's extract) follows one rule, and this module is
where it lives: load the file's kept index (``formats/index.py``: beside it, or in the index
folder) if one matches the file; else scan the file, time and log the scan, and keep the index
for the next start (where it could not be kept beside the file, ``open_shards`` says so once for
all the files, ``formats._warn_unsaved_indexes``). Either way the shard's id is the fingerprint
of what the index holds (``members.fingerprint``).

A new format of this kind (RecordIO, a video container...) subclasses ``IndexedFile``, names
itself in ``kind``, writes only its scan (a function that reads the file and returns an
``index.Index``) and calls ``self._open_index(...)`` from its ``__init__``, then ``locate``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from remoteloader.server.catalog import Shard
from remoteloader.server.formats import members
from remoteloader.server.formats.index import Index, load, save
from remoteloader.server.storage import Entry, Storage

log = logging.getLogger(__name__)


class IndexedFile(Shard):
    """A shard of one file (``object``: its entry, as indexed) with a kept index.

    Subclasses set ``kind`` (the format's name in the shard's id) and call ``_open_index``."""

    kind = ""
    index_digest = ""

    def _open_index(
        self,
        storage: Storage,
        entry: Entry,
        name: str,
        class_names: list[str],
        scan: Callable[[], Index],
        folder: str = "",
        *,
        beside: bool = True,
        extent: int | None = None,
        where: str = "",
    ) -> None:
        """Makes this the shard ``name`` of the file ``entry``: from its kept index where one
        matches (beside the file unless not ``beside``, else in ``folder``; ``extent``: the bytes
        the samples lie in where not the file itself, see ``index.load``), else from ``scan()``,
        whose index is then kept (``index.save``). ``class_names``: the names beside the file;
        a scan may find its own (``Index.classes``), used where there are none. ``where``: the
        file, for the log (default its location)."""
        assert self.kind, "an indexed format names itself"
        self.object = entry
        found = load(storage, entry, folder, beside=beside, extent=extent, keys=self.key_rule)
        if found is None:
            started = time.perf_counter()
            found = scan()
            self.scanned = True
            log.debug(  # (open_shards says how many were scanned, in one line)
                "%s has no index: scanned it (%d samples, %.1f MB) in %.1fs",
                where or storage.location(entry.name),
                len(found.table),
                entry.size / 1e6,
                time.perf_counter() - started,
            )
        table = found.table
        names = list(found.classes) if found.classes and not class_names else class_names  # (shared, not copied)
        ident = members.fingerprint(self.kind, found.digest, table.labels, names, table.targets)
        Shard.__init__(self, name, table, names, ident, found.fields)
        self.index_digest = found.digest
        if found.failed:
            self.failed = found.failed
        self.verified = found.verified
        if self.scanned:
            self.index_kept, self.index_error = save(storage, entry, self, found.digest, folder, beside=beside)
