"""LMDB, TFRecord and Parquet, each against the same data in tar shards, through real servers.

TFRecord files written by TensorFlow's own writer and Parquet files by Hugging Face ``datasets``
(``tests/fixtures/formats/``, with the script that made them: the suite needs neither library),
beside tar shards of the very same JPEG bytes, labels and boxes. LMDB databases are written
here with the lmdb module, as their users write them: Caffe ``Datum`` records (the protobuf
Caffe writes, built from its field numbers), WebDataset-style keys, and pickles.
"""

from __future__ import annotations

import pathlib
import pickle
import shutil
import struct
import tarfile
import time

import numpy as np
import pytest

from remoteloader.client import RemoteLoader
from remoteloader.server.catalog import CatalogError
from remoteloader.server.config import ServerConfig
from remoteloader.server.formats import FormatOptions, open_shards

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "formats"
CLASSES = "ant\nbee\ncat\n"
SHAPES = "background\nsquare\ndisc\n"


def reference(name: str) -> list[tuple[bytes, int]]:
    """(JPEG bytes, label) of each sample of a fixture tar, in order."""
    out: list[tuple[bytes, int]] = []
    with tarfile.open(FIXTURES / name) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    for key in sorted(k for k in members if k.endswith(".jpg")):
        label = members.get(key.replace(".jpg", ".cls"), b"-1")
        out.append((members[key], int(label)))
    return out


def datum_class():
    """Caffe's Datum message (caffe.proto's field numbers), so that records are what Caffe writes."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto(name="caffe_datum.proto", package="caffe", syntax="proto2")
    message = proto.message_type.add(name="Datum")
    F = descriptor_pb2.FieldDescriptorProto
    for name, number, kind, label in (("channels", 1, F.TYPE_INT32, F.LABEL_OPTIONAL),
                                      ("height", 2, F.TYPE_INT32, F.LABEL_OPTIONAL),
                                      ("width", 3, F.TYPE_INT32, F.LABEL_OPTIONAL),
                                      ("data", 4, F.TYPE_BYTES, F.LABEL_OPTIONAL),
                                      ("label", 5, F.TYPE_INT32, F.LABEL_OPTIONAL),
                                      ("float_data", 6, F.TYPE_FLOAT, F.LABEL_REPEATED),
                                      ("encoded", 7, F.TYPE_BOOL, F.LABEL_OPTIONAL)):
        message.field.add(name=name, number=number, type=kind, label=label)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("caffe.Datum"))


def write_lmdb(folder: pathlib.Path, records: list[tuple[bytes, bytes]], classes: str | None = CLASSES) -> pathlib.Path:
    import lmdb

    env = lmdb.open(str(folder), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for key, value in records:
            txn.put(key, value)
    env.close()
    if classes is not None:
        (folder / "classes.txt").write_text(classes)
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The fixtures copied out of the repository (servers write indexes beside them), with
    classes.txt where the format has no class names of its own, and three LMDB databases."""
    root = tmp_path_factory.mktemp("formats")
    for kind, classes in (("classification", CLASSES), ("detection", SHAPES)):
        folder = root / kind
        folder.mkdir()
        for ext in ("tar", "tfrecord", "parquet"):
            shutil.copy(FIXTURES / f"{kind}.{ext}", folder / f"{kind}.{ext}")
        (folder / "classes.txt").write_text(classes)
    samples = reference("classification.tar")
    Datum = datum_class()
    keys = [f"{i:08d}_{i:05d}.JPEG".encode() for i in range(len(samples))]  # convert_imageset's keys
    write_lmdb(root / "lmdb-datum", [(k, Datum(channels=3, height=64, width=64, data=jpeg, label=label,
                                               encoded=True).SerializeToString())
                                     for k, (jpeg, label) in zip(keys, samples)])
    members = []
    for i, (jpeg, label) in enumerate(samples):
        members += [(f"{i:05d}.jpg".encode(), jpeg), (f"{i:05d}.cls".encode(), str(label).encode())]
    write_lmdb(root / "lmdb-members", members)
    write_lmdb(root / "lmdb-pickle", [(f"{i:08d}".encode(), pickle.dumps((jpeg, label)))
                                      for i, (jpeg, label) in enumerate(samples)])
    return root


