"""MXNet RecordIO files served without MXNet: fixtures written by MXNet 1.9.1's own ``recordio``
and ``im2rec.py`` (tests/fixtures/recordio/make_fixtures.py): an ImageNet list, InsightFace's
layout, multi-label records and a record its writer split where the magic word occurred."""

from __future__ import annotations

import json
import pathlib
import shutil
import tarfile

import numpy as np
import pytest

from remoteloader.client import RemoteLoader
from remoteloader.server.catalog import CatalogError
from remoteloader.server.formats import FormatOptions, open_shards

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "recordio"
LAYOUTS = ("imagenet", "insightface", "multilabel", "split")
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


def copies(folder: pathlib.Path) -> pathlib.Path:
    """The fixture files in a folder of the test's (an index is kept beside them)."""
    folder.mkdir(parents=True, exist_ok=True)
    for layout in LAYOUTS:
        for ext in ("rec", "idx"):
            shutil.copy(FIXTURES / f"{layout}.{ext}", folder / f"{layout}.{ext}")
    return folder


def reference_folder(root: pathlib.Path) -> pathlib.Path:
    """An ImageFolder of the very JPEG bytes the .rec files hold: ``<layout>/<key>.jpg``."""
    with tarfile.open(FIXTURES / "reference.tar") as tar:
        for member in tar.getmembers():
            path = root / member.name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
    return root


def epoch(address: str, run_bounded, **kwargs) -> dict[str, dict]:
    """{key: {"image": pixels, and the batch's other values}} of one eval epoch."""
    options = dict(batch_size=4, image_size=32, pipeline="eval", shuffle=False, drop_last=False, return_ids=True,
                   connect_timeout=30)
    options.update(kwargs)
    out: dict[str, dict] = {}
    with RemoteLoader(address, **options) as loader:
        ids = []
        # (dict batches: run_bounded makes tuples of them; the test's timeout bounds this)
        for batch in loader if "fields" in kwargs else run_bounded(loader, 60):
            if isinstance(batch, dict):
                rows = [{"image": batch["images"][k].numpy(), "labels": batch["labels"][k].numpy().tolist(),
                         "id": int(batch["ids"][k])} for k in range(len(batch["ids"]))]
            else:
                images, labels, batch_ids = batch
                rows = [{"image": images[k].numpy(), "label": int(labels[k]), "id": int(batch_ids[k])}
                        for k in range(len(batch_ids))]
            for row in rows:
                ids.append(row["id"])
                out[loader.sample_key(row["id"])] = row
        assert sorted(ids) == list(range(loader.num_samples)), "not every sample exactly once"
    return out


def test_each_layout_serves_every_image_once_with_its_jpeg_pixels_and_the_writers_labels(cluster, run_bounded,
                                                                                        tmp_path):
    data = copies(tmp_path / "rec")
    reference = reference_folder(tmp_path / "folder")
    servers = cluster.add_many([[str(data / f"{layout}.rec")] for layout in LAYOUTS] + [[str(reference)]],
                               "--cache-dir", str(tmp_path / "cache"))
    folder = epoch(cluster.address(servers[-1]), run_bounded)
    for layout, server in zip(LAYOUTS, servers):
        multi = layout == "multilabel"
        served = epoch(cluster.address(server), run_bounded, **({"fields": ["labels"]} if multi else {}))
        assert sorted(served) == sorted(EXPECTED[layout]), f"{layout}: other samples than the writer's images"
        for key, row in served.items():
            assert np.array_equal(row["image"], folder[f"{layout}/{key}.jpg"]["image"]), f"{layout} {key}: pixels"
            assert row["labels" if multi else "label"] == EXPECTED[layout][key], f"{layout} {key}: label"


def test_insightface_header_and_identity_records_are_not_samples(tmp_path):
    (shard,) = open_shards([str(copies(tmp_path / "rec") / "insightface.rec")],
                           FormatOptions(index_folder=str(tmp_path / "indexes")))
    assert [shard.key(i) for i in range(len(shard))] == ["1", "2", "3", "4", "5"]
    assert shard.labels.tolist() == [0, 0, 1, 1, 1], "the images' identities are their classes"


def test_a_split_record_reads_back_whole_and_a_cut_or_damaged_file_is_refused_by_name(tmp_path):
    data = copies(tmp_path / "rec")
    raw = (data / "split.rec").read_bytes()
    (shard,) = open_shards([str(data / "split.rec")], FormatOptions(index_folder=str(tmp_path / "indexes")))
    joined = shard.locate(1)
    with open(joined.path, "rb") as f:
        f.seek(joined.offset)
        image = f.read(joined.length)
    with tarfile.open(FIXTURES / "reference.tar") as tar:
        assert image == tar.extractfile("split/1.jpg").read(), "the split record's image was not joined whole"  # type: ignore[union-attr]
    cut = tmp_path / "cut.rec"
    cut.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(CatalogError, match=r"cut\.rec: the record at byte \d+ is cut short"):
        open_shards([str(cut)], FormatOptions(index_folder=str(tmp_path / "indexes")))
    damaged = tmp_path / "damaged.rec"
    damaged.write_bytes(raw[:748] + b"\0\0\0\0" + raw[752:])  # the second record's magic word
    with pytest.raises(CatalogError, match=r"damaged\.rec: no RecordIO magic word at byte 748"):
        open_shards([str(damaged)], FormatOptions(index_folder=str(tmp_path / "indexes")))
