"""Targets beyond class labels: boxes, masks, keypoints, multi-labels and extra arrays, from COCO
files, tar shards with ``.json``/``.mask.png`` members and ``--source`` objects.

The geometry tests draw coloured shapes (tools/shapes.py: each class its own colour), let
real servers augment them, and check the returned targets against the returned pixels: a
box must hold its class's colour and every pixel of that colour must lie in a box of its
class; the mask must agree with the colours; a keypoint (a shape's centre) must sit on its
shape. The other tests check the guarantees classification has (exactly once, determinism,
resume, failover) with targets, the COCO reader on hand-made files, the source plugin, and
that every bad input is a per-sample failure naming the key and the reason.
"""

from __future__ import annotations

import json
import pathlib
import textwrap

import cv2
import numpy as np
import pytest
import torch
from conftest import Cluster

from remoteloader.client import LoaderError, RemoteLoader
from remoteloader.protos import loader_pb2
from remoteloader.protos import targets as wire
from remoteloader.server import targets as tg
from remoteloader.server.catalog import CatalogError
from remoteloader.server.formats import open_shards
from remoteloader.server.formats.coco import CocoShard
from remoteloader.server.storage import open_storage
from remoteloader.tools.local import LocalServer, ServerStartError
from remoteloader.tools.shapes import CATEGORIES, make_coco, make_target_tar
from remoteloader.tools.textures import encode_jpeg, make_imagefolder

METADATA = pathlib.Path(__file__).parent / "fixtures" / "metadata"

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

