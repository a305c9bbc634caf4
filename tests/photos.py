"""JPEGs for the decoding and pipeline tests, and spies on what was decoded.

Fixtures (``imagenet_like``, ``large_photos``, ``decoder``) are in ``conftest.py``.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from remoteloader.server import decode as dec
from remoteloader.server.pipelines import Pipeline

NOT_BUILT = "the native region decoder was not built (no compiler or libjpeg-turbo headers)"
needs_region_decoder = pytest.mark.skipif(dec._jpeg is None, reason=NOT_BUILT)


def smooth_photo(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Smooth photo-like content: per-channel gradients plus low-frequency blobs."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    image = np.zeros((height, width, 3), np.float32)
    for c in range(3):
        image[..., c] = (rng.uniform(60, 190) + rng.uniform(-50, 50) * xx / width
                         + rng.uniform(-50, 50) * yy / height)
    for _ in range(6):
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        r = rng.uniform(0.1, 0.3) * min(height, width)
        blob = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r))
        image += blob[..., None] * rng.uniform(-60, 60, 3)
    return np.clip(image, 0, 255).astype(np.uint8)


class DecodeSpy:
    """Records every decode, by whichever decoder the pipeline used.

    ``take(h, w)`` returns, per decode, the size of the whole image at the scale it was
    decoded at and the size actually decoded (the same unless only a region was).
    """

    def __init__(self, monkeypatch):
        self.calls: list[tuple[int | None, tuple]] = []  # (region scale denominator or None, decoded shape)
        real = dec.decode

        def spy(data, fmt, min_height=0, min_width=0, height=0, width=0):
            image = real(data, fmt, min_height, min_width, height, width)
            self.calls.append((None, image.shape[:2]))
            return image

        monkeypatch.setattr(dec, "decode", spy)
        native = dec._jpeg
        if native is not None:
            def region(data, denom, x, y, w, h, out, *limits):
                column = native.decode_region(data, denom, x, y, w, h, out, *limits)
                self.calls.append((denom, (h, w)))
                return column

            monkeypatch.setattr(dec, "_jpeg", types.SimpleNamespace(
                decode_region=region, LIBJPEG_TURBO_VERSION_NUMBER=native.LIBJPEG_TURBO_VERSION_NUMBER))

    def take(self, height: int, width: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        calls, self.calls = self.calls, []
        return [(shape if denom is None else (math.ceil(height / denom), math.ceil(width / denom)), shape)
                for denom, shape in calls]


def crop_geometry(pipeline: Pipeline, seed: int, height: int, width: int) -> tuple[int, int, int, int]:
    """The crop (x1, y1, x2, y2) the pipeline's RandomResizedCrop picks for a seed on an image size."""
    pipeline.reseed(seed)
    params = pipeline._crop.get_params()
    params["shape"] = (height, width, 3)
    return tuple(pipeline._crop.get_params_dependent_on_data(params, {})["crop_coords"])
