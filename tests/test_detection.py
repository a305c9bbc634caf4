"""torchvision-ready detection: instance masks, the source geometry, and the torchvision batch form.

A COCO file of coloured shapes (tools/shapes.py) is served with ``--coco-masks``. Instance masks
must follow their boxes and agree with the semantic mask drawn from the same polygons; the
letterbox's ``to_orig`` must take the served boxes back to the file's own; and
``batch_format="torchvision"`` must meet the target contract torchvision's detection models
document (``torchvision.models.detection``: "boxes (FloatTensor[N, 4]) ... with 0 <= x1 < x2
<= W and 0 <= y1 < y2 <= H", "labels (Int64Tensor[N])", "masks (UInt8Tensor[N, H, W])") and that
its references' COCO evaluation reads ("image_id", "area", "iscrowd"). The only torchvision
wheel here has no CPU operators, so the contract is checked as documented, not by importing it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import Cluster

from remoteloader.client import RemoteLoader, boxes_to_orig
from remoteloader.server import targets as tg
from remoteloader.tools.shapes import CATEGORIES, make_coco

pytestmark = pytest.mark.timeout(180)

SIZE = (96, 128)  # (height, width): letterboxed images are padded on one side
DETECTION = ["bboxes", "bbox_labels", "mask", "masks"]


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    root = tmp_path_factory.mktemp("detection")
    path = make_coco(root / "coco", 24, seed=11)
    document = json.loads(path.read_text())
    with Cluster(tmp_path_factory.mktemp("logs"), args=("--workers", "2")) as cluster:
        cluster.add(path, "--coco-masks", "true")
        yield cluster.address(0), document


def one_epoch(address: str, **kwargs) -> list:
    kwargs.setdefault("batch_size", 8)
    kwargs.setdefault("image_size", SIZE)
    kwargs.setdefault("drop_last", False)
    kwargs.setdefault("shuffle", False)
    with RemoteLoader(address, **kwargs) as loader:
        return list(loader)


@pytest.mark.parametrize("pipeline", ["detection-train", "detection-eval", "train", "segmentation-eval"])
def test_instance_masks_follow_their_boxes_and_agree_with_the_semantic_mask(coco, pipeline):
    address, _ = coco
    seen = 0
    for batch in one_epoch(address, pipeline=pipeline, fields=DETECTION + ["to_orig"], seed=3):
        for row in range(len(batch["images"])):
            masks, boxes, labels = batch["masks"][row], batch["bboxes"][row], batch["bbox_labels"][row]
            scale = 1 / float(batch["to_orig"][row][:2].abs().min())  # output pixels per source pixel
            semantic = batch["mask"][row].numpy()
            assert masks.dtype == torch.uint8 and masks.shape == (len(boxes), *SIZE)
            masks = masks.numpy()
            assert set(np.unique(masks)) <= {0, 1}
            for i, (x1, y1, x2, y2) in enumerate(boxes.tolist()):
                ys, xs = np.nonzero(masks[i])
                # (a box the crop cut to a sliver may keep no mask pixel; a polygon is filled to
                # whole source pixels, its edge pixels included, which a flip puts on the
                # other side, and the pipeline scales by ``scale``)
                slack = 2 + scale
                if len(xs):
                    assert x1 - slack <= xs.min() and xs.max() <= x2 + slack, f"mask {i} leaves its box in x"
                    assert y1 - slack <= ys.min() and ys.max() <= y2 + slack, f"mask {i} leaves its box in y"
                seen += 1
            # Drawn from the same polygons, moved by the same nearest-neighbour transforms: a
            # pixel of class c in the semantic mask is in an instance of class c, and a
            # background pixel in none (255: overlaps and padding, as the semantic mask marks them).
            covered = np.zeros(SIZE, bool)
            for i, label in enumerate(labels.tolist()):
                covered |= masks[i] == 1
                labelled = (semantic == label) & (masks[i] == 1)
                own = semantic == label
                assert labelled.sum() <= own.sum()
            owned = (semantic > 0) & (semantic != tg.CROWD)
            # An object the crop cut below a pixel loses its box (and its instance mask) but may
            # keep a few pixels in the semantic mask.
            assert (owned & ~covered).sum() <= 8, "semantic-mask pixels in no instance mask"
            assert not (covered & (semantic == 0)).any(), "instance-mask pixels on the background"
            for i, label in enumerate(labels.tolist()):
                inside = masks[i] == 1
                assert np.isin(semantic[inside], [label, tg.CROWD]).all(), "an instance with another class's pixels"
    assert seen > 24


def test_to_orig_takes_letterboxed_boxes_back_to_the_coco_files_boxes(coco):
    address, document = coco
    expected = {}
    for ann in document["annotations"]:
        x, y, w, h = ann["bbox"]
        expected.setdefault(ann["image_id"], []).append([x, y, x + w, y + h])
    sizes = {im["id"]: (im["height"], im["width"]) for im in document["images"]}
    checked = 0
    for _images, targets in one_epoch(
        address,
        pipeline="detection-eval",
        fields=["bboxes", "bbox_labels", "orig_size", "to_orig", "image_id"],
        batch_format="torchvision",
    ):
        for target in targets:
            image_id = int(target["image_id"])
            assert tuple(target["orig_size"].tolist()) == sizes[image_id]
            back = boxes_to_orig(target["boxes"], target["to_orig"])
            # A resize rounds the image's sides to whole pixels; points (and so to_orig) move by
            # the unrounded factor: half an output pixel at most.
            slack = 0.5 * float(target["to_orig"][:2].abs().max()) + 0.01
            np.testing.assert_allclose(
                np.sort(back.numpy(), axis=0), np.sort(np.asarray(expected[image_id], np.float32), axis=0), atol=slack
            )
            checked += 1
    assert checked == len(document["images"])
    # Random geometry too: each sample's own map takes its boxes back inside the source's.
    for _images, targets in one_epoch(
        address,
        pipeline="detection-train",
        fields=["bboxes", "bbox_labels", "image_id", "to_orig"],
        batch_format="torchvision",
        seed=7,
    ):
        for target in targets:
            source = np.asarray(expected[int(target["image_id"])], np.float32)
            slack = 2 * float(target["to_orig"][:2].abs().max()) + 0.01  # two resizes' rounding
            for box in boxes_to_orig(target["boxes"], target["to_orig"]).numpy():
                inside = (box[:2] >= source[:, :2] - slack) & (box[2:] <= source[:, 2:] + slack)
                assert inside.all(axis=1).any(), f"{box} is inside none of the file's boxes"


def test_the_torchvision_form_meets_the_detection_target_contract(coco):
    address, document = coco
    ids = {im["id"] for im in document["images"]}
    plain = one_epoch(address, pipeline="detection-train", fields=DETECTION + ["image_id"], seed=9)
    formed = one_epoch(  # (through the receiver process: its targets cross a process boundary)
        address,
        pipeline="detection-train",
        fields=DETECTION + ["image_id"],
        seed=9,
        batch_format="torchvision",
        receiver="process",
    )
    assert len(plain) == len(formed)
    classes = len(CATEGORIES)
    for batch, (images, targets) in zip(plain, formed):
        assert isinstance(images, list) and isinstance(targets, list) and len(images) == len(targets)
        for row, (image, target) in enumerate(zip(images, targets)):
            assert image.dtype == torch.float32 and image.shape == (3, *SIZE)
            assert 0 <= float(image.min()) and float(image.max()) <= 1
            torch.testing.assert_close(image, batch["images"][row].permute(2, 0, 1).float() / 255)
            assert {"boxes", "labels", "masks", "image_id", "area", "iscrowd"} <= set(target)
            boxes, labels, masks = target["boxes"], target["labels"], target["masks"]
            n = len(boxes)
            assert boxes.dtype == torch.float32 and boxes.shape == (n, 4)
            if n:
                assert (boxes[:, 0] >= 0).all() and (boxes[:, 2] <= SIZE[1]).all()
                assert (boxes[:, 1] >= 0).all() and (boxes[:, 3] <= SIZE[0]).all()
                assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()  # not degenerate
            assert labels.dtype == torch.int64 and labels.shape == (n,)
            assert ((labels >= 1) & (labels <= classes)).all()  # 0 is the background
            assert masks.dtype == torch.uint8 and masks.shape == (n, *SIZE)
            torch.testing.assert_close(masks, batch["masks"][row])
            assert target["image_id"].dtype == torch.int64 and target["image_id"].dim() == 0
            assert int(target["image_id"]) in ids
            assert target["area"].dtype == torch.float32 and target["area"].shape == (n,)
            torch.testing.assert_close(target["area"], (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]))
            assert target["iscrowd"].dtype == torch.int64 and target["iscrowd"].tolist() == [0] * n
            assert "mask" not in target and "label" not in target
    # A detection loss over the form trains: the batch is usable as is.
    model = torch.nn.Conv2d(3, 4, 3, padding=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    images, targets = formed[0]
    scores = model(torch.stack(images))
    loss = sum(
        ((scores[i, :, m.bool()].mean(dim=1) - t["labels"][k].float()) ** 2).sum()
        for i, t in enumerate(targets)
        for k, m in enumerate(t["masks"])
        if m.any()
    )
    loss.backward()
    optimizer.step()


def test_the_torchvision_form_asks_for_boxes(coco):
    address, _ = coco
    with pytest.raises(ValueError, match="batch_format='torchvision' needs the fields bboxes and bbox_labels"):
        RemoteLoader(address, fields=["mask"], batch_format="torchvision")
    with pytest.raises(ValueError, match="batch_format='coco'"):
        RemoteLoader(address, batch_format="coco")
