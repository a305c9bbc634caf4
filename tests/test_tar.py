"""Tar shards: TarShard indexing, and servers on tar folders.

One module-wide set of servers on 127.0.0.1 (tests only read from them):
    0     the original ImageFolder SRC
    1, 2  the packed tar folder DST, twice: replicas of the same shards
"""

from __future__ import annotations

import logging
import os
import re
import subprocess

import numpy as np
import pytest
from packing import CLASSES, PER_CLASS, SIZE, write_tar

from remoteloader.client import RemoteLoader
from remoteloader.server import decode as dec
from remoteloader.server.catalog import CatalogError
from remoteloader.server.formats import open_shards
from remoteloader.server.formats.tar import TarShard
from remoteloader.server.storage import open_storage
from remoteloader.tools.textures import encode_jpeg, make_image

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


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
                assert log.count("cannot be written there") == 1, log
                assert re.search(r"indexed 3 shards, .*: 3 scanned", log), log
            else:
                assert "scanned" not in log and "cannot be written there" not in log, log
                assert re.search(r"indexed 3 shards, .*: 3 from kept indexes", log), log
        finally:
            server.signal(subprocess.signal.SIGTERM)
            server.wait(30)
            server.reap()
    assert len(list((tmp_path / "cache" / "indexes").glob("*.index.npz"))) == 3
    assert sorted(os.listdir(folder)) == before  # nothing was written, not even a partial file


def gzipped_tars(dst, folder) -> None:
    """The packed tars, compressed by GNU tar, gzip and zstd as a user would: the first unpacked
    and packed again with ``tar -czf`` as ``.tgz``, the last by ``zstd`` as ``.tar.zst``, the
    others by ``gzip`` as ``.tar.gz``."""
    tars = sorted(p for p in dst.iterdir() if p.name.endswith(".tar"))
    for k, path in enumerate(tars):
        if k == 0:
            unpacked = folder.parent / "unpacked"
            unpacked.mkdir()
            subprocess.run(["tar", "-xf", str(path), "-C", str(unpacked)], check=True)
            names = subprocess.run(["tar", "-tf", str(path)], check=True, capture_output=True, text=True).stdout
            subprocess.run(["tar", "-czf", str(folder / (path.stem + ".tgz")), "-C", str(unpacked),
                            *names.split()], check=True)
        else:
            zstd = k == len(tars) - 1
            with open(path, "rb") as tar, open(folder / (path.name + (".zst" if zstd else ".gz")), "wb") as out:
                subprocess.run(["zstd", "-q", "-c"] if zstd else ["gzip", "-c"], check=True, stdin=tar, stdout=out)
    (folder / "classes.txt").write_bytes((dst / "classes.txt").read_bytes())


def test_gzipped_tars_on_a_read_only_mount_are_decompressed_once_and_serve_as_the_tars(packed, servers, tmp_path,
                                                                                      run_bounded):
    """``.tar.gz``, ``.tgz`` and ``.tar.zst`` shards (webdataset reads them): decompressed once into
    --cache-dir, then served as the tars they hold; the next start reuses the tars."""
    from conftest import DEFAULT_ARGS, READ_ONLY_MOUNT, read_only_mounts

    from remoteloader.tools.local import ServerProcess, server_command

    _, dst, _ = packed
    folder = tmp_path / "ro"
    folder.mkdir()
    gzipped_tars(dst, folder)
    wrap = [] if read_only_mounts(folder) else [*READ_ONLY_MOUNT, str(folder)]  # (read-only where it can be)
    before = sorted(os.listdir(folder))
    argv = [*wrap, *server_command(), "--data", str(folder), "--host", "127.0.0.1", "--port", "0",
            "--cache-dir", str(tmp_path / "cache"), *DEFAULT_ARGS]
    for start in ("first", "next"):
        server = ServerProcess(argv, tmp_path / f"gz-server-{start}.log")
        try:
            port = server.wait_ready(60)
            log = server.stderr()
            if start == "first":
                served, _ = eval_epoch(run_bounded, f"127.0.0.1:{port}")
                expected, _ = eval_epoch(run_bounded, servers[1])
                assert served.keys() == expected.keys()
                for key, (image, name) in expected.items():
                    assert np.array_equal(served[key][0], image) and served[key][1] == name, key
                assert log.count("decompressed into") == 3, log
            else:
                assert "decompressed into" not in log and "scanned" not in log, log
                assert re.search(r"indexed 3 shards, .*: 3 from kept indexes", log), log
        finally:
            server.signal(subprocess.signal.SIGTERM)
            server.wait(30)
            server.reap()
    assert sorted(os.listdir(folder)) == before, "the server wrote beside the compressed tars"
    assert len(list((tmp_path / "cache" / "tars").glob("*.tar"))) == 3


def test_a_cut_compressed_tar_is_refused_by_name(packed, tmp_path):
    from remoteloader.server.formats import FormatOptions

    _, dst, _ = packed
    tar = sorted(p for p in dst.iterdir() if p.name.endswith(".tar"))[0]
    whole = subprocess.run(["gzip", "-c", str(tar)], check=True, capture_output=True).stdout
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CatalogError, match=r"cut\.tar\.gz: not a whole gzip file"):
        open_shards([str(cut)], FormatOptions(index_folder=str(tmp_path / "cache" / "indexes")))
    whole = subprocess.run(["zstd", "-q", "-c"], input=tar.read_bytes(), check=True, capture_output=True).stdout
    cut = tmp_path / "cut.tar.zst"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CatalogError, match=r"cut\.tar\.zst: not a whole zstd file"):
        open_shards([str(cut)], FormatOptions(index_folder=str(tmp_path / "cache" / "indexes")))
    assert not [p for p in (tmp_path / "cache" / "tars").iterdir() if p.is_file()], "half a tar was left"