SIZE = 96
COLOURS = {i + 1: np.asarray(colour, np.float32) for i, (_, _, colour) in enumerate(CATEGORIES)}
ALL = ["bboxes", "bbox_labels", "mask", "keypoints"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {
        "coco": make_coco(root / "coco", 36, seed=1),
        "half-a": make_coco(root / "a", 20, seed=2),
        "half-b": make_coco(root / "b", 20, seed=3),
        "tar": make_target_tar(root / "tars" / "shapes.tar", 24, seed=4),
    }


@pytest.fixture(scope="module")
def servers(data, tmp_path_factory):
    """One server on the COCO file (masks on), one on the tar shard."""
    with Cluster(tmp_path_factory.mktemp("logs"), args=("--workers", "2")) as cluster:
        cluster.add(data["coco"], "--coco-masks", "true")
        cluster.add(data["tar"])
        yield cluster


def one_epoch(address, **kwargs) -> list[dict]:
    kwargs.setdefault("batch_size", 8)
    kwargs.setdefault("image_size", SIZE)
    kwargs.setdefault("drop_last", False)
    with RemoteLoader(address, **kwargs) as loader:
        return list(loader)


def colour_classes(image: np.ndarray) -> np.ndarray:
    """Per pixel: the class whose colour it is (0: background or a blend at an edge)."""
    pixels = image.astype(np.float32)
    out = np.zeros(image.shape[:2], np.int64)
    for label, colour in COLOURS.items():
        out[np.linalg.norm(pixels - colour, axis=-1) < 70] = label
    return out


def check_on_pixels(image: np.ndarray, boxes, box_labels, mask, keypoints, where: str, owned: bool = True) -> None:
    """The targets of one returned sample against its returned pixels."""
    classes = colour_classes(image)
    inside_any = {label: np.zeros(classes.shape, bool) for label in COLOURS}
    for (x1, y1, x2, y2), label in zip(boxes.tolist(), box_labels.tolist()):
        assert 0 <= x1 < x2 <= SIZE and 0 <= y1 < y2 <= SIZE, f"{where}: box {x1, y1, x2, y2} leaves the image"
        region = classes[int(y1) : int(np.ceil(y2)), int(x1) : int(np.ceil(x2))]
        inside_any[label][max(0, int(y1) - 2) : int(np.ceil(y2)) + 2, max(0, int(x1) - 2) : int(np.ceil(x2)) + 2] = True
        # A square fills its box, also once clipped (a disc's or triangle's clipped box may keep
        # only an empty corner); a sliver at the crop's edge may hold only blended pixels.
        if label == 1 and min(x2 - x1, y2 - y1) >= 4:
            share = float(np.mean(region == label))
            assert share > 0.15, (
                f"{where}: box {label} at {x1:.0f},{y1:.0f},{x2:.0f},{y2:.0f} holds {share:.0%} of its colour"
            )
    edge = np.ones(classes.shape, bool)  # a shape cut to a sliver by the crop loses its box (under 1 px)
    edge[2:-2, 2:-2] = False
    for label in COLOURS:
        stray = (classes == label) & ~inside_any[label] & ~edge
        assert stray.sum() <= 4, f"{where}: {stray.sum()} pixels of class {label}'s colour lie outside its boxes"
    if mask is not None:
        shapes = (mask > 0) & (mask != tg.CROWD)  # 255: padding, the ignore index
        core = cv2.erode(shapes.astype(np.uint8), np.ones((3, 3), np.uint8)).astype(bool)
        if core.any():
            agree = float(np.mean(classes[core] == mask[core]))
            assert agree > 0.7, f"{where}: only {agree:.0%} of masked pixels have their class's colour"
        coloured = cv2.erode((classes > 0).astype(np.uint8), np.ones((3, 3), np.uint8)).astype(bool)
        if coloured.any():
            assert float(np.mean(mask[coloured] == classes[coloured])) > 0.7, f"{where}: shapes missing from the mask"
    if keypoints is not None:
        if owned:  # COCO: each box's keypoint follows it (dropped with it)
            assert len(keypoints) == len(boxes), f"{where}: {len(keypoints)} keypoints for {len(boxes)} boxes"
            for (x, y, v), box, label in zip(keypoints.tolist(), boxes.tolist(), box_labels.tolist()):
                if v > 0:
                    assert box[0] - 1 <= x <= box[2] + 1 and box[1] - 1 <= y <= box[3] + 1, (
                        f"{where}: keypoint off its box"
                    )
                    assert classes[int(y), int(x)] == label, f"{where}: keypoint off its shape"
        for x, y, v in keypoints.tolist():
            inside = 0 <= x < SIZE and 0 <= y < SIZE
            assert (v > 0) == inside, f"{where}: point ({x:.1f}, {y:.1f}) has visibility {v}"
            if inside:
                assert classes[int(y), int(x)] > 0, f"{where}: keypoint ({x:.1f}, {y:.1f}) off every shape"


@pytest.mark.parametrize(
    "pipeline", ["train", "eval", "detection-train", "detection-eval", "segmentation-train", "segmentation-eval"]
)
def test_boxes_masks_and_keypoints_stay_on_the_pixels_they_annotate(servers, pipeline):
    for source in (0, 1):  # a COCO file, a tar with .json and .mask.png members
        batches = one_epoch(servers.address(source), pipeline=pipeline, return_ids=True, seed=5)
        seen = 0
        for batch in batches:
            assert set(batch) == {"images", "bboxes", "bbox_labels", "mask", "keypoints", "ids"} | (
                {"masks", "image_id"} if source == 0 else {"labels"}
            )
            for row in range(len(batch["ids"])):
                where = f"{pipeline}, {'coco' if source == 0 else 'tar'} sample {int(batch['ids'][row])}"
                check_on_pixels(
                    batch["images"][row].numpy(),
                    batch["bboxes"][row].numpy(),
                    batch["bbox_labels"][row].numpy(),
                    batch["mask"][row].numpy(),
                    batch["keypoints"][row].numpy(),
                    where,
                    owned=source == 0,
                )
                seen += len(batch["bboxes"][row])
        assert seen > 20, f"{pipeline}: only {seen} boxes survived the epoch"


def test_the_letterbox_eval_presets_move_boxes_exactly_as_albumentations_says(servers, data):
    """No randomness: each box is the COCO box scaled to fit and shifted by the padding."""
    shard = CocoShard(*open_storage(str(pathlib.Path(data["coco"]))), masks=False)
    batches = one_epoch(
        servers.address(0), pipeline="detection-eval", fields=["bboxes", "bbox_labels"], return_ids=True, shuffle=False
    )
    document = json.loads(pathlib.Path(data["coco"]).read_text())
    sizes = {im["file_name"]: (im["height"], im["width"]) for im in document["images"]}
    for batch in batches:
        for row, sample in enumerate(batch["ids"].tolist()):
            arrays = wire.arrays_of(loader_pb2.Targets.FromString(shard.targets(sample)))
            h, w = sizes[shard.key(sample)]
            scale = min(SIZE / h, SIZE / w)
            nh, nw = round(h * scale), round(w * scale)
            top, left = (SIZE - nh) // 2, (SIZE - nw) // 2
            expected = arrays["bboxes"] * np.asarray([nw / w, nh / h, nw / w, nh / h], np.float32)
            expected += np.asarray([left, top, left, top], np.float32)
            np.testing.assert_allclose(batch["bboxes"][row].numpy(), expected, atol=1e-3)
            assert batch["bbox_labels"][row].tolist() == arrays["bbox_labels"].tolist()


def test_a_dataset_of_class_labels_still_yields_tuples_and_fields_name_what_comes(servers, data, tmp_path, monkeypatch):
    folder = make_imagefolder(tmp_path / "folder", ["a", "b"], 4, size=(40, 40))
    with Cluster(tmp_path / "logs") as cluster:
        cluster.add(folder)
        (images, labels), *_ = one_epoch(cluster.address(0), batch_size=4)
        assert images.shape == (4, SIZE, SIZE, 3) and labels.dtype == torch.int64
        # A field no server carries is an error naming what would carry it, not empty targets.
        with pytest.raises(ValueError, match=r"none of the servers' shards carry bboxes .*COCO files"):
            RemoteLoader(cluster.address(0), batch_size=4, fields=["label", "bboxes"])
    with Cluster(tmp_path / "nomasks") as cluster:
        cluster.add(data["coco"])  # without --coco-masks
        with pytest.raises(ValueError, match=r"carry mask, masks .*--coco-masks"):
            RemoteLoader(cluster.address(0), fields=["bboxes", "mask", "masks"])
    batch, *_ = one_epoch(servers.address(1), fields=["bboxes", "labels"])
    assert set(batch) == {"images", "bboxes", "labels"}  # no mask asked for: none sent
    # fields=None: what the shards carry (masks included), learned before the loader opens its
    # receiver, which it opens once (its batch memory is sized for the masks from the start).
    import remoteloader.client.loader as loader_module

    opened = []
    open_io = loader_module.open_io
    with monkeypatch.context() as patch:
        patch.setattr(loader_module, "open_io", lambda *args: opened.append(1) or open_io(*args))
        batch, *_ = one_epoch(servers.address(0), batch_size=4)
    assert len(opened) == 1
    assert {"images", "bboxes", "bbox_labels", "mask"} <= set(batch) and batch["mask"].shape == (4, SIZE, SIZE)
    with pytest.raises(ValueError, match="cannot name a target"):
        RemoteLoader(servers.address(1), fields=["Boxes"])


def test_epochs_with_targets_are_exactly_once_deterministic_resumable_and_survive_failover(data, tmp_path):
    with Cluster(tmp_path / "logs", args=("--max-rate", "60")) as cluster:
        # Two halves of a COCO set, the second on two replicas.
        cluster.add_many([data["half-a"], data["half-b"], data["half-b"]])
        address = cluster.addresses
        kwargs = dict(batch_size=6, image_size=64, pipeline="detection-train", return_ids=True, seed=3, drop_last=False)

        def by_id(batches) -> dict:
            out = {}
            for batch in batches:
                for row, sample in enumerate(batch["ids"].tolist()):
                    assert sample not in out, f"sample {sample} came twice"
                    out[sample] = (
                        batch["images"][row].numpy().copy(),
                        batch["bboxes"][row].numpy(),
                        batch["bbox_labels"][row].numpy(),
                        batch["keypoints"][row].numpy(),
                    )
            return out

        with RemoteLoader(address, **kwargs) as loader:
            assert loader.num_samples == 40
            first = by_id(loader)
            assert sorted(first) == list(range(40))
            loader.set_epoch(0)
            iterator = iter(loader)
            head = [next(iterator) for _ in range(3)]
            state = loader.state_dict()
        again = by_id(one_epoch(address, **kwargs))
        with RemoteLoader(address, **kwargs) as resumed:
            resumed.load_state_dict(state)
            tail = list(resumed)
        for reference in (again, by_id(head + tail)):
            assert sorted(reference) == sorted(first)
            for sample, values in first.items():
                for a, b in zip(values, reference[sample]):
                    np.testing.assert_array_equal(a, b)
        # A replica dies mid-epoch: its orders go to the other one; nothing lost, nothing changed.
        with RemoteLoader(address, **kwargs) as loader:
            batches = []
            for batch in loader:
                batches.append(batch)
                if len(batches) == 2:
                    cluster.kill(2)
        failed_over = by_id(batches)
        assert sorted(failed_over) == sorted(first)
        for sample, values in first.items():
            for a, b in zip(values, failed_over[sample]):
                np.testing.assert_array_equal(a, b)


# ---- COCO ------------------------------------------------------------------------------------
def rle_string(runs: list[int]) -> str:
    """COCO's compressed RLE of uncompressed ``runs`` (the encoding pycocotools writes)."""
    out = []
    for i, value in enumerate(runs):
        if i > 2:
            value -= runs[i - 2]
        more = True
        while more:
            c = value & 0x1F
            value >>= 5
            more = value != -1 if c & 0x10 else value != 0
            if more:
                c |= 0x20
            out.append(chr(c + 48))
    return "".join(out)


def write_coco(folder: pathlib.Path, annotations: list[dict], images: int = 2) -> pathlib.Path:
    (folder / "img").mkdir(parents=True)
    rng = np.random.default_rng(0)
    entries = []
    for i in range(images):
        (folder / "img" / f"{i}.jpg").write_bytes(encode_jpeg(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)))
        entries.append({"id": 10 + i, "file_name": f"img/{i}.jpg", "height": 40, "width": 50})
    entries.append({"id": 99, "file_name": "img/missing.jpg", "height": 40, "width": 50})
    categories = [{"id": 17, "name": "cat"}, {"id": 5, "name": "dog"}]
    path = folder / "instances.json"
    path.write_text(json.dumps({"images": entries, "annotations": annotations, "categories": categories}))
    return path


