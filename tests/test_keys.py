"""A sample's key names one sample of a server's data, and the same one after a restart.

TFRecord files written as TensorFlow's ``build_image_data.py`` shards them (three files of
``tf.train.Example`` with its features, ``image/filename`` among them; the Example and the
TFRecord framing encoded here by their field numbers, as ``test_formats.py`` does), TFRecord files
without file names (record numbers repeat in every file), and Parquet files as Hugging Face
``datasets`` writes them (an ``Image`` feature: ``{bytes, path}`` structs, the ``huggingface``
schema metadata; written with pyarrow in that schema, ``datasets`` not being installed here),
whose paths repeat in every file; and MXNet RecordIO files, whose ids every ``.rec`` counts from
0 (``fixtures/recordio/``, written by MXNet). Every sample carries its own label, so that a key's sample is
known by the label served with its id.
"""

from __future__ import annotations

import json
import logging
import pathlib
import struct

import cv2
import numpy as np
import pytest

from remoteloader.client import RemoteLoader
from remoteloader.server.formats import FormatOptions, open_shards
from remoteloader.server.formats import tfrecord as tfrecord_format
from remoteloader.server.formats.keys import make_unique

pytestmark = [pytest.mark.timeout(240)]

FILES, PER_FILE = 3, 4
CLASSES = [f"class{i}" for i in range(3 * FILES * PER_FILE)]  # a class of its own for every sample
NOT_AN_IMAGE = b"\xff\xd8\xff\xe0 not a JPEG at all"


def jpeg(seed: int) -> bytes:
    image = np.full((24, 32, 3), (seed * 37) % 256, np.uint8)
    ok, data = cv2.imencode(".jpg", image)
    assert ok
    return data.tobytes()


# ---- TFRecord, as build_image_data.py writes it ------------------------------------------------
def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def example(features: dict[str, bytes | int]) -> bytes:
    """A serialized tf.train.Example: bytes features as BytesList, ints as a packed Int64List."""
    entries = b""
    for name, value in features.items():
        if isinstance(value, int):
            feature = _field(3, _field(1, _varint(value)))  # Feature.int64_list(Int64List.value, packed)
        else:
            feature = _field(1, _field(1, value))  # Feature.bytes_list(BytesList.value)
        entries += _field(1, _field(1, name.encode()) + _field(2, feature))  # Features.feature map entry
    return _field(1, entries)  # Example.features


def write_tfrecord(path: pathlib.Path, examples: list[bytes]) -> None:
    crc = tfrecord_format.masked_crc
    with open(path, "wb") as f:
        for data in examples:
            head = struct.pack("<Q", len(data))
            f.write(head + struct.pack("<I", crc(head)) + data + struct.pack("<I", crc(data)))


def build_image_data(folder: pathlib.Path, prefix: str, filenames: bool, first_label: int) -> dict[str, int]:
    """Three TFRecord files of four Examples each, with build_image_data.py's features (without
    ``image/filename`` unless ``filenames``); the second file's third image is not a JPEG.
    Returns each sample's expected key -> its label (its own, one per sample)."""
    folder.mkdir(parents=True)
    expected = {}
    for k in range(FILES):
        name = f"{prefix}-{k:05d}-of-{FILES:05d}.tfrecord"
        records = []
        for j in range(PER_FILE):
            label = first_label + k * PER_FILE + j
            filename = f"n{label:08d}_{j}.JPEG"
            features: dict[str, bytes | int] = {
                "image/height": 24, "image/width": 32, "image/colorspace": b"RGB", "image/channels": 3,
                "image/class/label": label, "image/class/synset": b"n%08d" % label,
                "image/class/text": b"class %d" % label, "image/format": b"JPEG",
                "image/encoded": NOT_AN_IMAGE if (k, j) == (1, 2) else jpeg(label),
            }
            if filenames:
                features["image/filename"] = filename.encode()
            records.append(example(features))
            expected[filename if filenames else f"{name}/record-{j:08d}"] = label
        write_tfrecord(folder / name, records)
    (folder / "classes.txt").write_text("".join(f"{n}\n" for n in CLASSES))  # (as the Parquet files name them)
    return expected


