"""Tar shards: ``remoteloader pack`` (the real CLI), TarShard indexing, and servers on tar folders.

One module-wide set of servers on 127.0.0.1 (tests only read from them):
    0     the original ImageFolder SRC
    1, 2  the packed tar folder DST, twice: replicas of the same shards
"""

from __future__ import annotations

import io
import logging
import os
import pathlib
import re
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from conftest import CTRL_C_EXITS

from remoteloader.client import RemoteLoader
from remoteloader.server import decode as dec
from remoteloader.server.catalog import CatalogError
from remoteloader.server.formats import open_shards
from remoteloader.server.formats.tar import TarShard
from remoteloader.server.storage import open_storage
from remoteloader.tools.textures import encode_jpeg, make_image, make_imagefolder

pytestmark = pytest.mark.timeout(120)

CLASSES = ["ant", "bee", "cat"]
PER_CLASS = 8  # 24 samples
SIZE = 16
SHARDS = 3


def pack_command(*args) -> tuple[list[str], dict[str, str]]:
    """The real CLI's command line and an environment without REMOTELOADER_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTELOADER_")}
    return [sys.executable, "-m", "remoteloader.tools.cli", "pack", *map(str, args)], env


def pack_cli(*args, timeout: float = 60) -> subprocess.CompletedProcess:
    command, env = pack_command(*args)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def shard_size_for(src: pathlib.Path, shards: int) -> int:
    """A --shard-size giving about ``shards`` shards (pack counts data + 1536 bytes of headers)."""
    total = sum(p.stat().st_size + 1536 for p in src.rglob("*.jpg"))
    return total // shards + 1


def members(path: pathlib.Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("tar-data")
    src = make_imagefolder(root / "src", CLASSES, PER_CLASS, size=(40, 56), seed=4, jitter=0.2)
    dst = root / "dst"
    result = pack_cli(src, dst, "--shard-size", shard_size_for(src, SHARDS))
    assert result.returncode == 0, result.stderr
    return src, dst, result


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
    verbatim = pack_cli(src, tmp_path / "verbatim", "--quiet", "--verbatim")
    assert verbatim.returncode == 0 and "rewritten" not in verbatim.stdout and "copied" not in verbatim.stderr
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


def write_tar(path: pathlib.Path, entries: list[tuple[str, bytes]]) -> pathlib.Path:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def jpegs() -> dict[str, bytes]:
    rng = np.random.default_rng(5)
    return {k: encode_jpeg(make_image(i, 6, rng, 24, 32)) for i, k in enumerate("abcdefg")}


def test_tar_shard_labels_wherever_the_cls_is(tmp_path, jpegs):
    j = jpegs
    path = write_tar(tmp_path / "mixed.tar", [
        ("x/a.cls", b"3"), ("x/a.jpg", j["a"]),  # label before its image
        ("x/b.jpg", j["b"]), ("x/b.cls", b"1\n"),  # right after (the WebDataset way)
        ("x/c.jpg", j["c"]), ("x/d.jpg", j["d"]), ("x/c.cls", b" 2 "), ("x/d.cls", b"0"),  # not adjacent
        ("x/g.cls", b"5"), ("x/e.jpg", j["e"]), ("x/e.cls", b"4"), ("x/g.jpg", j["g"]),  # before, not adjacent
        ("x/f.jpg", j["f"]), ("notes.txt", b"not a sample"), ("x/f.cls", b"5"),  # another member between
    ])
    shard = TarShard(*open_storage(str(path)), [])
    labels = {shard.key(i): int(shard.labels[i]) for i in range(len(shard))}
    assert labels == {"x/a.jpg": 3, "x/b.jpg": 1, "x/c.jpg": 2, "x/d.jpg": 0, "x/e.jpg": 4, "x/g.jpg": 5,
                      "x/f.jpg": 5}
    for i in range(len(shard)):
        location = shard.locate(i)
        with open(location.path, "rb") as f:
            f.seek(location.offset)
            assert f.read(location.length) == j[shard.key(i)[2]]
    assert shard.id.startswith("tar-") and shard.name == "mixed.tar"


def test_tar_shard_bad_label_names_the_file(tmp_path, jpegs):
    path = write_tar(tmp_path / "bad.tar", [("k/one.jpg", jpegs["a"]), ("k/one.cls", b"1"),
                                            ("k/two.jpg", jpegs["b"]), ("k/two.cls", b"dog")])
    with pytest.raises(CatalogError) as info:
        TarShard(*open_storage(str(path)), [])
    message = str(info.value)
    assert "k/two.cls" in message and "bad.tar" in message and "dog" in message


def test_tar_without_images_is_an_error(tmp_path):
    path = write_tar(tmp_path / "empty.tar", [("k/one.cls", b"1"), ("readme.txt", b"hello")])
    with pytest.raises(CatalogError, match="no images"):
        TarShard(*open_storage(str(path)), [])
    folder = tmp_path / "folder"
    folder.mkdir()
    write_tar(folder / "nothing.tar", [])
    with pytest.raises(CatalogError, match="no images"):
        open_shards([str(folder)])


def test_a_tar_without_cls_members_warns_once_per_start_naming_it(tmp_path, jpegs, packed, caplog):
    """A tar made by hand with images only is served with every label -1: said at start-up,
    with where labels and class names come from; pack's shards say nothing."""
    path = write_tar(tmp_path / "mine.tar", [("x/a.jpg", jpegs["a"]), ("x/b.jpg", jpegs["b"]),
                                             ("x/c.jpg", jpegs["c"]), ("x/c.cls", b"1")])
    caplog.set_level(logging.WARNING, logger="remoteloader.server.catalog")
    for _ in ("scanned", "from the sidecar"):
        caplog.clear()
        shard = TarShard(*open_storage(str(path)), [])
        assert shard.labels.tolist() == [-1, -1, 1]
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 2, warnings  # no label, and no name for label 1 (no classes.txt)
        assert "mine.tar" in warnings[0] and "2 of 3 samples have no label" in warnings[0]
        assert "<key>.cls" in warnings[0] and "classes.txt" in warnings[0]
        assert "labels go up to 1 but no classes.txt is beside it to name them" in warnings[1]
    caplog.clear()
    TarShard(*open_storage(str(path)), ["p", "q"])  # named: only the missing labels are said
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1, caplog.text
    caplog.clear()
    open_shards([str(packed[1])])
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_server_refuses_a_tar_folder_without_images(tmp_path):
    from remoteloader.tools.local import server_command, server_env

    write_tar(tmp_path / "shard-00000.tar", [("k/one.cls", b"1")])
    result = subprocess.run(server_command() + ["--data", str(tmp_path), "--port", "0", "--workers", "1"],
                            capture_output=True, text=True, timeout=60, env=server_env())
    assert result.returncode == 2, result.stderr
    assert "shard-00000.tar" in result.stderr and "no images" in result.stderr, result.stderr