def test_the_coco_reader_converts_boxes_labels_crowds_polygons_and_rle(tmp_path):
    mask = np.zeros((40, 50), np.uint8)
    mask[5:15, 30:45] = 1
    flat = mask.T.reshape(-1).astype(np.int64)  # COCO's runs go column by column, zeros first
    runs = np.diff(np.r_[0, np.flatnonzero(np.diff(flat)) + 1, len(flat)]).tolist()
    if flat[0]:
        runs = [0, *runs]
    annotations = [
        {
            "id": 1,
            "image_id": 10,
            "category_id": 5,
            "bbox": [1, 2, 10, 20],
            "iscrowd": 0,
            "segmentation": [[1, 2, 11, 2, 11, 22, 1, 22]],
            "area": 200,
        },
        {
            "id": 2,
            "image_id": 10,
            "category_id": 17,
            "bbox": [30, 5, 15, 10],
            "iscrowd": 1,
            "segmentation": {"counts": rle_string(runs), "size": [40, 50]},
            "area": 150,
        },
        {"id": 3, "image_id": 10, "category_id": 17, "bbox": [20, 20, 0, 5], "iscrowd": 0, "area": 0},
        {
            "id": 4,
            "image_id": 11,
            "category_id": 17,
            "bbox": [0, 0, 5, 5],
            "iscrowd": 0,
            "segmentation": {"counts": [0, 5, 35, 5, 35, 5, 35, 5, 35, 5, 1835], "size": [40, 50]},
            "area": 25,
        },
        {"id": 5, "image_id": 11, "category_id": 42, "bbox": [0, 0, 5, 5], "iscrowd": 0},
    ]
    shard = CocoShard(*open_storage(str(write_coco(tmp_path, annotations))), masks=True)
    assert shard.class_names == ["background", "dog", "cat"]  # by category id: 5, then 17
    assert shard.fields == ("bboxes", "bbox_labels", "mask", "masks", "image_id")
    first = loader_pb2.Targets.FromString(shard.targets(0))
    arrays = wire.arrays_of(first)
    np.testing.assert_array_equal(arrays["bboxes"], [[1, 2, 11, 22]])  # crowd and empty boxes left out
    assert arrays["bbox_labels"].tolist() == [1]
    drawn = tg.draw_regions(first.regions, 40, 50)
    assert (drawn[5:15, 30:45] == tg.CROWD).all() and (drawn[3:21, 2:10] == 1).all()
    assert int(drawn.astype(bool).sum()) == int((drawn[5:15, 30:45] > 0).sum() + (drawn == 1).sum())
    # One instance mask per box, in the boxes' order: the crowd region is in none of them.
    instances = tg.draw_instances(first.regions, len(arrays["bboxes"]), 40, 50)
    assert instances.shape == (1, 40, 50)
    np.testing.assert_array_equal(instances[0], (drawn == 1).astype(np.uint8))
    assert arrays["image_id"].tolist() == [10]
    second = loader_pb2.Targets.FromString(shard.targets(1))
    assert "unknown category_id 42" in second.error
    assert "missing" in loader_pb2.Targets.FromString(shard.targets(2)).error
    (tmp_path / "bad.json").write_text(json.dumps({"annotations": []}))
    with pytest.raises(CatalogError, match="not a COCO annotation file"):
        open_shards([str(tmp_path / "bad.json")])