# ---- Parquet, as Hugging Face datasets writes it ----------------------------------------------
def hugging_face_parquet(folder: pathlib.Path, first_label: int) -> dict[str, int]:
    """Three Parquet files of an Image feature and a label, whose paths ("00000.jpg"...) repeat
    in every file (as ``datasets`` keeps each image's original file name); the third file's
    second image is not a JPEG. Returns each sample's expected key -> its label."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    features = {"image": {"_type": "Image"}, "label": {"names": CLASSES, "_type": "ClassLabel"}}
    expected = {}
    for k in range(FILES):
        name = f"train-{k:05d}-of-{FILES:05d}.parquet"
        labels = [first_label + k * PER_FILE + j for j in range(PER_FILE)]
        images = [{"bytes": NOT_AN_IMAGE if (k, j) == (2, 1) else jpeg(label), "path": f"{j:05d}.jpg"}
                  for j, label in enumerate(labels)]
        table = pa.table({"image": pa.array(images, image_type), "label": pa.array(labels, pa.int64())})
        table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
        pq.write_table(table, folder / name)
        expected.update({f"{name}/{j:05d}.jpg": label for j, label in enumerate(labels)})
    return expected


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """(folder, expected key -> label) of each set: TFRecord with and without file names, Parquet."""
    root = tmp_path_factory.mktemp("keys")
    step = FILES * PER_FILE
    return {
        "tfrecord": (root / "tfrecord", build_image_data(root / "tfrecord", "train", True, 0)),
        "records": (root / "records", build_image_data(root / "records", "validation", False, step)),
        "parquet": (root / "parquet", hugging_face_parquet(root / "parquet", 2 * step)),
    }


BAD = {"n00000006_2.JPEG", "validation-00001-of-00003.tfrecord/record-00000002",
       "train-00002-of-00003.parquet/00001.jpg"}


def test_each_sets_keys_name_one_sample_each_with_the_file_where_names_repeat(sets, tmp_path):
    for kind, (folder, expected) in sets.items():
        shards = open_shards([str(folder)], FormatOptions(index_folder=str(tmp_path / kind)))
        make_unique(shards)
        keys = {s.key(i): int(s.labels[i]) for s in shards for i in range(len(s))}
        assert keys == expected, kind
    # A set's files alone: where no name repeats, none carries its file.
    (single,) = open_shards([str(sets["records"][0] / "validation-00000-of-00003.tfrecord")],
                            FormatOptions(index_folder=str(tmp_path / "one")))
    make_unique([single])
    assert [single.key(i) for i in range(len(single))] == [f"record-{j:08d}" for j in range(PER_FILE)]


def test_recordio_ids_that_every_rec_counts_from_zero_carry_their_file(tmp_path):
    fixtures = pathlib.Path(__file__).parent / "fixtures" / "recordio"  # written by MXNet's recordio
    for name in ("imagenet", "multilabel"):
        for ext in ("rec", "idx"):
            (tmp_path / "data").mkdir(exist_ok=True)
            (tmp_path / "data" / f"{name}.{ext}").write_bytes((fixtures / f"{name}.{ext}").read_bytes())
    shards = open_shards([str(tmp_path / "data")], FormatOptions(index_folder=str(tmp_path / "i")))
    make_unique(shards)
    keys = [s.key(i) for s in shards for i in range(len(s))]
    assert len(set(keys)) == len(keys) == 10
    assert keys[0] == "imagenet.rec/0" and keys[-1] == "multilabel.rec/3"


def test_a_parquet_file_whose_paths_repeat_within_it_is_keyed_by_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    images = [{"bytes": jpeg(i), "path": "image.jpg"} for i in range(3)]
    pq.write_table(pa.table({"image": pa.array(images, image_type), "label": [0, 1, 2]}), tmp_path / "a.parquet")
    (shard,) = open_shards([str(tmp_path / "a.parquet")], FormatOptions(index_folder=str(tmp_path / "cache" / "i")))
    assert [shard.key(i) for i in range(3)] == ["row-00000000", "row-00000001", "row-00000002"]


def test_an_index_kept_before_keys_were_file_names_is_scanned_again(sets, tmp_path, monkeypatch):
    path = str(sets["tfrecord"][0] / "train-00000-of-00003.tfrecord")
    options = FormatOptions(index_folder=str(tmp_path / "i"))
    with monkeypatch.context() as m:  # as an older server kept it: keys named another way
        m.setattr(tfrecord_format.TFRecordShard, "key_rule", "")
        (old,) = open_shards([path], options)
        assert old.scanned
        (again,) = open_shards([path], options)
        assert not again.scanned, "the index was not kept"
    (shard,) = open_shards([path], options)
    assert shard.scanned, "an index whose keys mean something else was used"
    assert shard.key(0) == "n00000000_0.JPEG"
    (kept,) = open_shards([path], options)
    assert not kept.scanned and kept.key(0) == "n00000000_0.JPEG"


def test_names_repeated_within_one_shard_are_said_at_start(tmp_path, caplog):
    from remoteloader.server.catalog import KeyTable, Shard

    def shard(name: str, keys: list[str]) -> Shard:
        table = KeyTable()
        for key in keys:
            table.add(key, 0, 0, 1)
        return Shard(name, table, [], name)

    a, b, c = shard("a", ["x", "y"]), shard("b", ["x", "z"]), shard("c", ["w", "w"])
    with caplog.at_level(logging.INFO, logger="remoteloader.server.formats.keys"):
        make_unique([a, b, c])
    assert [a.key(0), a.key(1), b.key(0), b.key(1), c.key(0)] == ["a/x", "a/y", "b/x", "b/z", "w"]
    assert "1 key(s) each name more than one sample (e.g. 'w')" in caplog.text


def served(address: str, run_bounded) -> tuple[dict[int, int], dict[int, str], list]:
    """One epoch: each delivered sample's label by id, every id's sample_key, the failures."""
    failures: list = []
    with RemoteLoader(address, batch_size=5, image_size=16, pipeline="eval", shuffle=False, drop_last=False,
                      return_ids=True, on_error=failures.extend, connect_timeout=60) as loader:
        labels = {}
        for _images, batch_labels, ids in run_bounded(loader, 120):
            labels.update(zip(ids.tolist(), batch_labels.tolist()))
        keys = {i: loader.sample_key(i) for i in range(loader.num_samples)}
    return labels, keys, failures


def test_sample_key_and_failures_name_the_right_sample_and_survive_a_restart(cluster, sets, run_bounded):
    expected = {key: label for _folder, keys in sets.values() for key, label in keys.items()}
    i = cluster.add([str(folder) for folder, _keys in sets.values()])
    labels, keys, failures = served(cluster.address(i), run_bounded)
    assert sorted(keys.values()) == sorted(expected), "keys are not one per sample"
    assert {f.key for f in failures} == BAD and {keys[f.sample_id] for f in failures} == BAD
    delivered = {i: label for i, label in labels.items() if keys[i] not in BAD}
    assert len(delivered) == len(expected) - len(BAD)
    assert {i: expected[keys[i]] for i in delivered} == delivered, "a key names another sample than its id's"
    cluster.restart(i)
    _labels, again, _failures = served(cluster.address(i), run_bounded)
    assert again == keys, "keys changed across a restart"