def by_shard(loader, batches) -> dict[str, list[tuple]]:
    """Each shard's samples in its own order: (pixels, label, targets...) per sample."""
    rows: dict[int, tuple] = {}
    for batch in batches:
        if isinstance(batch, dict):
            for j, i in enumerate(batch["ids"].tolist()):
                rows[i] = (batch["images"][j].numpy().tobytes(), int(batch["label"][j]) if "label" in batch else -1,
                           batch["bboxes"][j].numpy().tobytes(), batch["bbox_labels"][j].numpy().tobytes())
        else:
            images, labels, ids = batch
            for j, i in enumerate(ids.tolist()):
                rows[i] = (images[j].numpy().tobytes(), int(labels[j]))
    out = {}
    for shard in loader.sample_space.shards:
        out[shard.name] = [rows[i] for i in range(shard.offset, shard.offset + shard.num_samples)]
    return out


def test_every_format_serves_what_the_same_data_in_tar_shards_serves(cluster, data):
    paths = [data / "classification" / f"classification.{ext}" for ext in ("tar", "tfrecord", "parquet")]
    paths += [data / "lmdb-datum", data / "lmdb-members", data / "lmdb-pickle"]
    i = cluster.add([str(p) for p in paths], "--lmdb-unpickle")
    with RemoteLoader(cluster.address(i), batch_size=5, image_size=32, pipeline="eval", shuffle=False,
                      drop_last=False, return_ids=True, connect_timeout=30) as loader:
        assert loader.class_names == ["ant", "bee", "cat"]
        shards = by_shard(loader, list(loader))
    expected = shards.pop("classification.tar")
    assert len(shards) == 5 and len(expected) == 12
    for name, samples in shards.items():
        assert samples == expected, f"{name} serves other pixels or labels than the tar of the same images"


def test_detection_formats_serve_the_same_boxes_as_tar_shards(cluster, data):
    i = cluster.add([str(data / "detection" / f"detection.{ext}") for ext in ("tar", "tfrecord", "parquet")])
    with RemoteLoader(cluster.address(i), batch_size=4, image_size=48, pipeline="detection-eval", shuffle=False,
                      drop_last=False, return_ids=True, fields=["bboxes", "bbox_labels"], connect_timeout=30) as loader:
        assert loader.class_names == ["background", "square", "disc"]
        shards = by_shard(loader, list(loader))
    expected = shards.pop("detection.tar")
    assert any(np.frombuffer(s[2], np.float32).size for s in expected), "the reference has no boxes"
    for name, samples in shards.items():
        assert samples == expected, f"{name} serves other pixels or boxes than the tar of the same images"


def test_servers_on_the_same_files_are_replicas_and_fail_over_exactly_once(cluster, data, run_bounded):
    paths = [str(data / "classification" / f"classification.{e}") for e in ("tfrecord", "parquet")]
    paths.append(str(data / "lmdb-datum"))
    first, second = cluster.add_many([paths, paths], "--max-rate", "40")

    def kill_first(n, _batch):
        if n == 1:
            cluster.kill(first)

    with RemoteLoader([cluster.address(first), cluster.address(second)], batch_size=4, image_size=32,
                      pipeline="eval", drop_last=False, return_ids=True, connect_timeout=30, prefetch=2) as loader:
        assert all(len(s.owners) == 2 for s in loader.sample_space.shards), "not replicas"
        ids = [i for _x, _y, batch in run_bounded(loader, 90, kill_first) for i in batch.tolist()]
    assert sorted(ids) == list(range(36))