# ---- bad input ---------------------------------------------------------------------------------
def test_bad_targets_are_per_sample_failures_naming_key_and_reason(tmp_path):
    rng = np.random.default_rng(0)
    image = encode_jpeg(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8))
    good_mask = cv2.imencode(".png", np.zeros((30, 40), np.uint8))[1].tobytes()
    wrong_mask = cv2.imencode(".png", np.zeros((31, 40), np.uint8))[1].tobytes()
    members = {
        "ok": {"bboxes": [[1, 1, 10, 10]], "bbox_labels": [0]},
        "not-object": [1, 2],
        "nan": {"bboxes": [[1, float("nan"), 10, 10]], "bbox_labels": [0]},
        "negative": {"bboxes": [[10, 1, 5, 10]], "bbox_labels": [0]},
        "outside": {"bboxes": [[1, 1, 80, 10]], "bbox_labels": [0]},
        "unlabelled": {"bboxes": [[1, 1, 5, 5]]},
        "wrong-mask": {"bboxes": [], "bbox_labels": []},
        "broken": "{",
    }
    import io
    import tarfile

    path = tmp_path / "bad.tar"
    with tarfile.open(path, "w") as tar:
        for key, targets in members.items():
            body = targets.encode() if isinstance(targets, str) else json.dumps(targets).encode()
            files = {f"{key}.jpg": image, f"{key}.json": body}
            if key in ("ok", "wrong-mask"):
                files[f"{key}.mask.png"] = good_mask if key == "ok" else wrong_mask
            for name, payload in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    expected = {
        "not-object.jpg": "must be an object",
        "nan.jpg": "NaN",
        "negative.jpg": "width or height of zero or less",
        "outside.jpg": "lies outside the 40x30 image",
        "unlabelled.jpg": "without bbox_labels",
        "wrong-mask.jpg": "mask is 40x31 but the image is 40x30",
        "broken.jpg": "json",
    }
    with Cluster(tmp_path / "logs") as cluster:
        cluster.add(path)
        seen = []
        batches = one_epoch(
            cluster.address(0),
            pipeline="eval",
            fields=["bboxes", "bbox_labels", "mask"],
            on_error=seen.extend,
            shuffle=False,
        )
        reasons = {f.key: f.reason for f in seen}
        assert set(reasons) == set(expected), reasons
        for key, text in expected.items():
            assert text.lower() in reasons[key].lower(), (key, reasons[key])
        assert sum(len(b["ids"]) if "ids" in b else len(b["images"]) for b in batches) == len(members)
        with pytest.raises(LoaderError, match="outside.jpg"):
            one_epoch(cluster.address(0), pipeline="eval", fields=["bboxes", "bbox_labels"], shuffle=False)
        assert cluster.alive(0)


