"""The server's pipelines (``server/pipelines.py``): fused decode + crop against decode then
albumentations, a fit then a scale resized once, decoding no larger than the first resize,
custom twins of the presets, and per-sample, per-transform determinism. In process, no server.
"""

from __future__ import annotations

import json
import math

import albumentations as A
import cv2
import numpy as np
import pytest
from photos import DecodeSpy, crop_geometry

from remoteloader.server import decode as dec
from remoteloader.server.pipelines import Pipeline, PipelineError, PipelineSpec
from remoteloader.tools.textures import make_image

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("name", ["train", "eval"])
def test_fused_equals_plain_on_imagenet_sized_images(name, decoder, imagenet_like, monkeypatch):
    pipeline = Pipeline(PipelineSpec(name, 224, 224))
    spy = DecodeSpy(monkeypatch)
    for data in imagenet_like:
        _, h, w = dec.read_size(data, 10**8)
        for seed in range(12):
            fused = pipeline(data, seed, fused=True, verified=True)
            scale, decoded = spy.take(h, w)[0]
            # No reduced scale can keep 224 on a side of <= 500 / 2: every decode is full size.
            assert scale == (h, w)
            if name == "train" and decoder == "region":  # only the crop's pixels were decoded
                x1, y1, x2, y2 = crop_geometry(pipeline, seed, h, w)
                assert decoded == (y2 - y1, x2 - x1)
            else:
                assert decoded == (h, w)
            plain = pipeline(data, seed, fused=False)
            assert spy.take(h, w)[0][1] == (h, w)  # the plain path decodes the whole image
            assert fused.shape == (224, 224, 3) and fused.dtype == np.uint8
            assert np.array_equal(fused, plain), f"{name} seed {seed} on {w}x{h}: fused != plain"


def test_a_first_epoch_decodes_only_the_crops_region_as_later_epochs_do(decoder, imagenet_like, monkeypatch):
    """A file not yet known to decode (verified=False: its first epoch on a server) is not decoded
    whole: its crop's region is, as in later epochs (the rest of the file is read, not
    transformed: decode.decode_crop(whole=True)), with the same pixels."""
    pipeline = Pipeline(PipelineSpec("train", 224, 224))
    spy = DecodeSpy(monkeypatch)
    for data in imagenet_like[:4]:
        _, h, w = dec.read_size(data, 10**8)
        for seed in range(6):
            first = pipeline(data, seed, verified=False)
            decoded = [shape for _, shape in spy.take(h, w)]
            assert np.array_equal(first, pipeline(data, seed, verified=True)), f"seed {seed}"
            assert [shape for _, shape in spy.take(h, w)] == decoded
            x1, y1, x2, y2 = crop_geometry(pipeline, seed, h, w)
            assert decoded == ([(y2 - y1, x2 - x1)] if decoder == "region" else [(h, w)]), f"seed {seed}"


@pytest.mark.parametrize("name", ["train", "eval"])
def test_fused_on_large_photos_is_within_rounding_and_decodes_smaller(name, decoder, large_photos, monkeypatch):
    pipeline = Pipeline(PipelineSpec(name, 224, 224))
    spy = DecodeSpy(monkeypatch)
    reduced = 0
    for data, h, w in large_photos:
        for seed in range(5):
            fused = pipeline(data, seed, fused=True, verified=True)
            calls = spy.take(h, w)
            assert len(calls) == 1
            shape, decoded = calls[0]
            factor = math.ceil(h / shape[0])
            assert shape == (math.ceil(h / factor), math.ceil(w / factor)), (shape, factor)
            if name == "train":
                x1, y1, x2, y2 = crop_geometry(pipeline, seed, h, w)
                # The decode keeps the crop at least the output size.
                assert (y2 - y1) * shape[0] / h >= 224 - 1 and (x2 - x1) * shape[1] / w >= 224 - 1
                assert factor == dec.dct_factor(h, w, math.ceil(h * 224 / (y2 - y1)),
                                                math.ceil(w * 224 / (x2 - x1)))
                if decoder == "region":  # the crop alone, at that scale (to a pixel of rounding)
                    assert abs(decoded[0] - (y2 - y1) / factor) <= 1 and abs(decoded[1] - (x2 - x1) / factor) <= 1
            else:  # eval covers 256 on both sides
                assert min(shape) >= 256
            reduced += factor > 1
            plain = pipeline(data, seed, fused=False)
            assert spy.take(h, w)[0][1] == (h, w)  # the plain path decodes at full size
            assert fused.shape == plain.shape == (224, 224, 3)
            diff = np.abs(fused.astype(np.float64) - plain.astype(np.float64))
            corr = np.corrcoef(fused.ravel().astype(np.float64), plain.ravel().astype(np.float64))[0, 1]
            assert diff.mean() < 3, f"{name} seed {seed}: mean |fused - plain| = {diff.mean():.2f}"
            assert corr > 0.99, f"{name} seed {seed}: correlation {corr:.4f} (a different crop?)"
    assert reduced == 15, f"only {reduced} of 15 large-photo decodes used a reduced DCT scale"


