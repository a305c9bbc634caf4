"""COCO-style detection datasets of coloured shapes, generated: for the detection demo, the tests
and the benchmarks.

Each image holds one to ``max_shapes`` shapes (squares, discs, triangles: one class and one
saturated colour each) over a dark noisy background. Every shape comes with what a COCO
``instances`` file holds (its box, its polygon, its category; ids 3, 7 and 11, so that the
mapping to contiguous labels shows) and one keypoint, its centre, as a ``person_keypoints``
file would. Because each class has its own colour, a test can check that a returned box
(or mask, or keypoint) still sits on its shape's pixels after any augmentation.
"""

from __future__ import annotations

import io
import json
import pathlib
import tarfile

import cv2
import numpy as np

from remoteloader.tools.textures import encode_jpeg

# (COCO category id, name, RGB colour)
CATEGORIES = ((3, "square", (230, 40, 40)), (7, "disc", (40, 220, 40)), (11, "triangle", (50, 80, 240)))


def make_sample(rng: np.random.Generator, height: int, width: int, max_shapes: int = 3):
    """An RGB image and its annotations: [(category id, polygon [(x, y)...], box (x, y, w, h))]."""
    image = rng.normal(40, 8, (height, width, 3)).clip(0, 255).astype(np.uint8)
    annotations = []
    occupied = np.zeros((height, width), bool)
    for _ in range(int(rng.integers(1, max_shapes + 1))):
        for _attempt in range(20):  # shapes do not overlap, so every box holds its own colour
            kind = int(rng.integers(len(CATEGORIES)))
            side = int(rng.integers(max(8, min(height, width) // 6), max(12, int(min(height, width) / 2.5))))
            x0 = int(rng.integers(0, width - side))
            y0 = int(rng.integers(0, height - side))
            if not occupied[y0 : y0 + side, x0 : x0 + side].any():
                break
        else:
            continue
        occupied[y0 : y0 + side, x0 : x0 + side] = True
        category, _, colour = CATEGORIES[kind]
        if kind == 0:
            polygon: list[tuple[float, float]] = [(x0, y0), (x0 + side, y0), (x0 + side, y0 + side), (x0, y0 + side)]
        elif kind == 1:
            r = side / 2
            cx, cy = x0 + r, y0 + r
            angles = np.linspace(0, 2 * np.pi, 24, endpoint=False)
            polygon = [(cx + r * np.cos(a), cy + r * np.sin(a)) for a in angles]
        else:
            polygon = [(x0 + side / 2, y0), (x0 + side, y0 + side), (x0, y0 + side)]
        points = np.asarray(polygon, np.float32)
        cv2.fillPoly(image, [np.round(points).astype(np.int32)], colour)
        x1, y1 = points.min(axis=0)
        x2, y2 = points.max(axis=0)
        annotations.append(
            (
                category,
                [(float(x), float(y)) for x, y in points],
                (float(x1), float(y1), float(x2 - x1), float(y2 - y1)),
            )
        )
    return image, annotations


def make_coco(
    root: str | pathlib.Path,
    count: int,
    size: tuple[int, int] = (128, 160),
    seed: int = 0,
    jitter: float = 0.25,
    max_shapes: int = 3,
    quality: int = 92,
) -> pathlib.Path:
    """Writes ``root/images/NNNNN.jpg`` and ``root/annotations.json`` (COCO instances with one
    keypoint per shape); returns the JSON's path."""
    root = pathlib.Path(root)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    images: list[dict] = []
    annotations: list[dict] = []
    for i in range(count):
        h = int(size[0] * (1 + rng.uniform(-jitter, jitter)))
        w = int(size[1] * (1 + rng.uniform(-jitter, jitter)))
        image, shapes = make_sample(rng, h, w, max_shapes)
        name = f"images/{i:05d}.jpg"
        (root / name).write_bytes(encode_jpeg(image, quality))
        images.append({"id": i + 1, "file_name": name, "height": h, "width": w})
        for category, polygon, (x, y, bw, bh) in shapes:
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": i + 1,
                    "category_id": category,
                    "bbox": [x, y, bw, bh],
                    "area": bw * bh,
                    "iscrowd": 0,
                    "segmentation": [[v for point in polygon for v in point]],
                    "keypoints": [x + bw / 2, y + bh / 2, 2],
                    "num_keypoints": 1,
                }
            )
    categories = [{"id": c, "name": n, "supercategory": "shape", "keypoints": ["centre"]} for c, n, _ in CATEGORIES]
    path = root / "annotations.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return path


def make_target_tar(
    path: str | pathlib.Path, count: int, size: tuple[int, int] = (128, 160), seed: int = 0
) -> pathlib.Path:
    """Writes one WebDataset tar of shapes: ``<key>.jpg``, ``<key>.json`` (bboxes, bbox_labels,
    keypoints, labels: the classes present) and ``<key>.mask.png`` (class per pixel), with
    ``classes.txt`` beside it (background, square, disc, triangle); returns its path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    label_of = {c: i + 1 for i, (c, _, _) in enumerate(CATEGORIES)}
    with tarfile.open(path, "w") as tar:
        for i in range(count):
            image, shapes = make_sample(rng, *size)
            mask = np.zeros(size, np.uint8)
            for category, polygon, _ in shapes:
                cv2.fillPoly(mask, [np.round(np.asarray(polygon)).astype(np.int32)], label_of[category])
            targets = {
                "bboxes": [[x, y, x + w, y + h] for _, _, (x, y, w, h) in shapes],
                "bbox_labels": [label_of[c] for c, _, _ in shapes],
                "keypoints": [[x + w / 2, y + h / 2, 2] for _, _, (x, y, w, h) in shapes],
                "labels": sorted({label_of[c] for c, _, _ in shapes}),
            }
            ok, png = cv2.imencode(".png", mask)
            assert ok
            for name, data in (
                (f"{i:05d}.jpg", encode_jpeg(image)),
                (f"{i:05d}.json", json.dumps(targets).encode()),
                (f"{i:05d}.mask.png", png.tobytes()),
            ):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (path.parent / "classes.txt").write_text("background\n" + "".join(f"{n}\n" for _, n, _ in CATEGORIES))
    return path