def test_a_json_of_metadata_beside_the_class_is_served_without_a_warning(tmp_path):
    """Shards as webdataset's ShardWriter writes them for timm and img2dataset (.jpg, .cls and a
    .json of file name, size, caption, url: tests/fixtures/metadata/make_fixture.py): the JSON's
    text is metadata, not targets that fail, and the JSON, carrying no target field, is
    metadata whole: the batches stay (images, labels) tuples with the .cls labels."""
    found, metadata = tg.split_metadata({"bboxes": [[1, 1, 5, 5]], "bbox_labels": [1], "caption": "a cat",
                                         "url": "https://x/1.jpg", "Width": 3, "score": 0.5, "tags": ["a"]})
    assert set(found) == {"bboxes", "bbox_labels", "score"}, "a JSON mixing targets and metadata uses the targets"
    assert set(metadata) == {"caption", "url", "Width", "tags"}
    assert tg.from_source(found)[1]["bboxes"].shape == (1, 4)
    assert tg.split_metadata({"bboxes": "oops"})[0] == {"bboxes": "oops"}, "a known field is a target, to fail named"
    assert tg.split_metadata({"score": 0.5}) == ({"score": 0.5}, {}), "an extra field alone is still a target"
    assert tg.split_metadata({"width": 64, "caption": "c"}) == ({}, {"width": 64, "caption": "c"})
    for shard in sorted(METADATA.glob("*.tar")):
        (tmp_path / shard.name).write_bytes(shard.read_bytes())
    (tmp_path / "classes.txt").write_text("red\ngreen\nblue\n")
    with Cluster(tmp_path / "logs") as cluster:
        cluster.add(tmp_path, "--cache-dir", str(tmp_path / "cache"))
        log = cluster.stderr(0)
        assert "cannot be used" not in log and "WARNING" not in log, log
        failures: list = []
        with RemoteLoader(cluster.address(0), batch_size=3, image_size=32, drop_last=False, return_ids=True,
                          on_error=failures.extend) as loader:
            assert set(loader.sample_space.fields) <= {"label"}, loader.sample_space.fields
            got = {int(i): int(label) for _images, labels, ids in loader for label, i in zip(labels, ids)}
        assert not failures and sorted(got) == list(range(8)), (failures, got)
        assert sorted(got.values()) == sorted(i % 3 for i in range(8)), f"not the .cls labels: {got}"


