"""``remoteloader pack`` (the real CLI): the shards it writes, its progress, its refusals, and
what it leaves behind when stopped."""

from __future__ import annotations

import logging
import os
import pathlib
import re
import subprocess

import numpy as np
import pytest
from conftest import CTRL_C_EXITS
from packing import CLASSES, PER_CLASS, SHARDS, members, pack_cli, pack_command, shard_size_for, write_tar

from remoteloader.server import decode as dec
from remoteloader.server.catalog import CatalogError
from remoteloader.server.formats import open_shards
from remoteloader.server.formats.tar import TarShard
from remoteloader.server.storage import open_storage
from remoteloader.tools.textures import make_image, make_imagefolder

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


# ---- pack ---------------------------------------------------------------------------------


def test_pack_writes_webdataset_shards_and_classes(packed):
    src, dst, result = packed
    shards = sorted(dst.glob("*.tar"))
    assert [p.name for p in shards] == [f"shard-{i:05d}.tar" for i in range(len(shards))]
    assert 2 <= len(shards) <= SHARDS + 1, [p.name for p in shards]
    indexes = [p.name + ".index.npz" for p in shards]  # sidecar indexes: servers start without scanning
    assert sorted(os.listdir(dst)) == sorted([p.name for p in shards] + indexes + ["classes.txt"])
    assert (dst / "classes.txt").read_text() == "".join(f"{c}\n" for c in CLASSES)
    assert f"wrote {len(shards)} shard(s)" in result.stdout
    if dec._jpeg is not None:
        assert f"{len(CLASSES) * PER_CLASS} of {len(CLASSES) * PER_CLASS} files rewritten losslessly" in result.stdout
    seen = {}
    for shard in shards:
        entries = members(shard)
        assert len(entries) % 2 == 0
        for (image_name, data), (cls_name, label) in zip(entries[0::2], entries[1::2]):
            # <class>/<stem>.jpg, then <class>/<stem>.cls right after it
            assert re.fullmatch(r"[a-z]+/[a-z]+_\d{5}\.jpg", image_name), image_name
            assert cls_name == image_name[:-len(".jpg")] + ".cls"
            assert image_name not in seen, f"{image_name} packed twice"
            seen[image_name] = shard.name
            original = (src / image_name).read_bytes()
            # Rewritten losslessly, with a restart marker per MCU, when the native module is built.
            assert data == (original if dec._jpeg is None else dec._jpeg.transcode(original)), image_name
            assert np.array_equal(dec.decode(data, "jpeg"), dec.decode(original, "jpeg")), image_name
            assert int(label.decode()) == CLASSES.index(image_name.split("/")[0])
    assert sorted(seen) == sorted(str(p.relative_to(src)) for p in src.rglob("*.jpg"))
    # Classes are mixed across shards by default.
    for shard in shards:
        classes = {name.split("/")[0] for name, _ in members(shard)}
        assert len(classes) >= 2, f"{shard.name} holds only {classes}"


def test_pack_shows_progress_on_stderr_unless_quiet(packed, tmp_path):
    src, _, result = packed
    assert "packing into" in result.stderr and "100%" in result.stderr, result.stderr
    assert f"{len(CLASSES) * PER_CLASS}/{len(CLASSES) * PER_CLASS}" in result.stderr
    quiet = pack_cli(src, tmp_path / "quiet", "--shard-size", "1MB", "--quiet")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr.strip() == "", quiet.stderr
    assert "wrote 1 shard(s)" in quiet.stdout
    assert len(members(tmp_path / "quiet" / "shard-00000.tar")) == 2 * len(CLASSES) * PER_CLASS


def test_pack_names_files_without_a_readable_header_and_still_packs_them(tmp_path):
    src = make_imagefolder(tmp_path / "src", CLASSES[:2], 2, size=(24, 32), seed=5)
    (src / "ant" / "empty.jpg").write_bytes(b"")
    (src / "bee" / "notes.jpg").write_bytes(b"not a jpeg at all")
    result = pack_cli(src, tmp_path / "dst", "--quiet")
    assert result.returncode == 0, result.stderr
    assert "2 file(s) have no readable image header" in result.stderr, result.stderr
    assert "ant/empty.jpg" in result.stderr and "bee/notes.jpg" in result.stderr
    packed_names = {name for name, _ in members(tmp_path / "dst" / "shard-00000.tar")}
    assert {"ant/empty.jpg", "bee/notes.jpg"} <= packed_names  # nothing dropped: served as failures


