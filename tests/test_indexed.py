"""The kept-index rule (server/formats/indexed.py): a format that writes only its scan is indexed
once, its index kept, and read back at the next start, where it is not scanned again."""

from __future__ import annotations

import logging

import numpy as np

from remoteloader.server.catalog import KeyTable, Location
from remoteloader.server.formats import _warn_unsaved_indexes, index
from remoteloader.server.formats.indexed import IndexedFile
from remoteloader.server.storage import open_storage


class LinesShard(IndexedFile):
    """A made-up format: each line of a text file is a sample, its label the line's length."""

    kind = "lines"
    scans = 0

    def __init__(self, path: str, folder: str = "", beside: bool = True):
        storage, name = open_storage(path)
        self.path = path
        self._open_index(storage, storage.head(name), "lines", [], lambda: self._scan(path), folder, beside=beside)

    def _scan(self, path: str) -> index.Index:
        LinesShard.scans += 1
        table, at = KeyTable(), 0
        for number, line in enumerate(open(path, "rb").read().splitlines(keepends=True)):
            table.add(f"line-{number}", len(line.strip()), at, len(line))
            at += len(line)
        return index.Index(table, f"{at}", (), {5: "line 5 is bad"} if len(table) > 5 else {})

    def locate(self, i: int) -> Location:
        return Location(self.path, int(self._offsets[i]), int(self._sizes[i]))


def test_a_format_that_writes_only_its_scan_is_indexed_once_and_read_back(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"".join(b"x" * n + b"\n" for n in range(1, 9)))
    LinesShard.scans = 0
    first = LinesShard(str(path))
    assert first.scanned and LinesShard.scans == 1 and first.index_error is None
    assert first.index_kept == str(path) + index.INDEX_SUFFIX
    again = LinesShard(str(path))
    assert not again.scanned and LinesShard.scans == 1  # from the kept index
    assert again.id == first.id and again.id.startswith("lines-") and len(again) == 8
    assert again.labels.tolist() == list(range(1, 9)) and again.failure(5) == "line 5 is bad"
    assert [again.locate(i) for i in range(8)] == [first.locate(i) for i in range(8)]
    path.write_bytes(path.read_bytes() + b"yyyyyyyyy\n")  # changed: scanned again
    changed = LinesShard(str(path))
    assert changed.scanned and LinesShard.scans == 2 and len(changed) == 9 and changed.id != first.id


def test_an_index_kept_nowhere_is_said_once_for_all_the_files(tmp_path, caplog):
    path = tmp_path / "a.txt"
    path.write_bytes(b"a\nbb\n")
    shard = LinesShard(str(path), folder="", beside=False)
    assert shard.scanned and not shard.index_kept and shard.index_error is not None
    with caplog.at_level(logging.WARNING):
        _warn_unsaved_indexes([shard])
    assert "can be kept neither beside them nor in an index folder" in caplog.text
    np.testing.assert_array_equal(LinesShard(str(path), beside=False).labels, [1, 2])  # scanned again