def test_the_client_refuses_malformed_target_arrays():
    message = wire.to_message({"bboxes": np.zeros((2, 4), np.float32)})
    assert wire.arrays_of(message)["bboxes"].shape == (2, 4)
    message.arrays[0].shape[:] = [3, 4]
    with pytest.raises(wire.TargetError, match="do not hold"):
        wire.arrays_of(message)
    message = loader_pb2.Targets()
    message.arrays.add(name="x", dtype="object", shape=[1], data=b"\0" * 8)
    with pytest.raises(wire.TargetError, match="dtype"):
        wire.arrays_of(message)


# ---- --source ----------------------------------------------------------------------------------
SOURCE = textwrap.dedent(
    '''
    import numpy as np

    class Shapes:
        """Images as arrays or JPEG bytes, boxes, multi-labels and an extra embedding."""

        class_names = ["background", "thing"]
        fields = ["bboxes", "bbox_labels", "labels", "embedding"]

        def __init__(self, count, broken=()):
            self.count = count
            self.broken = set(broken)
            self.labels = [i % 2 for i in range(count)]

        def __len__(self):
            return self.count

        def key(self, i):
            return f"item-{i}"

        def sample(self, i):
            if i in self.broken:
                raise RuntimeError(f"no sample {i} today")
            image = np.zeros((50, 60, 3), np.uint8)
            image[10:30, 20:40] = (230, 40, 40)
            targets = {"bboxes": [[20, 10, 40, 30]], "bbox_labels": [1], "labels": [1, i % 2],
                       "embedding": np.full(4, i, np.float32)}
            if i == 3:
                targets["bboxes"] = "wrong"
            return image, targets

    def make(count, broken=()):
        return Shapes(count, broken)

    def fails(**kwargs):
        raise OSError("the dataset's bucket is not mounted")
    '''
)