# ---- damaged and mistaken inputs ---------------------------------------------------------------
def _records(path: pathlib.Path) -> list[tuple[int, int]]:
    """(offset, length) of each record of a TFRecord file."""
    raw, out, at = path.read_bytes(), [], 0
    while at < len(raw):
        (length,) = struct.unpack_from("<Q", raw, at)
        out.append((at, length))
        at += 16 + length
    return out


def test_a_damaged_tfrecord_file_fails_only_what_is_damaged(tmp_path, cluster):
    good = FIXTURES / "classification.tfrecord"
    records = _records(good)
    raw = bytearray(good.read_bytes())
    at, length = records[3]
    raw[at + 12 + length // 2] ^= 0xFF  # one byte of record 3's data: its CRC fails
    (tmp_path / "crc").mkdir()
    (tmp_path / "crc" / "a.tfrecord").write_bytes(bytes(raw))
    (shard,) = open_shards([str(tmp_path / "crc" / "a.tfrecord")], FormatOptions(index_folder=str(tmp_path / "i")))
    assert len(shard) == 12 and "fails its CRC" in shard.failure(3) and not shard.failure(2)
    cut = records[7][0] + 40  # the middle of record 7: the file ends there
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "a.tfrecord").write_bytes(good.read_bytes()[:cut])
    (cut_shard,) = open_shards([str(tmp_path / "cut" / "a.tfrecord")], FormatOptions(index_folder=str(tmp_path / "i")))
    assert len(cut_shard) == 7
    # Served: the damaged record fails by name, under on_error; the others arrive.
    i = cluster.add([str(tmp_path / "crc" / "a.tfrecord")])
    failures = []
    with RemoteLoader(cluster.address(i), batch_size=4, image_size=32, pipeline="eval", drop_last=False,
                      return_ids=True, on_error=failures.extend, connect_timeout=30) as loader:
        list(loader)
    assert [(f.key, "fails its CRC" in f.reason) for f in failures] == [("record-00000003", True)], failures


def test_mistaken_inputs_are_refused_at_start_with_what_to_do(tmp_path, data):
    import pyarrow as pa
    import pyarrow.parquet as pq

    options = FormatOptions(index_folder=str(tmp_path / "indexes"))
    pq.write_table(pa.table({"image": [b"\xff\xd8\xff"], "label": ["ant"]}), tmp_path / "strings.parquet")
    with pytest.raises(CatalogError, match="column 'label' is string, not what a label column holds"):
        open_shards([str(tmp_path / "strings.parquet")], options)
    named = ServerConfig(data=("-",), parquet_columns='{"image": "nope"}')
    with pytest.raises(CatalogError, match="no image column 'nope'"):
        open_shards([str(data / "classification" / "classification.parquet")],
                    FormatOptions(str(tmp_path / "indexes"), named))
    pickled = write_lmdb(tmp_path / "pickled", [(b"0", pickle.dumps((reference("classification.tar")[0][0], 0)))])
    with pytest.raises(CatalogError, match="--lmdb-unpickle"):
        open_shards([str(pickled)], options)
    Datum = datum_class()
    raw = write_lmdb(tmp_path / "raw-datum", [(b"0", Datum(channels=1, height=2, width=2, data=b"\0" * 4,
                                                           label=0).SerializeToString())])
    with pytest.raises(CatalogError, match="convert_imageset --encoded"):
        open_shards([str(raw)], options)
    with pytest.raises(CatalogError, match="does not exist"):
        open_shards([str(tmp_path / "nowhere.tfrecord")], options)
    (tmp_path / "empty.tfrecord").write_bytes(b"")
    with pytest.raises(CatalogError, match="no TFRecord records"):
        open_shards([str(tmp_path / "empty.tfrecord")], options)


