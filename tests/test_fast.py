"""Fast servers and a lean wire: fused decode+crop, per-transform seeds, the worker pool,
the RAM cache, the synthetic transport mode and --max-rate.

In-process tests drive ``Pipeline`` and ``decode`` directly (a handful of large images);
end-to-end tests use one module-wide set of real servers on 127.0.0.1:

    workers   --workers 2 on DATA (image_size 16: the whole order is one chunk of many tasks)
    cached    --cache-bytes 10 MB on CACHED (a copy of DATA whose files a test deletes)
    plain     no cache and --region-decode false, on CACHED too (the reference for the cached
              server's pixels)
    small     a cache too small for SMALL (another copy of DATA, also deleted)
    rate      --max-rate 100 on RATE (150 samples)
    synthetic --synthetic 50 and no --data (started by hand: Cluster always passes --data)
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import pathlib
import shutil
import signal
import struct
import subprocess
import sys
import time
import types

import albumentations as A
import cv2
import numpy as np
import pytest

from remoteloader.client import RemoteLoader
from remoteloader.server import decode as dec
from remoteloader.server.pipelines import Pipeline, PipelineError, PipelineSpec
from remoteloader.server.seeds import sample_seeds
from remoteloader.tools.textures import encode_jpeg, make_image, make_imagefolder

pytestmark = pytest.mark.timeout(120)
NOT_BUILT = "the native region decoder was not built (no compiler or libjpeg-turbo headers)"
needs_region_decoder = pytest.mark.skipif(dec._jpeg is None, reason=NOT_BUILT)

CLASSES = ["ant", "bee", "cat"]
PER_CLASS = 12  # 36 samples
SIZE = 16
SEED = 7
CACHE_BYTES = 10_000_000
RATE, RATE_SAMPLES = 100, 150
SYNTHETIC = 50


# ---- in-process: pipelines and decoding --------------------------------------------------


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


@pytest.fixture(scope="module")
def imagenet_like() -> list[bytes]:
    """ImageNet-sized JPEGs, landscape and portrait (with odd sides)."""
    rng = np.random.default_rng(11)
    shapes = [(375, 500), (500, 375), (333, 500), (375, 499)]
    return [encode_jpeg(make_image(i, 5, rng, h, w), 90) for i, (h, w) in enumerate(shapes)]


@pytest.fixture(scope="module")
def large_photos() -> list[tuple[bytes, int, int]]:
    rng = np.random.default_rng(3)
    photos = []
    for h, w in ((1500, 2000), (2000, 1500), (1501, 2003)):
        photos.append((encode_jpeg(smooth_photo(rng, h, w), 90), h, w))
    return photos


@pytest.fixture(params=["region", "whole"])
def decoder(request, monkeypatch) -> str:
    """Runs a test with the native region decoder (when built) and with whole-image decoding."""
    if request.param == "region":
        if dec._jpeg is None:
            pytest.skip(NOT_BUILT)
    else:
        monkeypatch.setattr(dec, "_jpeg", None)
    return request.param


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


def jpeg_variants() -> dict[str, tuple[bytes, int, int]]:
    """JPEGs in the layouts photos come in: chroma subsamplings, grey, progressive, restart markers."""
    rng = np.random.default_rng(5)
    image = make_image(0, 5, rng, 301, 413)  # odd sides: partial MCUs at the right and bottom
    flags = {
        "420": [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420],
        "422": [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_422],
        "444": [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444],
        "411": [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_411],
        "440": [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_440],
        "progressive": [cv2.IMWRITE_JPEG_PROGRESSIVE, 1],
        "restarts": [cv2.IMWRITE_JPEG_RST_INTERVAL, 3],
    }
    out = {}
    for name, extra in flags.items():
        ok, data = cv2.imencode(".jpg", image[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 90] + extra)
        out[name] = (data.tobytes(), 301, 413)
    ok, data = cv2.imencode(".jpg", image[..., 0], [cv2.IMWRITE_JPEG_QUALITY, 90])
    out["grey"] = (data.tobytes(), 301, 413)
    ok, data = cv2.imencode(".jpg", image[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 90, cv2.IMWRITE_JPEG_RST_INTERVAL, 1])
    out["restart-per-mcu"] = (data.tobytes(), 301, 413)  # another encoder's: cut as pack's are
    if dec._jpeg is not None:  # as `remoteloader pack` rewrites them: cut to the crop's MCUs
        for name in ("420", "422", "444", "411", "440", "progressive", "grey"):
            out[f"{name} packed"] = (dec._jpeg.transcode(out[name][0]), 301, 413)
    return out


def entropy_segments(data: bytes) -> tuple[int, list[tuple[int, int]]]:
    """Where a single-scan JPEG's entropy-coded data starts, and its segments' (start, end)
    offsets between restart markers."""
    sos = data.index(b"\xff\xda")
    start = sos + 2 + struct.unpack(">H", data[sos + 2:sos + 4])[0]
    segments, i = [], start
    while True:
        j = data.index(b"\xff", i)
        while data[j + 1] in (0x00, 0xFF):  # a stuffed 0xFF byte, or fill before a marker
            j = data.index(b"\xff", j + 1 + (data[j + 1] == 0x00))
        segments.append((i, j))
        if not 0xD0 <= data[j + 1] <= 0xD7:
            return start, segments
        i = j + 2


def random_boxes(rng: np.random.Generator, height: int, width: int, n: int):
    yield 0, 0, width, height  # the whole image
    yield width - 1, height - 1, width, height  # the last pixel
    for _ in range(n):
        x1, x2 = sorted(rng.choice(width + 1, 2, replace=False))
        y1, y2 = sorted(rng.choice(height + 1, 2, replace=False))
        yield int(x1), int(y1), int(x2), int(y2)


@needs_region_decoder
def test_region_decoder_gives_the_pixels_of_a_whole_decode(monkeypatch):
    """decode_crop: the native region decoder and whole-image decoding agree to the bit."""
    rng = np.random.default_rng(0)
    for name, (data, h, w) in jpeg_variants().items():
        for box in random_boxes(rng, h, w, 12):
            for min_h, min_w in ((0, 0), (h // 2, w // 2), (h // 4, 1), (1, 1)):  # scales 1, 2, 4, 8
                region = dec.decode_crop(data, "jpeg", h, w, box, min_h, min_w, native=True)
                with monkeypatch.context() as m:
                    m.setattr(dec, "_jpeg", None)
                    whole = dec.decode_crop(data, "jpeg", h, w, box, min_h, min_w)
                assert region.shape == whole.shape and region.dtype == np.uint8, (name, box, min_h)
                assert np.array_equal(region, whole), f"{name}: box {box} at min {min_h}x{min_w}"


@needs_region_decoder
def test_packed_jpegs_keep_every_pixel_at_every_scale():
    """_jpeg.transcode, what `remoteloader pack` writes: other bytes (baseline, one restart
    marker per MCU), the same pixels, decoded whole at full size and at 1/2, 1/4, 1/8."""
    variants = jpeg_variants()
    for name in ("420", "422", "444", "411", "440", "progressive", "grey"):
        original, packed = variants[name][0], variants[f"{name} packed"][0]
        assert dec._frame(packed)[0] == 0xC0, name  # baseline, also from progressive
        assert b"\xff\xdd\x00\x04\x00\x01" in packed[:packed.index(b"\xff\xda")], f"{name}: no DRI of 1 MCU"
        assert dec._jpeg.cuts(packed) and not dec._jpeg.cuts(original), name  # what the server's log counts
        _, segments = entropy_segments(packed)
        mcus = {"444": (8, 8), "grey": (8, 8), "420": (16, 16), "422": (16, 8), "411": (32, 8), "440": (8, 16)}
        mcu = mcus.get(name, (16, 16))
        assert len(segments) == math.ceil(413 / mcu[0]) * math.ceil(301 / mcu[1]), name
        for min_h, min_w in ((0, 0), (150, 200), (75, 1), (1, 1)):
            whole = dec.decode(original, "jpeg", min_h, min_w, 301, 413)
            assert np.array_equal(dec.decode(packed, "jpeg", min_h, min_w, 301, 413), whole), (name, min_h)
    with pytest.raises(ValueError, match="(?i)corrupt|premature|not a jpeg"):
        dec._jpeg.transcode(variants["420"][0][:5000])  # damage is refused (pack copies such files)
    with pytest.raises(ValueError):
        dec._jpeg.transcode(b"\x89PNG\r\n\x1a\n" + bytes(100))


def coded_difference(diff: int) -> str:
    """A difference (DC or lossless prediction) as the hand-made JPEGs here code it: its size
    category as a fixed 4-bit code, then its bits (one's complement when negative)."""
    size = abs(diff).bit_length()
    return f"{size:04b}" + (f"{diff if diff > 0 else diff + (1 << size) - 1:0{size}b}" if size else "")


def entropy_coded(bits: str) -> bytes:
    """A scan's entropy-coded bytes: the bits padded with ones to a byte, 0xFF stuffed with 0x00."""
    bits += "1" * (-len(bits) % 8)
    return b"".join(bytes([b, 0]) if b == 0xFF else bytes([b]) for b in (int(bits[i:i + 8], 2)
                                                                          for i in range(0, len(bits), 8)))


def dc_only_grey_jpeg(width: int, height: int, dcs: list[int], app: bytes = b"") -> bytes:
    """A baseline grey JPEG whose 8x8 blocks hold only the DC values ``dcs`` (raster order),
    which a decoder takes even beyond what an encoder may write (|DC| > 2047)."""
    def segment(marker: int, payload: bytes) -> bytes:
        return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload

    out = b"\xff\xd8" + app + segment(0xDB, bytes(1) + bytes([1] * 64))
    out += segment(0xC0, bytes([8]) + struct.pack(">HH", height, width) + bytes([1, 1, 0x11, 0]))
    counts = [0] * 16
    counts[3] = 12  # DC categories 0..11 as 4-bit codes
    out += segment(0xC4, bytes([0x00]) + bytes(counts) + bytes(range(12)))
    out += segment(0xC4, bytes([0x10, 1]) + bytes(15) + bytes([0]))  # AC: end-of-block is "0"
    out += segment(0xDA, bytes([1, 1, 0x00, 0, 63, 0]))
    bits, previous = "", 0
    for dc in dcs:
        bits += coded_difference(dc - previous) + "0"  # then the end of the block
        previous = dc
    return out + entropy_coded(bits) + b"\xff\xd9"


@needs_region_decoder
def test_transcode_refuses_what_it_cannot_write_and_grows_its_output():
    """A file libjpeg decodes but cannot re-encode (a DC value over 11 bits), with a large
    APP1 before it, is refused with libjpeg's message (this once freed a buffer twice); an
    output much larger than its input (here markers added to tiny blocks) comes back whole."""
    odd = dc_only_grey_jpeg(16, 8, [2000, 4000], app=b"\xff\xe1" + struct.pack(">H", 8002) + b"Exif\0\0" + bytes(7994))
    assert dec.decode(odd, "jpeg").shape == (8, 16, 3)  # a decoder takes it
    for _ in range(3):
        with pytest.raises(ValueError, match="DCT coefficient out of range"):
            dec._jpeg.transcode(odd)
    rng = np.random.default_rng(1)
    grey = dc_only_grey_jpeg(1024, 1024, rng.integers(-900, 900, 128 * 128).tolist())
    packed = dec._jpeg.transcode(grey)
    assert len(packed) > 2 * len(grey)  # a restart marker per block: past the first buffer (input + 4 KB)
    assert np.array_equal(dec.decode(packed, "jpeg"), dec.decode(grey, "jpeg"))
    first = encode_jpeg(make_image(0, 5, rng, 40, 48), 90)  # then an MPF part, which a rewrite would drop:
    assert dec._jpeg.transcode(first + encode_jpeg(make_image(1, 5, rng, 40, 48), 90)) is None  # kept as it is
    assert dec._jpeg.transcode(first + bytes(32)) is not None  # padding is not worth keeping a file for


@needs_region_decoder
def test_region_decoder_reads_only_the_crops_mcus_of_a_jpeg_with_a_restart_per_mcu():
    """With a restart marker after every MCU, the rows above a crop and the columns beside it are
    not even entropy-decoded (most of a decode's time): damage there cannot be seen, while a
    whole decode, and the region decoder on the same file without the markers, refuse it."""
    for name, mcu in (("420 packed", 16), ("444 packed", 8), ("grey packed", 8), ("restart-per-mcu", 16)):
        data, h, w = jpeg_variants()[name]
        start, segments = entropy_segments(data)
        cols = math.ceil(w / mcu)
        box = (3 * mcu + 5, 2 * mcu + 3, 7 * mcu + 1, 5 * mcu)  # MCU columns 3..6, rows 2..4
        clean = np.empty((box[3] - box[1], box[2] - box[0], 3), np.uint8)
        dec._jpeg.decode_region(data, 1, box[0], box[1], box[2] - box[0], box[3] - box[1], clean)
        whole = dec.decode(data, "jpeg", 0, 0, h, w)
        assert np.array_equal(clean, whole[box[1]:box[3], box[0]:box[2]]), name
        # Empty the segments of the first MCU and of MCUs left and right of the crop on its rows.
        damaged = bytearray(data)
        for index in sorted((0, 2 * cols, 3 * cols + 2, 4 * cols + 9, 4 * cols + cols - 1), reverse=True):
            begin, end = segments[index]
            del damaged[begin:end]
        damaged = bytes(damaged)
        with pytest.raises(dec.DecodeError, match="(?i)corrupt|premature"):
            dec.decode(damaged, "jpeg", 0, 0, h, w)
        region = np.empty_like(clean)
        dec._jpeg.decode_region(damaged, 1, box[0], box[1], box[2] - box[0], box[3] - box[1], region)
        assert np.array_equal(region, clean), name
        for denom in (2, 8):  # at reduced scales too: an MCU is mcu / denom pixels there
            x, y = box[0] // denom, box[1] // denom
            clean_small, small = (np.empty((mcu // denom, mcu // denom, 3), np.uint8) for _ in range(2))
            dec._jpeg.decode_region(data, denom, x, y, mcu // denom, mcu // denom, clean_small)
            dec._jpeg.decode_region(damaged, denom, x, y, mcu // denom, mcu // denom, small)
            assert np.array_equal(small, clean_small), (name, denom)
    # Not every MCU of a file with markers every 3 MCUs stands alone: it is read down to the crop.
    data, h, w = jpeg_variants()["restarts"]
    start, segments = entropy_segments(data)
    begin, end = segments[0]
    with pytest.raises(ValueError):
        dec._jpeg.decode_region(data[:begin] + data[end:], 1, 100, 100, 16, 16, np.empty((16, 16, 3), np.uint8))


def test_whole_decode_refuses_damage_the_region_decoder_cannot_see(decoder):
    """Why the server region-decodes only files that have decoded whole: damage below a crop
    (here a cut file) is invisible to the region decoder, while a whole decode refuses it."""
    data, h, w = jpeg_variants()["420"]
    top = (0, 0, 16, 16)
    for cut in (len(data) // 2, len(data) - 2):
        with pytest.raises(dec.DecodeError, match="(?i)corrupt|premature"):
            dec.decode_crop(data[:cut], "jpeg", h, w, top, 0, 0)  # native=False: whole
        if decoder == "region":
            assert dec.decode_crop(data[:cut], "jpeg", h, w, top, 0, 0, native=True).shape == (16, 16, 3)
    progressive = jpeg_variants()["progressive"][0]  # read to its end before any row: refused either way
    with pytest.raises(dec.DecodeError):
        dec.decode_crop(progressive[:len(progressive) // 2], "jpeg", h, w, top, 0, 0, native=True)


def test_region_decoder_leaves_cmyk_to_the_whole_decode(monkeypatch):
    """CMYK JPEGs (which the region decoder refuses) give the same pixels by either decoder."""
    from PIL import Image
    buf = io.BytesIO()
    image = make_image(0, 5, np.random.default_rng(1), 120, 160)
    Image.fromarray(image).convert("CMYK").save(buf, "JPEG", quality=95)
    data = buf.getvalue()
    for min_h, min_w in ((0, 0), (60, 80)):
        region = dec.decode_crop(data, "jpeg", 120, 160, (10, 20, 110, 100), min_h, min_w, native=True)
        monkeypatch.setattr(dec, "_jpeg", None)
        assert np.array_equal(region, dec.decode_crop(data, "jpeg", 120, 160, (10, 20, 110, 100), min_h, min_w))
        monkeypatch.undo()
    opencv = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB)[20:100, 10:110]
    assert region.shape == (40, 50, 3)
    full = dec.decode_crop(data, "jpeg", 120, 160, (10, 20, 110, 100), 0, 0, native=True)
    assert np.abs(full.astype(float) - opencv).mean() < 3  # RGB, not inverted or raw CMYK


def lossless_jpeg(image: np.ndarray) -> bytes:
    """A lossless JPEG (SOF3, predictor 1, one Huffman table of fixed 4-bit codes), as DICOM has them."""
    h, w, _ = image.shape
    out = bytearray(b"\xff\xd8")
    out += b"\xff\xc3" + struct.pack(">HBHHB", 17, 8, h, w, 3) + b"".join(bytes([c, 0x11, 0]) for c in (1, 2, 3))
    counts = [0] * 16
    counts[3] = 9  # nine categories, codes 0000..1000
    out += b"\xff\xc4" + struct.pack(">HB", 28, 0) + bytes(counts) + bytes(range(9))
    out += b"\xff\xda" + struct.pack(">HB", 12, 3) + bytes([1, 0, 2, 0, 3, 0, 1, 0, 0])
    bits = []
    pixels = image.astype(int)
    for y in range(h):
        for x in range(w):
            for c in range(3):
                above_or_left = 128 if x == y == 0 else pixels[y, x - 1, c] if y == 0 or x > 0 else pixels[y - 1, x, c]
                bits.append(coded_difference(int(pixels[y, x, c] - above_or_left)))
    return bytes(out + entropy_coded("".join(bits)) + b"\xff\xd9")


def test_lossless_jpeg_is_decoded_at_full_size_and_exactly():
    """simplejpeg crashed (SIGSEGV) decoding a lossless JPEG at a reduced scale."""
    image = make_image(0, 5, np.random.default_rng(4), 48, 64)
    data = lossless_jpeg(image)
    assert dec.read_size(data, 10**6) == ("jpeg-full", 48, 64)
    assert np.array_equal(dec.decode(data, "jpeg-full", 8, 8, 48, 64), image)  # lossless: every bit
    # Segments libjpeg skips without a word, which must not hide the frame: an empty APP2 (its
    # length field says 0), a COM of length 1, fill bytes, a large APP1.
    for extra in (b"\xff\xe2\x00\x00", b"\xff\xfe\x00\x01", b"\xff" * 5, b"\xff\xe1\xff\xff" + bytes(65533)):
        odd = data[:2] + extra + data[2:]
        assert dec.read_size(odd, 10**6) == ("jpeg-full", 48, 64), extra[:4]
        assert np.array_equal(dec.decode(odd, "jpeg-full", 8, 8, 48, 64), image)
    # Whatever hides the frame marker (here, thousands of segments) means full size: safe for any JPEG.
    hidden = data[:2] + b"\xff\xfe\x00\x02" * 5000 + data[2:]
    assert dec.read_size(hidden, 10**6)[0] == "jpeg-full"
    baseline = encode_jpeg(image, 90)
    assert dec.read_size(baseline[:2] + b"\xff\xfe\x00\x02" * 20 + baseline[2:], 10**6)[0] == "jpeg"
    script = ("import sys, numpy as np; from remoteloader.server.pipelines import Pipeline, PipelineSpec\n"
              "data = sys.stdin.buffer.read()\n"
              "for verified in (False, True):\n"
              "    for seed in range(20):\n"
              "        assert Pipeline(PipelineSpec('train', 8, 8))(data, seed, verified=verified).shape == (8, 8, 3)\n"
              "print('ok')")
    empty_app2 = data[:2] + b"\xff\xe2\x00\x00" + data[2:]  # the case that once hid the frame
    result = subprocess.run([sys.executable, "-c", script], input=empty_app2, capture_output=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == b"ok", (result.returncode, result.stderr[-2000:])


@needs_region_decoder
def test_region_decoder_checks_its_arguments():
    data, h, w = jpeg_variants()["420"]
    out = np.empty((10, 10, 3), np.uint8)
    with pytest.raises(ValueError, match="denom"):
        dec._jpeg.decode_region(data, 3, 0, 0, 10, 10, out)
    with pytest.raises(ValueError, match="h \\* pitch \\* 3"):
        dec._jpeg.decode_region(data, 1, 0, 0, 10, 11, out)
    with pytest.raises(ValueError, match="h \\* pitch \\* 3"):
        dec._jpeg.decode_region(data, 1, 0, 0, 10, 10, out, 0, 12)
    for pitch in (9, 10 + 2**16 + 1):
        with pytest.raises(ValueError, match="pitch must be at least w and at most w \\+ 65536"):
            dec._jpeg.decode_region(data, 1, 0, 0, 10, 10, out, 0, pitch)
    for x, y in ((w - 5, 0), (0, h - 5), (2**32 + 3, 0), (-1, 0), (0, 2**70)):
        with pytest.raises((ValueError, OverflowError)):
            dec._jpeg.decode_region(data, 1, x, y, 10, 10, out)
    with pytest.raises(ValueError, match="outside"):  # inside the image, outside it at 1/8 scale (38x52)
        dec._jpeg.decode_region(data, 8, 45, 0, 10, 10, out)
    with pytest.raises(TypeError):
        dec._jpeg.decode_region(data, 1, 0, 0, 10, 10, bytes(300))  # read-only out
    dec._jpeg.decode_region(data, 1, w - 10, h - 10, 10, 10, out)  # the bottom-right corner is fine


@needs_region_decoder
def test_region_decoder_writes_libjpegs_rows_in_place_when_the_pitch_has_room():
    """With rows of pitch >= w + 31 pixels (decode_crop's), the region lies at the returned column of each row
    (libjpeg decodes from the iMCU column left of x); with pitch w it is copied to column 0.
    Either way the pixels are the whole decode's."""
    for name, mcu in (("420", 16), ("420 packed", 16), ("444 packed", 8), ("grey packed", 8), ("411", 32)):
        data, h, w = jpeg_variants()[name]
        whole = dec.decode(data, "jpeg", 0, 0, h, w)
        for x, y, rw, rh in ((0, 0, w, h), (19, 5, 40, 33), (32, 16, 17, 9), (w - 21, h - 7, 21, 7)):
            exact = np.empty((rh, rw, 3), np.uint8)
            assert dec._jpeg.decode_region(data, 1, x, y, rw, rh, exact) == 0
            wide = np.full((rh, rw + dec._IMCU_SLACK, 3), 7, np.uint8)
            column = dec._jpeg.decode_region(data, 1, x, y, rw, rh, wide, 0, wide.shape[1])
            assert column == x % mcu, (name, x)
            assert np.array_equal(wide[:, column : column + rw], exact), (name, x, y)
            assert np.array_equal(exact, whole[y : y + rh, x : x + rw]), (name, x, y)
        # What decode_crop returns: a view of those rows, the same pixels as the whole decode.
        region = dec.decode_crop(data, "jpeg", h, w, (19, 5, 59, 38), 0, 0, native=True)
        assert region.shape == (33, 40, 3) and np.array_equal(region, whole[5:38, 19:59]), name


def test_dct_factor():
    # The largest power of two (<= 8) that keeps both sides at least the minimum.
    assert dec.dct_factor(1500, 2000, 224, 224) == 4
    assert dec.dct_factor(1500, 2000, 188, 250) == 8
    assert dec.dct_factor(1500, 2000, 189, 250) == 4
    assert dec.dct_factor(1500, 2000, 750, 1000) == 2
    assert dec.dct_factor(1500, 2000, 751, 1000) == 1
    assert dec.dct_factor(1500, 2000, 750, 1001) == 1
    assert dec.dct_factor(375, 500, 224, 224) == 1  # ImageNet-sized at 224: never reduced
    assert dec.dct_factor(100, 100, 400, 400) == 1  # asking for more than the image: full size
    assert dec.dct_factor(4000, 4000, 1, 1) == 8  # never beyond 1/8
    # Odd sides: libjpeg rounds up, and so does the check.
    assert dec.dct_factor(1501, 2003, 751, 1002) == 2
    rng = np.random.default_rng(0)
    for _ in range(3000):
        h, w = (int(v) for v in rng.integers(1, 5000, 2))
        mh, mw = int(rng.integers(0, h + 1)), int(rng.integers(0, w + 1))
        f = dec.dct_factor(h, w, mh, mw)
        assert f in (1, 2, 4, 8)
        # Never smaller than the minimum ...
        assert math.ceil(h / f) >= mh and math.ceil(w / f) >= mw, (h, w, mh, mw, f)
        # ... and the largest such scale, except that a side under 8 px is never reduced.
        if min(h, w) < 8:
            assert f == 1
        elif f < 8:
            assert math.ceil(h / (2 * f)) < mh or math.ceil(w / (2 * f)) < mw, (h, w, mh, mw, f)
    assert dec.dct_factor(7, 4000, 1, 1) == dec.dct_factor(4000, 5, 1, 1) == 1


@needs_region_decoder
def test_tiny_images_decode_alike_by_either_decoder(monkeypatch):
    """Sides of 1-9 px at every minimum: the region decoder and simplejpeg pick the same scale."""
    rng = np.random.default_rng(2)
    for h in range(1, 10):
        for w in range(1, 10):
            data = encode_jpeg(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), 90)
            for mh, mw in {(1, 1), (1, w), (h, 1), (max(1, h // 2), max(1, w // 2))}:
                region = dec.decode_crop(data, "jpeg", h, w, (0, 0, w, h), mh, mw, native=True)
                with monkeypatch.context() as m:
                    m.setattr(dec, "_jpeg", None)
                    whole = dec.decode_crop(data, "jpeg", h, w, (0, 0, w, h), mh, mw)
                assert np.array_equal(region, whole), (h, w, mh, mw)


def test_decode_min_zero_is_full_size_and_scales_match_dct_factor(large_photos):
    data, h, w = large_photos[2]  # 1501 x 2003: odd sides
    assert dec.decode(data, "jpeg").shape == (h, w, 3)
    assert dec.decode(data, "jpeg", 0, 0, h, w).shape == (h, w, 3)  # 0 means full size
    for mh, mw, factor in ((751, 1002, 2), (300, 300, 4), (100, 100, 8), (1000, 10, 1)):
        assert dec.dct_factor(h, w, mh, mw) == factor
        image = dec.decode(data, "jpeg", mh, mw, h, w)
        assert image.shape == (math.ceil(h / factor), math.ceil(w / factor), 3)
        assert image.shape[0] >= mh and image.shape[1] >= mw


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


# ---- end to end: real servers -----------------------------------------------------------


class Synthetic:
    """A server started by hand: ``--synthetic N`` without ``--data``."""

    def __init__(self, log_dir: pathlib.Path):
        from remoteloader.tools.local import ServerProcess, server_command

        argv = server_command() + ["--synthetic", str(SYNTHETIC), "--host", "127.0.0.1", "--port", "0",
                                   "--workers", "1", "--grace", "2"]
        self.process = ServerProcess(argv, log_dir / "synthetic.log")
        self.address = None

    def wait(self) -> str:
        self.address = f"127.0.0.1:{self.process.wait_ready(60)}"
        return self.address

    def close(self) -> None:
        self.process.signal(signal.SIGTERM)
        self.process.wait(10)
        self.process.reap()


@pytest.fixture(scope="module")
def servers(module_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("fast-data")
    data = make_imagefolder(root / "data", CLASSES, PER_CLASS, size=(40, 56), seed=1, jitter=0.2)
    cached = root / "cached"
    small = root / "small"
    shutil.copytree(data, cached)
    shutil.copytree(data, small)
    rate = make_imagefolder(root / "rate", CLASSES, RATE_SAMPLES // len(CLASSES), size=(24, 32), seed=2)
    sizes = sorted(p.stat().st_size for p in small.rglob("*.jpg"))
    small_cache = sum(sizes) // 2
    synthetic = Synthetic(root)
    try:
        c = module_cluster
        names = {}
        names["workers"] = c.add(data, "--workers", "2", wait=False)
        names["cached"] = c.add(cached, "--cache-bytes", str(CACHE_BYTES), wait=False)
        names["plain"] = c.add(cached, "--region-decode", "false", wait=False)
        names["small"] = c.add(small, "--cache-bytes", str(small_cache), wait=False)
        names["rate"] = c.add(rate, "--max-rate", str(RATE), wait=False)
        for i in names.values():
            c.wait_ready(i, timeout=60)
        addresses = {k: c.address(i) for k, i in names.items()}
        pids = {k: c.pid(i) for k, i in names.items()}
        addresses["synthetic"] = synthetic.wait()
        yield {"root": root, "data": data, "cached": cached, "small": small, "small_cache": small_cache,
               "rate": rate, "address": addresses, "pid": pids, "cluster": c, "index": names}
    finally:
        synthetic.close()


def loader(address: str, **kwargs) -> RemoteLoader:
    options = dict(batch_size=64, image_size=SIZE, seed=SEED, shuffle=False, drop_last=False, return_ids=True,
                   connect_timeout=20, reconnect_timeout=5)
    options.update(kwargs)
    return RemoteLoader(address, **options)


def collect(run_bounded, ld: RemoteLoader, seconds: float = 40) -> dict[int, tuple[np.ndarray, int]]:
    """One epoch as {sample id: (pixels, label)}, failing on a duplicate id."""
    out = {}
    for images, labels, ids in run_bounded(ld, seconds):
        for image, label, i in zip(images.numpy(), labels.tolist(), ids.tolist()):
            assert i not in out, f"sample {i} delivered twice"
            out[i] = (image.copy(), label)
    return out


def session_processes(sid: int) -> set[int]:
    """Pids in a session (the server runs in its own: its forkserver and workers are there too)."""
    pids = set()
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.add(int(entry.name))
    return pids


def shard_key(shard_id: str) -> int:
    return int(hashlib.sha256(shard_id.encode()).hexdigest()[:16], 16)


def test_worker_pool_serves_every_sample_once_with_locally_reproducible_pixels(servers, run_bounded):
    root = servers["data"]
    with loader(servers["address"]["workers"], batch_size=40, shuffle=True) as ld:
        assert ld.num_samples == len(CLASSES) * PER_CLASS
        assert ld.class_names == CLASSES
        (shard,) = ld.catalog.shards
        reference = Pipeline(PipelineSpec("train", SIZE, SIZE))
        server_pid = servers["pid"]["workers"]
        processes = session_processes(server_pid)
        # The server, its forkserver and two workers (perhaps a resource tracker).
        forked = [p for p in processes if b"forkserver" in pathlib.Path(f"/proc/{p}/cmdline").read_bytes()]
        assert server_pid in processes and len(forked) >= 3, processes
        for epoch in (0, 1):
            ld.set_epoch(epoch)
            got = collect(run_bounded, ld)
            assert sorted(got) == list(range(ld.num_samples)), "not every sample exactly once"
            for i, (image, label) in got.items():
                key = ld.sample_key(i)
                assert CLASSES[label] == key.split("/")[0], f"sample {i} {key!r} has label {label}"
                seed = sample_seeds(SEED, epoch, shard_key(shard.id), np.asarray([i - shard.offset]))[0]
                expected = reference((root / key).read_bytes(), seed)
                assert np.array_equal(image, expected), f"epoch {epoch} sample {i} {key!r}: pixels differ"
            if epoch == 0:
                first = got
        # The workers are persistent: no process was started or ended for the epochs.
        assert session_processes(server_pid) == processes
        # A new epoch draws new augmentations.
        changed = sum(not np.array_equal(first[i][0], got[i][0]) for i in got)
        assert changed > len(got) // 2


def test_worker_pool_eval_pixels_match_reference(servers, run_bounded):
    root = servers["data"]
    with loader(servers["address"]["workers"], pipeline="eval", batch_size=36, image_size=(16, 24)) as ld:
        got = collect(run_bounded, ld)
        assert sorted(got) == list(range(36))
        for i, (image, label) in got.items():
            key = ld.sample_key(i)
            expected = Pipeline(PipelineSpec("eval", 16, 24))((root / key).read_bytes(), 0)
            assert np.array_equal(image, expected), f"sample {i} {key!r}: pixels differ"
            assert CLASSES[label] == key.split("/")[0]


def test_region_decode_off_serves_the_same_pixels(servers, run_bounded):
    """--region-decode false is taken (and logged); whole-image decoding serves the same pixels."""
    c, index = servers["cluster"], servers["index"]
    assert "JPEG crops: whole images (--region-decode off)" in c.stderr(index["plain"])
    built = "crop regions only, once a file has decoded" if dec._jpeg is not None else "whole images (simplejpeg"
    assert f"JPEG crops: {built}" in c.stderr(index["workers"])
    root = servers["cached"]
    with loader(servers["address"]["plain"]) as ld:
        got = collect(run_bounded, ld)
        assert sorted(got) == list(range(36))
        (shard,) = ld.catalog.shards
        for i, (image, _label) in got.items():
            seed = sample_seeds(SEED, 0, shard_key(shard.id), np.asarray([i - shard.offset]))[0]
            expected = Pipeline(PipelineSpec("train", SIZE, SIZE))((root / ld.sample_key(i)).read_bytes(), seed)
            assert np.array_equal(image, expected), f"sample {i}: pixels differ"


def test_a_damaged_file_fails_in_every_epoch_though_the_region_decoder_would_take_it(cluster, tmp_path,
                                                                                      run_bounded):
    """The region decoder is used only for files that decoded whole before (and were not written
    since the server indexed them), so a damaged file is refused every epoch, not only in the
    epochs whose crop reaches the damage: a file cut near its end from the start, and a file
    damaged in place (same length) after it decoded cleanly in epoch 0."""
    root = make_imagefolder(tmp_path / "data", ["a", "b"], 4, size=(120, 160), seed=4)
    cut = root / "a" / "a_00000.jpg"
    whole = cut.read_bytes()
    cut.write_bytes(whole[: len(whole) * 9 // 10])  # its last rows are gone
    cluster.add(root)
    epochs, failures = 5, []
    with loader(cluster.address(0), batch_size=4, on_error=failures.extend) as ld:
        (shard,) = ld.catalog.shards
        ids = {ld.sample_key(i): i for i in range(ld.num_samples)}
        reference = Pipeline(PipelineSpec("train", SIZE, SIZE))

        def seed(key: str, epoch: int) -> int:
            return sample_seeds(SEED, epoch, shard_key(shard.id), np.asarray([ids[key] - shard.offset]))[0]

        def damage(data: bytes) -> bytes:  # the last 10% zeroed: the same length
            return data[: len(data) * 9 // 10] + bytes(len(data) - len(data) * 9 // 10)

        # The file to damage after epoch 0: one whose epoch-1 crop misses the damage, so that
        # only the check of the file's modification time can refuse it in epoch 1.
        later = None
        for key in (k for k in ids if k.startswith("b/")):
            try:
                reference(damage((root / key).read_bytes()), seed(key, 1), verified=True)
                later = root / key
                break
            except dec.DecodeError:
                continue
        if dec._jpeg is not None:
            assert later is not None, "every crop reaches the damage: the test would show nothing"
        else:
            later = root / "b" / "b_00000.jpg"
        served = {"a/a_00000.jpg": 0, f"b/{later.name}": 0}  # epochs the region decoder alone would serve it
        for epoch in range(epochs):
            if epoch == 1:
                later.write_bytes(damage(later.read_bytes()))
            ld.set_epoch(epoch)
            failures.clear()
            got = collect(run_bounded, ld)
            expected = ["a/a_00000.jpg"] + ([f"b/{later.name}"] if epoch else [])
            assert sorted(f.key for f in failures) == expected, f"epoch {epoch}: {failures}"
            assert sorted(got) == list(range(ld.num_samples))  # the failed ones as zeros
            for key in expected:
                assert not got[ids[key]][0].any()
                if epoch and dec._jpeg is not None:
                    try:  # what the region decoder would have made of it this epoch
                        reference((root / key).read_bytes(), seed(key, epoch), verified=True)
                        served[key] += 1
                    except dec.DecodeError:
                        pass
    if dec._jpeg is not None:
        assert all(served.values()), f"some file's crops all reached its damage: the test shows nothing {served}"


def eval_epoch(run_bounded, address: str, **kwargs) -> dict[str, tuple[np.ndarray, int]]:
    """An eval epoch by key, and the failures reported: ({key: (pixels, label)}, [SampleFailure])."""
    failures = []
    with loader(address, pipeline="eval", on_error=failures.extend, **kwargs) as ld:
        got = collect(run_bounded, ld)
        by_key = {ld.sample_key(i): v for i, v in got.items()}
    return by_key, failures


def test_cache_serves_from_memory_after_the_first_epoch(servers, run_bounded):
    cached, plain = servers["address"]["cached"], servers["address"]["plain"]
    root = servers["cached"]
    files = sorted(root.rglob("*.jpg"))
    reference, failures = eval_epoch(run_bounded, plain)
    assert not failures and len(reference) == len(files)
    first, failures = eval_epoch(run_bounded, cached)
    assert not failures
    assert first.keys() == reference.keys()
    for key, (image, label) in reference.items():
        assert np.array_equal(first[key][0], image) and first[key][1] == label
    second, failures = eval_epoch(run_bounded, cached)
    assert not failures
    for key, (image, label) in reference.items():
        assert np.array_equal(second[key][0], image) and second[key][1] == label
    # The files are gone or changed: only the cache can serve them now.
    for n, path in enumerate(files):
        if n % 2:
            path.unlink()
        else:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    third, failures = eval_epoch(run_bounded, cached)
    assert not failures, f"the cache did not serve: {failures[:3]}"
    assert third.keys() == reference.keys()
    for key, (image, label) in reference.items():
        assert np.array_equal(third[key][0], image) and third[key][1] == label
    # The uncached server really sees the damage.
    _, failures = eval_epoch(run_bounded, plain)
    assert len(failures) == len(files)


def test_cache_too_small_serves_cached_files_and_fails_the_others(servers, run_bounded):
    address, root, capacity = servers["address"]["small"], servers["small"], servers["small_cache"]
    sizes = {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*.jpg")}
    first, failures = eval_epoch(run_bounded, address)
    assert not failures and first.keys() == sizes.keys()
    for path in root.rglob("*.jpg"):
        path.unlink()
    second, failures = eval_epoch(run_bounded, address)
    failed = {f.key for f in failures}
    served = set(second) - failed
    assert failed and served, f"{len(failed)} failed, {len(served)} served"
    assert failed | served == set(sizes)
    assert sum(sizes[k] for k in served) <= capacity  # only what fits in the cache is served
    for f in failures:
        assert "No such file" in f.reason or "changed" in f.reason, f.reason
    for key in served:
        assert np.array_equal(second[key][0], first[key][0]), f"{key}: cached pixels differ"
        assert second[key][1] == first[key][1]


def test_synthetic_mode_serves_generated_pixels(servers, run_bounded):
    with loader(servers["address"]["synthetic"], batch_size=8, image_size=24) as ld:
        assert ld.num_samples == SYNTHETIC
        classes = len(ld.class_names)
        assert classes > 0
        got = collect(run_bounded, ld)
        assert sorted(got) == list(range(SYNTHETIC))
        for image, label in got.values():
            assert 0 <= label < classes
            assert image.shape == (24, 24, 3)
        pixels = np.stack([image for image, _ in got.values()])
        assert pixels.any(), "synthetic pixels are all zeros"
        assert pixels.std() > 10


def test_max_rate_bounds_throughput(servers, run_bounded):
    with loader(servers["address"]["rate"], batch_size=10, image_size=SIZE) as ld:
        assert ld.num_samples == RATE_SAMPLES
        started = time.monotonic()
        got = collect(run_bounded, ld, seconds=60)
        elapsed = time.monotonic() - started
    assert len(got) == RATE_SAMPLES
    assert elapsed >= 1.0, f"{RATE_SAMPLES} samples at --max-rate {RATE} took only {elapsed:.2f}s"
