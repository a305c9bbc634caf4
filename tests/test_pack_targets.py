"""``remoteloader pack annotations.json DST``: a COCO file packed into tar shards, read back.

No servers: the tars are opened as a server opens them (``open_shards``) and every sample's
targets are compared with those of the COCO file read as a server reads it (``CocoShard``).
"""

from __future__ import annotations

import json
import pathlib
import tarfile

import numpy as np
import pytest
from packing import pack_cli

from remoteloader.protos import loader_pb2
from remoteloader.protos.targets import EMPTY
from remoteloader.server import decode as dec
from remoteloader.server import targets as tg
from remoteloader.server.catalog import MASK_SUFFIX
from remoteloader.server.formats import open_shards
from remoteloader.server.formats.coco import CocoShard
from remoteloader.server.formats.index import INDEX_SUFFIX
from remoteloader.server.formats.tar import TarShard
from remoteloader.server.storage import open_storage
from remoteloader.tools.shapes import make_coco

pytestmark = [pytest.mark.timeout(60), pytest.mark.slow]

COUNT = 30
COMPARED = (tg.BBOXES, tg.BBOX_LABELS, tg.KEYPOINTS, tg.IMAGE_ID)


def edit_coco(path: pathlib.Path) -> dict[str, str]:
    """make_coco's file with the cases a real one has; returns what each edited image shows."""
    document = json.loads(path.read_text())
    images = {im["id"]: im for im in document["images"]}
    annotations = document["annotations"]
    by_image: dict[int, list[dict]] = {}
    for ann in annotations:
        by_image.setdefault(ann["image_id"], []).append(ann)

    def add(image_id: int, **fields) -> None:
        annotations.append({"id": len(annotations) + 1000, "image_id": image_id, "iscrowd": 0, **fields})

    # A crowd region (uncompressed RLE, column-major): 255 in the mask, no box.
    h, w = images[1]["height"], images[1]["width"]
    add(
        1,
        category_id=7,
        iscrowd=1,
        bbox=[2, 3, 4, 5],
        segmentation={"counts": [5 * h + 3, 40, h * w - 5 * h - 43], "size": [h, w]},
    )
    # A polygon of another class over a shape: the overlap is 255.
    x, y, bw, bh = by_image[2][0]["bbox"]
    other = 3 if by_image[2][0]["category_id"] != 3 else 7
    add(
        2,
        category_id=other,
        bbox=[x, y, bw / 2, bh / 2],
        segmentation=[[x, y, x + bw / 2, y, x + bw / 2, y + bh / 2, x, y + bh / 2]],
    )
    # No annotations at all: empty boxes, an empty mask.
    annotations[:] = [a for a in annotations if a["image_id"] != 3]
    # An unknown category: the sample is left out.
    add(4, category_id=99, bbox=[1, 1, 5, 5], segmentation=[[1, 1, 6, 1, 6, 6]])
    # A box of no width: left out of the boxes, by both.
    add(6, category_id=3, bbox=[10, 10, 0, 7], segmentation=[[10, 10, 10, 17, 11, 17]])
    # A shape without a keypoint.
    del by_image[7][0]["keypoints"]
    path.write_text(json.dumps(document))
    # An image file that is gone: left out, as pack leaves out what it cannot read.
    (path.parent / images[5]["file_name"]).unlink()
    return {"bad": images[4]["file_name"], "missing": images[5]["file_name"], "empty": images[3]["file_name"]}


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    root = tmp_path_factory.mktemp("coco")
    path = make_coco(root / "src", COUNT, size=(64, 80), seed=3)
    cases = edit_coco(path)
    return path, cases


@pytest.fixture(scope="module")
def packed_masks(coco, tmp_path_factory):
    """The real CLI, with --masks and two worker processes (masks are drawn in the workers)."""
    path, _ = coco
    dst = tmp_path_factory.mktemp("packed") / "masks"
    result = pack_cli(path, dst, "--masks", "--shard-size", "40KB", "--workers", "2", "--quiet")
    assert result.returncode == 0, result.stderr
    return dst, result


def samples(folder: pathlib.Path) -> dict[str, tuple[TarShard, int]]:
    shards = open_shards([str(folder)])
    assert all(isinstance(s, TarShard) for s in shards)
    found = {}
    for shard in shards:
        for i in range(len(shard)):
            assert shard.key(i) not in found, f"{shard.key(i)} packed twice"
            found[shard.key(i)] = (shard, i)
    return found


def arrays(record: bytes) -> dict[str, np.ndarray]:
    message = loader_pb2.Targets.FromString(record)
    assert not message.error, message.error
    got = tg.arrays_of(message)
    return {name: got[name] if name in got else np.zeros(*EMPTY[name]) for name in COMPARED}


