"""Labelled stripe-texture JPEG datasets, generated: for the demo, the tests and the benchmarks.

Each class is a texture a small CNN can learn (stripes at a class-specific angle and
frequency, over a smooth colour gradient, with noise), so a falling loss shows that
images and labels arrive intact. Images are real JPEGs encoded with OpenCV.
"""

from __future__ import annotations

import pathlib

import cv2
import numpy as np


def make_image(label: int, num_classes: int, rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """An RGB uint8 image whose class is visible at any crop and scale."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    angle = np.pi * label / num_classes + rng.normal(0, 0.05)
    period = 10 + 4 * (label % 3) + rng.uniform(-1, 1)
    phase = rng.uniform(0, 2 * np.pi)
    stripes = np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi / period + phase)
    base = rng.uniform(40, 215, 3)
    tilt = rng.uniform(-60, 60, 3)
    gradient = base[None, None, :] + tilt[None, None, :] * (xx / width)[..., None]
    image = gradient + 45 * stripes[..., None] + rng.normal(0, 6, (height, width, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def encode_jpeg(image: np.ndarray, quality: int = 90) -> bytes:
    ok, data = cv2.imencode(".jpg", cv2.cvtColor(image, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
    assert ok
    return data.tobytes()


def make_imagefolder(
    root: str | pathlib.Path,
    classes: list[str],
    per_class: int,
    size: tuple[int, int] = (96, 128),
    seed: int = 0,
    quality: int = 90,
    jitter: float = 0.0,
) -> pathlib.Path:
    """Writes ``root/<class>/<class>_<i>.jpg``; returns root.

    Args:
        size: (height, width) of the images; ``jitter`` varies each side by up to that fraction.
    """
    root = pathlib.Path(root)
    rng = np.random.default_rng(seed)
    for label, name in enumerate(classes):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h = int(size[0] * (1 + rng.uniform(-jitter, jitter)))
            w = int(size[1] * (1 + rng.uniform(-jitter, jitter)))
            image = make_image(label, len(classes), rng, h, w)
            (folder / f"{name}_{i:05d}.jpg").write_bytes(encode_jpeg(image, quality))
    return root