@pytest.mark.skipif(dec._jpeg is None, reason="the native JPEG module was not built")
def test_pack_rewrites_what_it_can_losslessly_and_copies_the_rest(tmp_path):
    """Progressive JPEGs become baseline with the same pixels; a PNG, a damaged JPEG and an
    unreadable file are copied byte for byte and named; --verbatim copies everything."""
    import cv2

    src = make_imagefolder(tmp_path / "src", CLASSES[:2], 3, size=(40, 56), seed=6)
    image = make_image(0, 5, np.random.default_rng(2), 70, 90)
    (src / "ant" / "prog.jpg").write_bytes(cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1].tobytes())
    (src / "ant" / "pic.png").write_bytes(cv2.imencode(".png", image)[1].tobytes())
    good = (src / "bee" / "bee_00000.jpg").read_bytes()
    (src / "bee" / "cut.jpg").write_bytes(good[:len(good) * 2 // 3])
    (src / "bee" / "notes.jpg").write_bytes(b"not a jpeg at all")
    (src / "bee" / "motion.jpg").write_bytes(good + b"\0" * 10 + good)  # a second image after the first
    long_name = "ant/" + "x" * 150 + ".jpg"  # over ustar's 100 bytes
    (src / long_name).write_bytes(good)
    originals = {str(p.relative_to(src)): p.read_bytes() for p in src.rglob("*.*")}
    result = pack_cli(src, tmp_path / "dst", "--quiet", "--workers", "2")
    assert result.returncode == 0, result.stderr
    assert "wrote 1 shard(s)" in result.stdout and f"8 of {len(originals)} files rewritten losslessly" in result.stdout
    assert re.search(r"rewritten losslessly \([+-]\d+\.\d% bytes\)", result.stdout), result.stdout
    assert "2 file(s) copied as they are" in result.stderr and "ant/pic.png (PNG)" in result.stderr, result.stderr
    assert "bee/motion.jpg (data after the image" in result.stderr
    assert "libjpeg would not rewrite 1 JPEG(s)" in result.stderr and "bee/cut.jpg (libjpeg:" in result.stderr
    assert "1 file(s) have no readable image header" in result.stderr
    packed = dict(members(tmp_path / "dst" / "shard-00000.tar"))
    assert long_name in packed and long_name[:-4] + ".cls" in packed
    for name in ("ant/pic.png", "bee/cut.jpg", "bee/notes.jpg", "bee/motion.jpg"):
        assert packed[name] == originals[name], name
    for name in ("ant/prog.jpg", "bee/bee_00000.jpg"):
        assert packed[name] != originals[name] and dec._frame(packed[name])[0] == 0xC0, name
        assert np.array_equal(dec.decode(packed[name], "jpeg"), dec.decode(originals[name], "jpeg")), name
    # The index marks exactly the rewritten JPEGs verified: a server may decode only a crop's
    # region of them from its first epoch (the copied ones decode whole once first).
    shard = TarShard(*open_storage(str(tmp_path / "dst" / "shard-00000.tar")), [])
    assert shard.verified is not None
    verified = {shard.key(i) for i in range(len(shard)) if shard.verified[i]}
    assert len(verified) == 8 and {"ant/prog.jpg", "bee/bee_00000.jpg", long_name} <= verified
    assert not verified & {"ant/pic.png", "bee/cut.jpg", "bee/notes.jpg", "bee/motion.jpg"}
    verbatim = pack_cli(src, tmp_path / "verbatim", "--quiet", "--verbatim")
    assert verbatim.returncode == 0 and "rewritten" not in verbatim.stdout and "copied" not in verbatim.stderr
    assert TarShard(*open_storage(str(tmp_path / "verbatim" / "shard-00000.tar")), []).verified is None
    assert {k: v for k, v in members(tmp_path / "verbatim" / "shard-00000.tar") if not k.endswith(".cls")} == originals


def default_signals() -> None:
    """As in a terminal: a test run in the background (CI) inherits SIGINT ignored, and pack,
    as any program, keeps ignoring what it was started ignoring."""
    import signal

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def live_processes_in_group(group: int) -> list[int]:
    """Processes of a process group that are not zombies (dead, waiting to be reaped)."""
    live = []
    for entry in os.listdir("/proc"):
        try:
            state, _ppid, pgrp = pathlib.Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == group and state != "Z":
            live.append(int(entry))
    return live


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Enough photo-sized JPEGs that packing them takes a while (about a second)."""
    return make_imagefolder(tmp_path_factory.mktemp("photos") / "src", CLASSES, 60, size=(360, 480), seed=8)


@pytest.mark.parametrize("workers, signals, code", [("1", ["SIGINT"], 130), ("2", ["SIGINT"], 130),
                                                    ("2", ["SIGINT", "SIGINT"], 130), ("2", ["SIGTERM"], 143)])
def test_pack_stopped_removes_what_it_wrote(photos, tmp_path, workers, signals, code):
    """Ctrl-C (once, or twice in quick succession) or SIGTERM mid-way: the exit code of that
    signal, one line (no traceback from it or its worker processes), no process left behind,
    and no half-written folder (nor the parent it made) that a second run would refuse."""
    import signal
    import time

    dst = tmp_path / "new" / "dst"
    command, env = pack_command(photos, dst, "--quiet", "--shard-size", "1MB", "--workers", workers)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True, preexec_fn=default_signals)
    deadline = time.monotonic() + 60
    while not (dst / "shard-00001.tar").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    for name in signals:  # to the process group, as a terminal's Ctrl-C: to the workers too
        os.killpg(process.pid, getattr(signal, name))
        time.sleep(0.02)
    out, err = process.communicate(timeout=60)
    assert process.returncode in (CTRL_C_EXITS if code == 130 else (code,)), (process.returncode, out, err)
    assert "removed what it had written" in err and "Traceback" not in err, err
    assert not (tmp_path / "new").exists(), sorted(os.listdir(tmp_path / "new"))
    while live_processes_in_group(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live_processes_in_group(process.pid)  # its workers are gone too
    again = pack_cli(photos, dst, "--quiet", "--workers", workers)
    assert again.returncode == 0, again.stderr


def test_pack_leaves_out_a_file_it_cannot_read_and_names_it(tmp_path, monkeypatch, capsys):
    """One unreadable file (a permission, a disk error) is left out with a warning; it does
    not end a run of hours."""
    from remoteloader.tools import pack as pack_module

    src = make_imagefolder(tmp_path / "src", CLASSES[:2], 3, size=(24, 32), seed=9)
    broken = str(src / "bee" / "bee_00001.jpg")
    read_sample = pack_module.read_sample  # (root reads any file whatever its mode: fail the read itself)

    def failing(path, offset, length):
        if str(path) == broken:
            raise PermissionError(13, "Permission denied", broken)
        return read_sample(path, offset, length)

    monkeypatch.setattr(pack_module, "read_sample", failing)
    report = pack_module.pack(str(src), str(tmp_path / "dst"), 1 << 20, progress=False, workers=1)
    assert report.counts["left out"] == 1 and sum(report.counts.values()) == 6
    assert "1 file(s) could not be read and are left out: bee/bee_00001.jpg (cannot read it: Permission denied)" \
        in capsys.readouterr().err
    names = {name for name, _ in members(report.paths[0])}
    assert "bee/bee_00000.jpg" in names and "bee/bee_00001.jpg" not in names and "bee/bee_00001.cls" not in names
    assert len(TarShard(*open_storage(str(report.paths[0])), CLASSES[:2])) == 5


def test_pack_refuses_tar_shards_as_its_source(packed, tmp_path):
    _, dst, _ = packed
    result = pack_cli(dst, tmp_path / "again", "--quiet")
    assert result.returncode == 2 and "pack reads an ImageFolder" in result.stderr, result.stderr
    assert not (tmp_path / "again").exists()


def test_pack_refuses_a_destination_holding_shards(packed):
    src, dst, _ = packed
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    again = pack_cli(src, dst, "--shard-size", "1MB", "--quiet")
    assert again.returncode != 0
    assert "not empty" in again.stderr and str(dst) in again.stderr, again.stderr
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before  # nothing overwritten


def test_pack_refuses_a_non_empty_destination(packed, tmp_path):
    """Any content, not only shard-*.tar: a server on the folder would also index other .tar files
    (open_shards globs *.tar) and mix them into the dataset, and classes.txt would be overwritten."""
    src, _, _ = packed
    out = tmp_path / "busy"
    out.mkdir()
    other = write_tar(out / "other-dataset.tar", [("z/q.jpg", b"\xff\xd8\xff"), ("z/q.cls", b"0")])
    before = other.read_bytes()
    result = pack_cli(src, out, "--shard-size", "1MB", "--quiet")
    assert result.returncode != 0, f"packed into a non-empty folder: {sorted(os.listdir(out))}"
    assert sorted(os.listdir(out)) == ["other-dataset.tar"] and other.read_bytes() == before


def test_pack_refuses_an_output_folder_inside_its_source_and_the_reverse(tmp_path):
    """Shards written inside the source would become one of its classes (and a source inside
    the output would be mixed into it); refused before anything is written."""
    from remoteloader.tools import pack as pack_module

    src = make_imagefolder(tmp_path / "outer" / "src", CLASSES[:2], 2, size=(24, 32), seed=10)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for dst, message in ((src / "shards", "inside the source"), (src / "ant" / "x", "inside the source"),
                         (src, "is the source"), (tmp_path / "outer", "inside the output folder")):
        with pytest.raises(ValueError, match=message):
            pack_module.pack(str(src), str(dst), 1 << 20, progress=False, workers=1)
    result = pack_cli(src, f"{src}/../src/shards", "--quiet")  # the CLI: one line, whatever the spelling
    assert result.returncode == 2 and "inside the source" in result.stderr, result.stderr
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_an_empty_class_folder_stays_a_class_and_is_named_in_one_warning(tmp_path, caplog):
    """Dropping it would shift the labels of the classes after it; keeping it silently adds a
    class the model has no sample of."""
    from remoteloader.server.formats.imagefolder import ImageFolderShard

    src = make_imagefolder(tmp_path / "src", CLASSES, 2, size=(24, 32), seed=11)
    (src / "bat").mkdir()
    (src / "cow").mkdir()
    (src / "cow" / "notes.txt").write_text("no images here")
    caplog.set_level(logging.WARNING, logger="remoteloader.server.catalog")
    shard = ImageFolderShard(*open_storage(str(src)))
    assert shard.class_names == ["ant", "bat", "bee", "cat", "cow"]
    assert {shard.key(i).split("/")[0]: int(shard.labels[i]) for i in range(len(shard))} == \
        {"ant": 0, "bee": 2, "cat": 3}
    empty = [r.getMessage() for r in caplog.records if "hold no" in r.getMessage()]
    assert len(empty) == 1 and "2 class folder(s)" in empty[0] and "bat, cow" in empty[0], empty


def test_pack_says_what_it_reads_when_the_source_holds_no_images(tmp_path):
    """pack refuses tar shards as its source, so its message offers only the ImageFolder layout;
    a server's still offers both."""
    (tmp_path / "src" / "ant").mkdir(parents=True)
    result = pack_cli(tmp_path / "src", tmp_path / "dst", "--quiet")
    assert result.returncode == 2 and "holds no images" in result.stderr and "DIR/<class>/<image>" in result.stderr
    assert ".tar" not in result.stderr, result.stderr
    assert not (tmp_path / "dst").exists()
    with pytest.raises(CatalogError, match="or WebDataset .tar shards"):
        open_shards([str(tmp_path / "src")])


def test_a_sidecar_index_matches_a_scan_and_a_stale_one_is_ignored(packed, tmp_path):
    from remoteloader.server.formats.index import INDEX_SUFFIX, load

    _, dst, _ = packed
    tar = sorted(dst.glob("*.tar"))[0]
    copy = tmp_path / "copy" / tar.name
    copy.parent.mkdir()
    copy.write_bytes(tar.read_bytes())  # no sidecar: scanned, and one is written
    scanned = TarShard(*open_storage(str(copy)), [])
    assert (copy.parent / (tar.name + INDEX_SUFFIX)).is_file()
    loaded = TarShard(*open_storage(str(copy)), [])  # from the sidecar
    packed_one = TarShard(*open_storage(str(tar)), [])  # from pack's sidecar
    for shard in (loaded, packed_one):
        assert shard.id == scanned.id and len(shard) == len(scanned)
        assert [shard.key(i) for i in range(len(shard))] == [scanned.key(i) for i in range(len(scanned))]
        assert shard.labels.tolist() == scanned.labels.tolist()
        assert [shard.locate(i)[1:] for i in range(len(shard))] == [scanned.locate(i)[1:] for i in range(len(scanned))]
    with open(copy, "ab") as f:  # the tar changed: the sidecar no longer matches and is ignored
        f.write(b"\0" * 1024)
    storage, name = open_storage(str(copy))
    assert load(storage, storage.head(name)) is None
    rescanned = TarShard(storage, name, [])  # scanned again, and the sidecar rewritten
    assert rescanned.id == scanned.id and load(storage, storage.head(name)) is not None


def test_pack_no_shuffle_keeps_classes_together(packed, tmp_path):
    src, _, _ = packed
    out = tmp_path / "ordered"
    result = pack_cli(src, out, "--shard-size", shard_size_for(src, 6), "--no-shuffle", "--quiet")
    assert result.returncode == 0, result.stderr
    first = members(out / "shard-00000.tar")
    assert {name.split("/")[0] for name, _ in first} == {CLASSES[0]}


# ---- TarShard indexing ---------------------------------------------------------------------