def test_tar_shard_ids_are_fingerprints_of_the_contents(packed, tmp_path):
    _, dst, _ = packed
    first = open_shards([str(dst)])
    second = open_shards([str(dst)])
    assert [s.id for s in first] == [s.id for s in second]
    assert len({s.id for s in first}) == len(first)
    assert all(s.class_names == CLASSES for s in first)
    # The same bytes elsewhere (another mount) are the same shard; other bytes are not.
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "shard-00000.tar").write_bytes((dst / "shard-00000.tar").read_bytes())
    # Without classes.txt the labels have no names: not the same shard to a client.
    assert open_shards([str(copy)])[0].id != first[0].id
    (copy / "classes.txt").write_bytes((dst / "classes.txt").read_bytes())
    for sidecar in copy.glob("*.npz"):
        sidecar.unlink()
    assert open_shards([str(copy)])[0].id == first[0].id  # scanned
    assert open_shards([str(copy)])[0].id == first[0].id  # from the sidecar it wrote


# ---- servers on tar folders ------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(module_cluster, packed):
    src, dst, _ = packed
    indices = module_cluster.add_many([src, dst, dst], wait=False)
    for i in indices:
        module_cluster.wait_ready(i, timeout=60)
    return [module_cluster.address(i) for i in indices]


def eval_epoch(run_bounded, address, **kwargs):
    """{key: (pixels, class name)} for one eval epoch of the given server(s)."""
    options = dict(batch_size=10, image_size=SIZE, pipeline="eval", shuffle=False, drop_last=False,
                   return_ids=True, connect_timeout=20, reconnect_timeout=5)
    options.update(kwargs)
    with RemoteLoader(address, **options) as loader:
        out, ids = {}, []
        for images, labels, batch_ids in run_bounded(loader, 40):
            for image, label, i in zip(images.numpy(), labels.tolist(), batch_ids.tolist()):
                ids.append(i)
                out[loader.sample_key(i)] = (image.copy(), loader.class_names[label])
        assert sorted(ids) == list(range(loader.num_samples)), "not every sample exactly once"
        return out, loader


