"""Servers over many shards start fast and speak briefly (issue 38): thousands of tiny tars are
indexed with one summary line and one line per kind of warning, their indexes are kept, and the
next start reads those instead of scanning; synthetic shards cost a byte a sample."""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import subprocess
import tarfile

import numpy as np
import pytest
from conftest import DEFAULT_ARGS

from remoteloader.server.catalog import SyntheticShard
from remoteloader.server.formats import index as shard_index
from remoteloader.server.formats import open_shards
from remoteloader.server.formats.tar import TarShard
from remoteloader.server.storage import open_storage
from remoteloader.tools.local import ServerProcess, server_command

TARS = 2000
JPEG = b"\xff\xd8\xff" + b"0" * 50  # (never decoded here)


def _write_tar(path, index: int, samples: int = 2) -> None:
    with tarfile.open(path, "w") as tar:
        for i in range(samples):
            for name, data in ((f"s{index}_{i}.jpg", JPEG), (f"s{index}_{i}.cls", str((index + i) % 7).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def many_tars(tmp_path_factory):
    """TARS tars of 2 samples each, labelled, with no classes.txt (a warning each, before)."""
    folder = tmp_path_factory.mktemp("many")
    for index in range(TARS):
        _write_tar(folder / f"shard-{index:05d}.tar", index)
    return folder


def _said(caplog, level=logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level and r.name.startswith("remoteloader")]


def test_thousands_of_tars_are_indexed_in_a_few_lines_and_kept(many_tars, caplog, monkeypatch):
    caplog.set_level(logging.INFO)
    first = open_shards([str(many_tars)])
    said = _said(caplog)
    assert len(first) == TARS and sum(len(s) for s in first) == 2 * TARS
    assert len(said) <= 3, said  # the grouped warning and the summary (a progress line, if slow)
    summary = [line for line in said if line.startswith("indexed ")]
    assert summary == [f"indexed {TARS:,} shards, {2 * TARS:,} samples, in {summary[0].split(' in ')[1]}"]
    assert summary[0].endswith(f": {TARS:,} scanned"), summary
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert warned[0].startswith(f"{TARS:,} tars have labels but no classes.txt beside them"), warned
    assert "e.g. shard-00000.tar (labels up to 1), shard-00001.tar (labels up to 2), shard-00002.tar" in warned[0]
    assert warned[0].endswith(", ..."), warned
    assert len(list(many_tars.glob("*.tar.index.npz"))) == TARS

    # The next start reads the kept indexes: no tar is scanned, nor read at all (size and mtime match).
    caplog.clear()

    def no_scan(*args):
        raise AssertionError("a tar was scanned although its index was kept")

    monkeypatch.setattr(TarShard, "_scan", no_scan)
    monkeypatch.setattr(shard_index, "signature", no_scan)
    again = open_shards([str(many_tars)])
    said = _said(caplog)
    assert len(said) <= 3 and any(line.endswith(f": {TARS:,} from kept indexes") for line in said), said
    assert [s.id for s in again] == [s.id for s in first]
    for shard, before in ((again[0], first[0]), (again[-1], first[-1])):
        assert [shard.key(i) for i in range(len(shard))] == [before.key(i) for i in range(len(before))]
        assert shard.labels.tolist() == before.labels.tolist()
        assert [shard.locate(i) for i in range(len(shard))] == [before.locate(i) for i in range(len(before))]


def test_a_server_over_thousands_of_kept_indexes_says_a_few_lines(many_tars, tmp_path):
    """What the operator sees: the server's log up to its readiness line, at INFO."""
    if not list(many_tars.glob("*.index.npz")):
        open_shards([str(many_tars)])  # (run alone: the indexes are kept by a first start)
    argv = [*server_command(), "--data", str(many_tars), "--host", "127.0.0.1", "--port", "0", *DEFAULT_ARGS]
    server = ServerProcess(argv, tmp_path / "server.log")
    try:
        server.wait_ready(120)
        log = server.stderr()
    finally:
        server.signal(subprocess.signal.SIGTERM)
        server.wait(30)
        server.reap()
    before = log[: log.index("listening on")].splitlines()
    assert len(before) <= 10, "\n".join(before)  # summary, grouped warning, then the usual start lines
    assert re.search(rf"indexed {TARS:,} shards, {2 * TARS:,} samples, in [\d.]+s: {TARS:,} from kept indexes", log)
    assert log.count("classes.txt") == 1 and log.count("scanned") == 0, log


def test_one_tar_among_many_warns_as_it_would_alone(many_tars, tmp_path, caplog):
    folder = tmp_path / "mixed"
    folder.mkdir()
    for index in range(3):
        shutil.copy(many_tars / f"shard-{index:05d}.tar", folder)
    (folder / "classes.txt").write_text("\n".join("abcdefg"))  # names every label of these...
    with tarfile.open(folder / "shard-00001.tar", "a") as tar:  # ...but one sample has none
        info = tarfile.TarInfo("extra.jpg")
        info.size = len(JPEG)
        tar.addfile(info, io.BytesIO(JPEG))
    caplog.set_level(logging.INFO)
    open_shards([str(folder)])
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith(f"{folder / 'shard-00001.tar'}: 1 of 3 samples have no label")


def test_a_copied_tar_keeps_its_index_and_an_old_index_is_upgraded(many_tars, tmp_path):
    """A copy has a new mtime: its index is matched by the hash of its ends, then written again
    with the copy's time; a version 3 index (``pack`` before this version) is read, and
    rewritten as version 4."""
    source = many_tars / "shard-00007.tar"
    if not (many_tars / ("shard-00007.tar" + shard_index.INDEX_SUFFIX)).is_file():
        TarShard(*open_storage(str(source)), [])
    copy = tmp_path / source.name
    shutil.copy(source, copy)
    shutil.copy(str(source) + shard_index.INDEX_SUFFIX, str(copy) + shard_index.INDEX_SUFFIX)
    os.utime(copy, ns=(1, 1))
    sidecar = tmp_path / (source.name + shard_index.INDEX_SUFFIX)
    before = sidecar.read_bytes()
    scanned = TarShard(*open_storage(str(source)), [])
    shard = TarShard(*open_storage(str(copy)), [])
    assert not shard.scanned and shard.id == scanned.id
    assert sidecar.read_bytes() != before  # written again, with the copy's mtime
    assert np.load(sidecar)["index"][:8].tobytes() == b"RLINDEX4"

    # Version 3: one .npy per array, as servers and `pack` wrote them before.
    arrays = scanned.index_arrays()
    storage, name = open_storage(str(copy))
    out = io.BytesIO()
    np.savez(
        out,
        version=3,
        signature=shard_index.signature(storage, storage.head(name)),
        etag=np.str_(""),
        index_digest=np.str_(scanned.index_digest),
        fields=np.array([], dtype=np.str_),
        failed=np.array([], dtype=np.int64),
        failures=np.array([], dtype=np.str_),
        **{k: np.asarray(v, dtype=np.uint8 if k in ("blob", "targets") else np.int64) for k, v in arrays.items()},
    )
    sidecar.write_bytes(out.getvalue())
    old = TarShard(storage, name, [])
    assert not old.scanned and old.id == scanned.id and old.labels.tolist() == scanned.labels.tolist()
    assert np.load(sidecar)["index"][:8].tobytes() == b"RLINDEX4"  # upgraded in place


def test_a_synthetic_shard_costs_a_byte_a_sample():
    shard = SyntheticShard(10_000_000)
    assert len(shard) == 10_000_000 and shard.labels.nbytes == 10_000_000
    assert shard.key(9_999_999) == "synthetic/9999999" and int(shard.labels[9_999_999]) == 9
    assert shard.targets(5) == b"" and shard.locate(5).length == 0 and shard.fields == ("label",)
    assert shard.id == "syn-10000000" and shard.nbytes == 0


def test_the_shards_of_a_folder_or_a_glob_share_one_list_of_class_names(many_tars, tmp_path):
    """(Describe sends a list once for the shards that share it; a list per shard would cost
    the server a copy of 1,000 names per tar.)"""
    for index in range(3):
        shutil.copy(many_tars / f"shard-{index:05d}.tar", tmp_path)
    (tmp_path / "classes.txt").write_text("\n".join("abcdefg"))
    for data in (str(tmp_path), str(tmp_path / "shard-*.tar")):
        shards = open_shards([data])
        assert len(shards) == 3 and shards[0].class_names == list("abcdefg")
        assert all(s.class_names is shards[0].class_names for s in shards), data