def test_a_tfrecord_example_without_an_image_fails_by_name(tmp_path):
    from remoteloader.server.formats import tfrecord

    example = bytes([0x0A, 0x00])  # an Example with empty Features
    record = struct.pack("<Q", len(example))
    record += struct.pack("<I", tfrecord.masked_crc(record)) + example + struct.pack("<I", tfrecord.masked_crc(example))
    (tmp_path / "a.tfrecord").write_bytes(record)
    (shard,) = open_shards([str(tmp_path / "a.tfrecord")], FormatOptions(index_folder=str(tmp_path / "i")))
    assert "no 'image/encoded' feature" in shard.failure(0)


def test_formats_are_served_from_a_read_only_mount_with_their_indexes_kept_aside(data, tmp_path, run_bounded):
    from conftest import DEFAULT_ARGS, READ_ONLY_MOUNT, read_only_mounts

    from remoteloader.tools.local import ServerProcess, server_command

    folder = tmp_path / "ro"
    folder.mkdir()
    why = read_only_mounts(folder)
    if why:
        pytest.skip(why)
    shutil.copy(FIXTURES / "classification.tfrecord", folder / "a.tfrecord")
    shutil.copytree(data / "lmdb-members", folder / "lmdb", ignore=shutil.ignore_patterns("*.index.npz"))
    argv = [*READ_ONLY_MOUNT, str(folder), *server_command(), "--data", str(folder / "a.tfrecord"),
            str(folder / "lmdb"), "--host", "127.0.0.1", "--port", "0", "--cache-dir", str(tmp_path / "cache"),
            *DEFAULT_ARGS]
    server = ServerProcess(argv, tmp_path / "ro.log")
    try:
        port = server.wait_ready(60)
        with RemoteLoader(f"127.0.0.1:{port}", batch_size=6, image_size=32, pipeline="eval", drop_last=False,
                          return_ids=True, connect_timeout=30) as loader:
            ids = [i for _x, _y, batch in run_bounded(loader, 60) for i in batch.tolist()]
        assert sorted(ids) == list(range(24))
    finally:
        server.kill()
    assert len(list((tmp_path / "cache" / "indexes").glob("*.index.npz"))) == 2, server.stderr()


def test_a_parquet_files_extract_and_index_are_reused_at_the_next_start(tmp_path, caplog):
    """Its images are copied out once; the next start reads the kept index (whose offsets are
    the extract's, not the Parquet file's) instead of extracting again."""
    import logging

    source = tmp_path / "data.parquet"
    shutil.copy(FIXTURES / "classification.parquet", source)
    options = FormatOptions(index_folder=str(tmp_path / "cache" / "indexes"))
    caplog.set_level(logging.INFO, logger="remoteloader.server.formats.parquet")
    began = time.time_ns()  # a server's indexed_ns: files written after it are never region-decoded
    (first,) = open_shards([str(source)], options)
    assert sum("extracted" in r.getMessage() for r in caplog.records) == 1
    assert pathlib.Path(first.path).stat().st_mtime_ns < began, "its crops would never decode by region"
    caplog.clear()
    (again,) = open_shards([str(source)], options)
    assert not any("extracted" in r.getMessage() for r in caplog.records), "extracted again"
    assert again.id == first.id and len(again) == len(first)
    assert [again.locate(i) for i in range(len(again))] == [first.locate(i) for i in range(len(first))]


def test_pack_turns_each_format_into_tar_shards_of_the_same_samples(data, tmp_path):
    from remoteloader.tools.pack import pack

    options = FormatOptions(index_folder=str(tmp_path / "indexes"))
    expected = reference("classification.tar")
    for source in (data / "classification" / "classification.tfrecord", data / "lmdb-datum",
                   data / "classification" / "classification.parquet"):
        out = tmp_path / source.name
        pack(str(source), str(out), shard_size=1 << 20, shuffle=False, progress=False, transcode=False)
        (shard,) = open_shards([str(out)], options)
        got = []
        for i in range(len(shard)):
            location = shard.locate(i)
            with open(location.path, "rb") as f:
                f.seek(location.offset)
                got.append((f.read(location.length), int(shard.labels[i])))
        assert got == expected, source.name
        assert shard.class_names == ["ant", "bee", "cat"], source.name