def test_tar_server_serves_what_the_imagefolder_server_serves(servers, run_bounded):
    folder, _ = eval_epoch(run_bounded, servers[0])
    tars, loader = eval_epoch(run_bounded, servers[1])
    assert len(loader.catalog.shards) >= 2
    assert len(folder) == len(tars) == len(CLASSES) * PER_CLASS
    assert folder.keys() == tars.keys()
    for key, (image, name) in folder.items():
        assert name == key.split("/")[0]
        assert tars[key][1] == name, f"{key}: label {tars[key][1]!r} from tars, {name!r} from the folder"
        assert np.array_equal(tars[key][0], image), f"{key}: eval pixels differ between tar and folder"


@pytest.mark.skipif(dec._jpeg is None, reason="the native JPEG module was not built")
def test_the_server_says_how_many_of_its_jpegs_are_packed(servers, module_cluster):
    logs = {s.address: s.process.stderr() for s in module_cluster.servers if s.port}
    assert re.search(r"0 of 16 sampled JPEGs have a restart marker per MCU: `remoteloader pack`", logs[servers[0]])
    assert re.search(r"16 of 16 sampled JPEGs have a restart marker per MCU$", logs[servers[1]], re.M)


def test_two_servers_on_one_tar_folder_are_replicas(servers, run_bounded):
    with RemoteLoader([servers[1], servers[2]], batch_size=8, image_size=SIZE, connect_timeout=20) as loader:
        assert loader.num_samples == len(CLASSES) * PER_CLASS  # not twice
        for shard in loader.catalog.shards:
            assert sorted(shard.owners) == sorted([servers[1], servers[2]])
    both, loader = eval_epoch(run_bounded, [servers[1], servers[2]])
    single, _ = eval_epoch(run_bounded, servers[1])
    assert both.keys() == single.keys()
    for key, (image, name) in single.items():
        assert np.array_equal(both[key][0], image) and both[key][1] == name


def test_a_server_serves_tars_without_indexes_from_a_read_only_mount(packed, servers, tmp_path, run_bounded):
    """Compose mounts shards :ro and Kubernetes readOnly: tars made by other tools (no sidecar
    index) are scanned and served, their indexes kept in the index folder (--cache-dir), one
    line says so, and the next start reads them from there instead of scanning again."""
    from conftest import DEFAULT_ARGS, READ_ONLY_MOUNT, read_only_mounts

    from remoteloader.tools.local import ServerProcess, server_command

    _, dst, _ = packed
    folder = tmp_path / "ro"
    folder.mkdir()
    why = read_only_mounts(folder)
    if why:
        pytest.skip(why)
    for path in dst.iterdir():
        if not path.name.endswith(".index.npz"):
            (folder / path.name).write_bytes(path.read_bytes())
    before = sorted(os.listdir(folder))
    argv = [*READ_ONLY_MOUNT, str(folder), *server_command(), "--data", str(folder), "--host", "127.0.0.1",
            "--port", "0", "--cache-dir", str(tmp_path / "cache"), *DEFAULT_ARGS]
    for start in ("first", "next"):
        server = ServerProcess(argv, tmp_path / f"ro-server-{start}.log")
        try:
            port = server.wait_ready(60)
            log = server.stderr()
            if start == "first":
                served, _ = eval_epoch(run_bounded, f"127.0.0.1:{port}")
                expected, _ = eval_epoch(run_bounded, servers[1])
                assert served.keys() == expected.keys()
                for key, (image, name) in expected.items():
                    assert np.array_equal(served[key][0], image) and served[key][1] == name, key
                assert re.search(r"\d+ shard file\(s\) have no \.index\.npz index beside them and it cannot be "
                                 r"written there \(Read-only file system\): their indexes are kept in the index "
                                 r"folder", log), log
                assert log.count("cannot be written there") == 1 and log.count("has no index: scanned") == 3, log
            else:
                assert "scanned" not in log and "cannot be written there" not in log, log
        finally:
            server.signal(subprocess.signal.SIGTERM)
            server.wait(30)
            server.reap()
    assert len(list((tmp_path / "cache" / "indexes").glob("*.index.npz"))) == 3
    assert sorted(os.listdir(folder)) == before  # nothing was written, not even a partial file