def read(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def check_same_targets(folder: pathlib.Path, coco_path: pathlib.Path, cases: dict[str, str], masks: bool) -> None:
    reference = CocoShard(*open_storage(str(coco_path)), masks=True)
    tars = samples(folder)
    expected = {}
    for i in range(len(reference)):
        record = loader_pb2.Targets.FromString(reference.targets(i))
        if not record.error:
            expected[reference.key(i)] = i
    assert cases["bad"] not in expected and cases["missing"] not in expected
    assert sorted(tars) == sorted(expected) and len(tars) == COUNT - 2
    some = next(iter(tars.values()))[0]
    assert some.class_names == reference.class_names == ["background", "square", "disc", "triangle"]
    unmasked = CocoShard(*open_storage(str(coco_path)))  # the fields a server on the COCO file offers, without masks
    # (pack writes the semantic mask as <key>.mask.png; the instance masks stay with the COCO file)
    fields = set(reference.fields if masks else unmasked.fields) - {"masks"}
    for shard in {s for s, _ in tars.values()}:
        assert set(shard.fields) == fields, (shard.fields, fields)
        assert pathlib.Path(shard.path + INDEX_SUFFIX).is_file()
    for key, (shard, i) in tars.items():
        want = arrays(reference.targets(expected[key]))
        got = arrays(shard.targets(i))
        for name in COMPARED:
            assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), (key, name)
        assert int(shard.labels[i]) == int(reference.labels[expected[key]]) == -1
        image = read(*shard.locate(i)[:3])
        original = pathlib.Path(reference.locate(expected[key]).path).read_bytes()
        _, height, width = dec.read_size(image, 1 << 30)
        assert np.array_equal(dec.decode(image, "jpeg"), dec.decode(original, "jpeg")), key
        stored = loader_pb2.Targets.FromString(shard.targets(i))
        assert bool(stored.mask_length) == masks, key
        if masks:
            mask = tg.read_mask_png(read(shard.path, stored.mask_offset, stored.mask_length), height, width)
            regions = loader_pb2.Targets.FromString(reference.targets(expected[key])).regions
            assert np.array_equal(mask, tg.draw_regions(regions, height, width)), key
            if key == "images/00000.jpg":
                assert np.count_nonzero(mask == tg.CROWD) == 40  # the crowd region
            if key == "images/00001.jpg":
                assert np.count_nonzero(mask == tg.CROWD) > 0  # the overlap
            if key == cases["empty"]:
                assert not mask.any()


def test_pack_coco_with_masks_matches_the_coco_file(coco, packed_masks):
    path, cases = coco
    dst, result = packed_masks
    check_same_targets(dst, path, cases, masks=True)
    assert len(list(dst.glob("*.tar"))) >= 2  # --shard-size splits it
    assert (dst / "classes.txt").read_text() == "background\nsquare\ndisc\ntriangle\n"
    assert f"{COUNT - 2} of {COUNT - 1} files rewritten" in result.stdout or dec._jpeg is None, result.stdout
    err = result.stderr
    assert "1 sample(s) have annotations that cannot be used and are left out: " in err, err
    assert f"{cases['bad']} (annotation" in err and "unknown category_id 99" in err, err
    assert f"1 file(s) could not be read and are left out: {cases['missing']}" in err, err
    # What speaks to a server (samples that "fail when served", samples with "no label") is not pack's to say.
    assert "fail when served" not in err and "no label" not in err, err


def test_pack_coco_members_and_json(coco, packed_masks):
    _, cases = coco
    dst, _ = packed_masks
    names = []
    for tar in sorted(dst.glob("*.tar")):
        with tarfile.open(tar) as f:
            members = {m.name: f.extractfile(m).read() for m in f.getmembers()}
        names += members
        for name, data in members.items():
            if name.endswith(".json"):
                document = json.loads(data)
                assert set(document) <= {"bboxes", "bbox_labels", "keypoints", "image_id"}, document  # no _keypoint_box
                assert name[: -len(".json")] + ".jpg" in members and name[: -len(".json")] + MASK_SUFFIX in members
    assert not any(n.endswith(".cls") for n in names)  # detection samples have no class label
    stem = cases["empty"][: -len(".jpg")]
    document = json.loads(members_of(dst, stem + ".json"))
    assert document == {"bboxes": [], "bbox_labels": [], "image_id": document.get("image_id")}
    assert isinstance(document["image_id"], list) and len(document["image_id"]) == 1  # COCO's id travels along


def members_of(folder: pathlib.Path, name: str) -> bytes:
    for tar in folder.glob("*.tar"):
        with tarfile.open(tar) as f:
            if name in f.getnames():
                return f.extractfile(name).read()
    raise KeyError(name)


def test_pack_coco_without_masks_and_verbatim(coco, tmp_path, capsys):
    from remoteloader.tools import pack as pack_module

    path, cases = coco
    report = pack_module.pack(str(path), str(tmp_path / "out"), 1 << 20, progress=False, transcode=False, workers=1)
    assert report.counts["bad targets"] == 1 and report.counts["left out"] == 1
    assert report.counts["copied"] == COUNT - 2
    check_same_targets(tmp_path / "out", path, cases, masks=False)
    with tarfile.open(report.paths[0]) as f:
        assert not any(n.endswith(MASK_SUFFIX) for n in f.getnames())
        image = f.extractfile("images/00000.jpg").read()
    assert image == (path.parent / "images" / "00000.jpg").read_bytes()  # --verbatim: byte for byte


def test_pack_coco_image_root_and_options_that_need_a_coco_file(coco, tmp_path):
    from remoteloader.tools import pack as pack_module

    path, _ = coco
    elsewhere = tmp_path / "annotations" / "instances.json"  # the json apart from its images
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(path.read_bytes())
    result = pack_cli(elsewhere, tmp_path / "out", "--image-root", path.parent, "--verbatim", "--quiet")
    assert result.returncode == 0, result.stderr
    assert len(samples(tmp_path / "out")) == COUNT - 2
    missing = pack_cli(elsewhere, tmp_path / "out2", "--quiet")  # images looked for beside the json
    assert missing.returncode == 2 and f"{COUNT} file(s) could not be read" in missing.stderr, missing.stderr
    assert "none of the 30 samples could be packed" in missing.stderr and not (tmp_path / "out2").exists()
    with pytest.raises(ValueError, match="--image-root"):
        pack_module.pack(str(path), str(tmp_path / "out3"), 1 << 20, image_root=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="for a COCO annotation .json source"):
        pack_module.pack(str(path.parent / "images"), str(tmp_path / "out4"), 1 << 20, masks=True)
    assert not (tmp_path / "out3").exists() and not (tmp_path / "out4").exists()