@pytest.mark.parametrize("name", ["detection-train", "segmentation-train"])
def test_a_fit_then_a_scale_resize_once_and_move_targets_as_albumentations(name, monkeypatch):
    """The detection and segmentation training presets start with a fit and a RandomScale: the
    image is resized once, to the size the two give, and the boxes, points and mask are
    albumentations' own result (the plain path's, which resizes twice)."""
    import cv2

    pipeline = Pipeline(PipelineSpec(name, 64, 64, fields=("bboxes", "bbox_labels", "keypoints", "mask")))
    resizes = []
    real_resize = cv2.resize

    def counting(src, *args, **kwargs):
        resizes.append(src.ndim == 3)
        return real_resize(src, *args, **kwargs)

    monkeypatch.setattr(cv2, "resize", counting)
    rng = np.random.default_rng(7)
    counts = {True: 0, False: 0}  # image resizes, fused and plain
    for seed, (h, w) in enumerate([(48, 80), (90, 60), (64, 64), (33, 101), (120, 77), (50, 50)] * 3):
        image = make_image(0, 5, rng, h, w)
        arrays = {
            "bboxes": np.asarray([[2, 3, w // 2, h // 2], [w // 3, h // 4, w - 1, h - 2]], np.float32),
            "bbox_labels": np.asarray([4, 9], np.int64),
            "keypoints": np.asarray([[5, 6, 2], [w - 3, h - 4, 1]], np.float32),
        }
        mask = rng.integers(0, 5, (h, w), dtype=np.uint8)
        results = {}
        for fused in (True, False):
            resizes.clear()
            results[fused] = pipeline.with_targets(image, seed, arrays, lambda *_, m=mask: m, fused=fused)
            counts[fused] += sum(resizes)
            assert sum(resizes) <= 1 or not fused, f"seed {seed}: {sum(resizes)} image resizes fused"
        (pixels, targets, out_mask), (plain, plain_targets, plain_mask) = results[True], results[False]
        assert pixels.shape == plain.shape == (64, 64, 3)
        assert targets.keys() == plain_targets.keys() == {"bboxes", "bbox_labels", "keypoints"}
        for field, value in targets.items():
            assert np.array_equal(value, plain_targets[field]), f"seed {seed}: {field} differ"
        assert np.array_equal(out_mask, plain_mask)
        diff = np.abs(pixels.astype(np.float64) - plain.astype(np.float64))
        corr = np.corrcoef(pixels.ravel().astype(np.float64), plain.ravel().astype(np.float64))[0, 1]
        # Resampling once instead of twice: within rounding on a texture whose neighbours differ by ~17.
        assert diff.mean() < 5 and corr > 0.99, f"seed {seed}: mean |fused - plain| {diff.mean():.2f}, corr {corr:.4f}"
    # Fused, at most one resize per image; plain, the fit's too (where the image does not fit already).
    assert counts[True] <= 18 < counts[False], counts


def test_first_resize_decodes_no_larger_than_needed(large_photos, monkeypatch):
    """A custom pipeline starting with SmallestMaxSize or Resize also decodes at a reduced scale."""
    data, h, w = large_photos[0]  # 1500 x 2000
    spy = DecodeSpy(monkeypatch)
    cases = [
        (A.Compose([A.SmallestMaxSize(max_size=200), A.CenterCrop(64, 64)]), (200, math.ceil(2000 * 200 / 1500))),
        (A.Compose([A.Resize(100, 300)]), (100, 300)),
    ]
    for compose, (min_h, min_w) in cases:
        size = compose.transforms[-1].height, compose.transforms[-1].width
        spec = PipelineSpec("custom", *size, json.dumps(A.to_dict(compose)))
        pipeline = Pipeline(spec, allow_custom=True)
        fused = pipeline(data, 1)
        shape = spy.take(h, w)[0][1]
        factor = dec.dct_factor(h, w, min_h, min_w)
        assert factor > 1
        assert shape == (math.ceil(h / factor), math.ceil(w / factor))
        plain = pipeline(data, 1, fused=False)
        assert spy.take(h, w)[0][1] == (h, w)
        assert np.abs(fused.astype(float) - plain.astype(float)).mean() < 3


@pytest.mark.parametrize("name", ["train", "eval"])
def test_custom_twin_of_a_preset_gives_identical_pixels(name, imagenet_like, large_photos):
    preset = Pipeline(PipelineSpec(name, 96, 80))
    document = json.dumps(A.to_dict(Pipeline(PipelineSpec(name, 96, 80)).compose))
    twin = Pipeline(PipelineSpec("custom", 96, 80, document), allow_custom=True)
    twin.check_output()
    with pytest.raises(PipelineError, match="allow-custom-pipelines"):
        Pipeline(PipelineSpec("custom", 96, 80, document), allow_custom=False)
    for data in imagenet_like[:2] + [large_photos[0][0]]:
        for seed in (0, 1, 2**63 + 5, 2**64 - 1):
            for fused in (True, False):
                a, b = preset(data, seed, fused=fused), twin(data, seed, fused=fused)
                assert np.array_equal(a, b), f"{name} seed {seed} fused={fused}: custom twin differs"


def test_fused_crop_follows_area_for_downscale(decoder, imagenet_like):
    """RandomResizedCrop(area_for_downscale="image") resizes with INTER_AREA when it shrinks, fused too."""
    # 200 px: no DCT scale can keep it from <= 500 px photos, so fused and plain agree to the bit.
    compose = A.Compose([A.RandomResizedCrop(size=(200, 200), area_for_downscale="image"), A.HorizontalFlip()])
    pipeline = Pipeline(PipelineSpec("custom", 200, 200, json.dumps(A.to_dict(compose))), allow_custom=True)
    assert pipeline._crop is not None  # fused
    linear = Pipeline(PipelineSpec("train", 200, 200))  # the same crops and flips, resized INTER_LINEAR
    shrunk = {True: 0, False: 0}
    for data in imagenet_like:
        _, h, w = dec.read_size(data, 10**8)
        for seed in range(8):
            fused = pipeline(data, seed, verified=True)
            assert np.array_equal(fused, pipeline(data, seed, fused=False)), f"seed {seed}"
            x1, y1, x2, y2 = crop_geometry(pipeline, seed, h, w)
            downscale = y2 - y1 > 200 or x2 - x1 > 200
            assert np.array_equal(fused, linear(data, seed)) != downscale, f"seed {seed}: crop {x2 - x1}x{y2 - y1}"
            shrunk[downscale] += 1
    assert min(shrunk.values()) >= 3, shrunk  # both cases were seen


def test_outer_compose_with_p_below_one_is_refused():
    document = json.dumps(A.to_dict(A.Compose([A.RandomResizedCrop(size=(32, 32))], p=0.5)))
    with pytest.raises(PipelineError, match="outer Compose has p=0.5"):
        Pipeline(PipelineSpec("custom", 32, 32, document), allow_custom=True)


def test_per_sample_determinism(imagenet_like):
    data = imagenet_like[0]
    first = Pipeline(PipelineSpec("train", 64, 64))
    second = Pipeline(PipelineSpec("train", 64, 64))  # another process/server: a fresh pipeline
    outputs = {}
    for seed in (0, 1, 2, 12345, 2**64 - 1):
        a = first(data, seed)
        other = imagenet_like[1]
        first(other, seed + 1)  # whatever ran before does not matter
        assert np.array_equal(a, first(data, seed))
        assert np.array_equal(a, second(data, seed))
        outputs[seed] = a
    values = list(outputs.values())
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            assert not np.array_equal(values[i], values[j]), "two seeds gave the same pixels"


def test_nested_composes_that_may_skip_are_deterministic_per_seed():
    """A nested Compose or Sequential with p < 1 draws whether it runs: its generators are
    seeded per sample like a transform's (only one with p=1, whose draw cannot fail, is not)."""
    document = json.dumps(
        A.to_dict(
            A.Compose(
                [
                    A.Resize(32, 32),
                    A.Sequential([A.InvertImg(p=1)], p=0.5),
                    A.Compose([A.VerticalFlip(p=1)], p=0.5),
                ]
            )
        )
    )
    image = (np.arange(40 * 48 * 3) % 251).astype(np.uint8).reshape(40, 48, 3)
    data = cv2.imencode(".png", image)[1].tobytes()
    plain = cv2.resize(cv2.cvtColor(image, cv2.COLOR_BGR2RGB), (32, 32), interpolation=cv2.INTER_LINEAR)
    servers = [Pipeline(PipelineSpec("custom", 32, 32, document), allow_custom=True) for _ in range(2)]
    outcomes = {
        (inverted, flipped): (255 - plain if inverted else plain)[::-1 if flipped else 1]
        for inverted in (False, True)
        for flipped in (False, True)
    }
    seen = set()
    for seed in range(24):
        out = servers[0](data, seed)
        assert np.array_equal(out, servers[1](data, seed)), f"seed {seed}: two servers disagree"
        (outcome,) = [k for k, expected in outcomes.items() if np.array_equal(out, expected)]
        seen.add(outcome)
    assert seen == set(outcomes), f"every combination of the two nested composes running: {seen}"


def test_flip_is_independent_of_crop_scale(imagenet_like):
    spec = PipelineSpec("train", 32, 32)
    pipeline = Pipeline(spec)
    flips = [n for n in pipeline._nodes if isinstance(n, A.HorizontalFlip)]
    assert len(flips) == 1 and pipeline._crop is not None
    flip = flips[0]
    h, w = 375, 500
    scales, flipped = [], []
    for seed in range(2000):
        x1, y1, x2, y2 = crop_geometry(pipeline, seed, h, w)
        scales.append((x2 - x1) * (y2 - y1) / (h * w))
        pipeline.reseed(seed)
        flipped.append(flip.py_random.random() < flip.p)  # what HorizontalFlip.should_apply draws
    scales, flipped = np.asarray(scales), np.asarray(flipped, dtype=np.float64)
    assert abs(flipped.mean() - 0.5) < 0.05, f"flip rate {flipped.mean():.3f}"
    corr = np.corrcoef(scales, flipped)[0, 1]
    assert abs(corr) < 0.1, f"flip correlated with crop scale: corr={corr:.3f}"
    assert scales.min() < 0.15 and scales.max() > 0.9  # the crops do vary

    # The prediction is what the pipeline really does: a crop-only twin (same stream
    # position for the crop) gives the same crop, mirrored exactly when the flip fires.
    crop_only = A.Compose([pipeline.compose.transforms[0]])
    twin = Pipeline(PipelineSpec("custom", 32, 32, json.dumps(A.to_dict(crop_only))), allow_custom=True)
    data = imagenet_like[0]
    seen = set()
    for seed in range(40):
        out, base = pipeline(data, seed), twin(data, seed)
        expected = base[:, ::-1] if flipped[seed] else base
        assert np.array_equal(out, expected), f"seed {seed}: flip prediction {bool(flipped[seed])} is wrong"
        seen.add(bool(flipped[seed]))
    assert seen == {True, False}