def test_a_source_plugin_serves_its_samples_with_replicas_and_clear_errors(tmp_path):
    (tmp_path / "myshapes.py").write_text(SOURCE)
    env = {"PYTHONPATH": str(tmp_path)}
    args = ["--workers", "1", "--source", "myshapes:make", "--source-args", json.dumps({"count": 10, "broken": [7]})]
    servers = [LocalServer([], args=args, env=env, log_path=tmp_path / f"s{i}.log") for i in range(2)]
    try:
        for server in servers:
            server.start()
        seen = []
        with RemoteLoader(
            [s.address for s in servers],
            batch_size=5,
            image_size=SIZE,
            pipeline="detection-eval",
            drop_last=False,
            shuffle=False,
            on_error=seen.extend,
            return_ids=True,
        ) as loader:
            assert loader.num_samples == 10  # the two servers are replicas of one shard
            assert loader.class_names == ["background", "thing"]
            batches = list(loader)
        reasons = {f.key: f.reason for f in seen}
        assert set(reasons) == {"item-3", "item-7"}
        assert "no sample 7 today" in reasons["item-7"] and "bboxes" in reasons["item-3"]
        batch = batches[0]
        assert set(batch) == {"images", "label", "bboxes", "bbox_labels", "labels", "embedding", "ids"}
        assert batch["label"].tolist() == [0, 1, 0, 1, 0]
        assert batch["embedding"][2].tolist() == [2.0] * 4 and batch["labels"][1].tolist() == [1, 1]
        check_on_pixels(
            batch["images"][0].numpy(),
            batch["bboxes"][0].numpy(),
            batch["bbox_labels"][0].numpy(),
            None,
            None,
            "source sample 0",
        )
        # A classification loader on the same source: labels only, and the images still come.
        seen.clear()
        labelled = one_epoch(servers[0].address, batch_size=5, pipeline="eval", shuffle=False, fields=["label"],
                             on_error=seen.extend)
        assert {f.key for f in seen} == {"item-3", "item-7"}
        assert set(labelled[0]) == {"images", "label"} and labelled[0]["label"].tolist() == [0, 1, 0, 1, 0]
        assert labelled[0]["images"][0].float().mean() > 0
    finally:
        for server in servers:
            server.stop()
    broken = LocalServer([], args=["--source", "myshapes:fails"], env=env, log_path=tmp_path / "fails.log")
    with pytest.raises(ServerStartError, match="bucket is not mounted"):
        broken.start()


def test_a_coco_catalog_keeps_a_few_hundred_bytes_per_sample(tmp_path):
    """No Python object per sample: keys and targets live in blobs (7 boxes: about 300 bytes)."""
    (tmp_path / "img").mkdir()
    jpeg = encode_jpeg(np.zeros((8, 8, 3), np.uint8))
    count, images, annotations = 500, [], []
    for i in range(count):
        (tmp_path / "img" / f"{i:012d}.jpg").write_bytes(jpeg)
        images.append({"id": i, "file_name": f"img/{i:012d}.jpg", "height": 480, "width": 640})
        for k in range(7):
            annotations.append(
                {
                    "id": len(annotations),
                    "image_id": i,
                    "category_id": 1 + k % 3,
                    "bbox": [10.5 * k, 20.25, 30.0 + k, 40.0],
                    "iscrowd": 0,
                }
            )
    categories = [{"id": c, "name": f"c{c}"} for c in (1, 2, 3)]
    path = tmp_path / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    shard = CocoShard(*open_storage(str(path)))
    held = (
        len(shard._targets)
        + len(shard._key_blob)
        + sum(a.nbytes for a in (shard._key_ends, shard.labels, shard._offsets, shard._sizes, shard._target_ends))
    )
    assert held / count < 400, f"{held / count:.0f} bytes per sample"
    arrays = wire.arrays_of(loader_pb2.Targets.FromString(shard.targets(count - 1)))
    assert arrays["bboxes"].shape == (7, 4) and arrays["bbox_labels"].tolist() == [1, 2, 3, 1, 2, 3, 1]


def test_a_pipeline_starting_with_a_crop_decodes_its_region_and_moves_targets_as_albumentations(monkeypatch):
    """The fused region decode keeps working with targets: the same crop window is drawn, the
    targets equal the plain path's (whole decode, the same A.Compose) exactly, the pixels up
    to resampling (the region is decoded at a reduced DCT scale)."""
    from remoteloader.server import decode as dec
    from remoteloader.server.pipelines import Pipeline, PipelineSpec
    from remoteloader.tools.shapes import make_sample

    regions = []
    decode_crop = dec.decode_crop
    monkeypatch.setattr(dec, "decode_crop", lambda *a, **k: regions.append(a[4]) or decode_crop(*a, **k))
    rng = np.random.default_rng(0)
    pipeline = Pipeline(PipelineSpec("train", 64, 64, fields=("bboxes", "bbox_labels", "mask", "keypoints")))
    differences = []
    for i in range(30):
        image, shapes = make_sample(rng, 300, 400)
        data = encode_jpeg(image)
        boxes = np.asarray([[x, y, x + w, y + h] for _, _, (x, y, w, h) in shapes], np.float32)
        arrays = {
            "bboxes": boxes,
            "bbox_labels": np.arange(len(boxes)),
            "keypoints": (boxes[:, :2] + boxes[:, 2:]) / 2 @ np.eye(2, 3, dtype=np.float32) + [0, 0, 2],
        }
        mask = cv2.resize(colour_classes(image).astype(np.uint8), (400, 300), interpolation=cv2.INTER_NEAREST)
        fused = pipeline.with_targets(data, i, dict(arrays), lambda h, w, m=mask: m, verified=True)
        assert len(regions) == i + 1, "the image was not decoded by its crop's region"
        fmt, h, w = dec.read_size(data, 10**8)
        pipeline.reseed(i)
        pixels = dec.decode(data, fmt, 0, 0, h, w)
        plain = pipeline._transform(pixels, dict(arrays), lambda h, w, m=mask: m, lambda n, h, w: None)
        assert fused[1].keys() == plain[1].keys() == {"bboxes", "bbox_labels", "keypoints"}
        for name in fused[1]:
            np.testing.assert_array_equal(fused[1][name], plain[1][name], err_msg=name)
        np.testing.assert_array_equal(fused[2], plain[2])
        differences.append(np.abs(fused[0].astype(int) - plain[0].astype(int)).mean())
    assert np.mean(differences) < 6, differences
