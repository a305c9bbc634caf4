"""A hostile image corpus, built here, served with on_error="skip" and with a callable.

Decompression bombs (JPEG SOF and PNG IHDR headers claiming 30000x30000 and more; a
progressive JPEG that repeats one scan 1000 times, a cost bomb of 20 KB), truncated
and corrupt files, wrong magic under .jpg names (text, GIF, BMP, WebP), zero bytes, zero
dimensions; and odd but valid files that must decode to RGB of the right shape: CMYK JPEG,
grayscale JPEG, progressive JPEG, PNGs (RGB, RGBA, gray, palette, 16-bit; named .png and
.jpg), and a valid JPEG with garbage appended after its end marker.
"""

from __future__ import annotations

import io
import re
import struct
import zlib

import cv2
import numpy as np
import pytest
from PIL import Image

from remoteloader.client import RemoteLoader, SampleFailure
from remoteloader.tools.textures import encode_jpeg, make_image

pytestmark = pytest.mark.timeout(120)

SIZE = 32
H, W = 48, 64


# ---- crafting -------------------------------------------------------------------------------
def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_claiming(width: int, height: int) -> bytes:
    """A well-formed PNG header (valid CRCs) claiming width x height, with a tiny IDAT."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + _png_chunk(b"IEND", b""))


def jpeg_claiming(jpeg: bytes, height: int, width: int) -> bytes:
    """The JPEG with its SOF frame header rewritten to claim height x width."""
    i = 2
    while i + 4 <= len(jpeg):
        assert jpeg[i] == 0xFF, "not at a marker"
        marker = jpeg[i + 1]
        length = struct.unpack(">H", jpeg[i + 2:i + 4])[0]
        if marker in (0xC0, 0xC1, 0xC2):
            return jpeg[:i + 5] + struct.pack(">HH", height, width) + jpeg[i + 9:]
        i += 2 + length
    raise AssertionError("no SOF marker")


def _scans(jpeg: bytes) -> list[tuple[int, int]]:
    """(start, end) of each scan: its SOS segment and the entropy-coded data after it."""
    scans, i = [], 2
    while jpeg[i + 1] != 0xD9:
        end = i + 2 + struct.unpack(">H", jpeg[i + 2:i + 4])[0]
        if jpeg[i + 1] == 0xDA:
            while jpeg[end] != 0xFF or jpeg[end + 1] == 0 or 0xD0 <= jpeg[end + 1] <= 0xD7:
                end += 1
            scans.append((i, end))
        i = end
    return scans


def jpeg_repeating_a_scan(progressive: bytes, times: int) -> bytes:
    """A valid progressive JPEG whose first AC scan of one component is sent ``times`` times.

    A first AC scan with Al=1 is rewritten to carry the coefficients' last bit too (Al=0), and
    its refinement scan (Ah=1, Al=0) dropped, so that every repetition is legal to libjpeg:
    each one costs a pass over all the component's blocks, for about 14 bytes of file.
    """
    scans = _scans(progressive)
    # SOS of one component: FF DA, length (2), Ns=1, component, tables, Ss, Se, Ah<<4|Al
    for start, end in scans:
        ns, component, _, ss, se, ahal = progressive[start + 4:start + 10]
        if ns == 1 and ss >= 1 and ahal == 0x01:
            refinement = bytes((1, component)), bytes((ss, se, 0x10))
            drop = next(r for r in scans if progressive[r[0] + 4:r[0] + 6] == refinement[0]
                        and progressive[r[0] + 7:r[0] + 10] == refinement[1])
            scan = bytearray(progressive[start:end])
            scan[9] = 0x00
            return progressive[:start] + bytes(scan) * times + progressive[end:drop[0]] + progressive[drop[1]:]
    raise AssertionError("no first AC scan of one component with Ah=0, Al=1")


def _pil(image: np.ndarray, mode: str, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).convert(mode).save(out, fmt, **kw)
    return out.getvalue()


# Bad files: key -> (bytes builder result, a regex the reason must match)
def build_corpus(rng: np.random.Generator):
    image = make_image(1, 3, rng, H, W)
    jpeg = encode_jpeg(image)
    bgr = cv2.cvtColor(image, cv2.COLOR_RGB2BGR)
    bad = {
        "bomb/jpeg-30000x30000.jpg": (jpeg_claiming(jpeg, 30000, 30000), r"30000x30000.*pixels.*limit"),
        "bomb/jpeg-65500x65500.jpg": (jpeg_claiming(jpeg, 65500, 65500), r"65500x65500.*pixels.*limit"),
        "bomb/png-30000x30000.png": (png_claiming(30000, 30000), r"30000x30000.*pixels.*limit"),
        "bomb/png-huge-width.png": (png_claiming(2**31 - 1, 1), r"pixels.*limit"),
        "bomb/png-30000x30000-as.jpg": (png_claiming(30000, 30000), r"30000x30000.*pixels"),
        "bad/png-zero-width.png": (png_claiming(0, 10), r"invalid image dimensions|dimension"),
        "bad/jpeg-zero-height.jpg": (jpeg_claiming(jpeg, 0, 64), r"corrupt|invalid"),
        "bad/truncated.jpg": (jpeg[: len(jpeg) // 2], r"(?i)corrupt|premature"),
        "bad/truncated-header.jpg": (jpeg[:20], r"(?i)corrupt"),
        "bad/jpeg-magic-only.jpg": (b"\xff\xd8\xff" + bytes(100), r"(?i)corrupt"),
        "bad/png-magic-only.png": (b"\x89PNG\r\n\x1a\n", r"(?i)corrupt"),
        "bad/png-truncated.png": (_pil(image, "RGB", "PNG")[:200], r"(?i)corrupt"),
        "bad/text.jpg": (b"this is not an image\n" * 30, r"unsupported format.*magic"),
        "bad/gif.jpg": (_pil(image, "P", "GIF"), r"unsupported format.*magic.*474946"),
        "bad/bmp.jpg": (cv2.imencode(".bmp", bgr)[1].tobytes(), r"unsupported format.*magic.*424d"),
        "bad/webp.jpeg": (_pil(image, "RGB", "WEBP"), r"unsupported format.*magic"),
        "bad/empty.jpg": (b"", r"empty"),
        "bomb/jpeg-1000-scans.jpg": (jpeg_repeating_a_scan(_pil(image, "RGB", "JPEG", quality=95, progressive=True),
                                                           1000), r"more than 100 scans"),
        "bad/random.png": (rng.integers(0, 256, 3000, dtype=np.uint8).tobytes(), r"unsupported format|corrupt"),
    }
    gray16 = cv2.imencode(".png", (bgr.astype(np.uint16) * 257))[1].tobytes()
    good = {
        "good/plain.jpg": jpeg,
        "good/cmyk.jpg": _pil(image, "CMYK", "JPEG", quality=95),
        "good/gray.jpg": _pil(image, "L", "JPEG", quality=95),
        "good/progressive.jpg": _pil(image, "RGB", "JPEG", quality=95, progressive=True),
        "good/rgb.png": _pil(image, "RGB", "PNG"),
        "good/png-named.jpg": _pil(image, "RGB", "PNG"),
        "good/rgba.png": _pil(image, "RGBA", "PNG"),
        "good/gray.png": _pil(image, "L", "PNG"),
        "good/palette.png": _pil(image, "P", "PNG"),
        "good/rgb16.png": gray16,
        "good/garbage-appended.jpg": jpeg + rng.integers(0, 256, 4000, dtype=np.uint8).tobytes(),
        "good/jpeg-named.png": jpeg,
    }
    return image, bad, good


@pytest.fixture(scope="module")
def corpus(module_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    image, bad, good = build_corpus(np.random.default_rng(5))
    files = {}
    for key, data in list(good.items()) + [(k, v[0]) for k, v in bad.items()]:
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files[key] = path
    print(f"\nhostile corpus: {len(files)} files ({len(bad)} bad, {len(good)} good) in {root}")
    module_cluster.add(root)
    return {"cluster": module_cluster, "image": image, "bad": bad, "good": good, "files": files}


def _keys(loader) -> dict[int, str]:
    return {i: loader.sample_key(i) for i in range(loader.num_samples)}


def _reference(image: np.ndarray, key: str) -> np.ndarray:
    """The eval preset applied locally to the RGB image the file holds (gray files: gray)."""
    if "gray" in key:
        lum = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
        image = np.repeat(lum[..., None], 3, axis=2)
    short = round(SIZE / 0.875)
    scale = short / min(H, W)
    nh, nw = max(short, round(H * scale)), max(short, round(W * scale))
    resized = cv2.resize(image, (nw, nh), interpolation=cv2.INTER_LINEAR)
    top, left = (nh - SIZE) // 2, (nw - SIZE) // 2
    return resized[top:top + SIZE, left:left + SIZE]


def _check_epoch(corpus, loader, delivered: dict[int, np.ndarray], failures: list[SampleFailure]) -> None:
    cluster, bad, good = corpus["cluster"], corpus["bad"], corpus["good"]
    keys = _keys(loader)
    assert len(keys) == len(bad) + len(good)
    by_key = {keys[i]: pixels for i, pixels in delivered.items()}
    # Every good sample arrives, RGB at the right shape, and looks like the source image.
    assert set(by_key) == set(good), (f"missing good: {sorted(set(good) - set(by_key))}; "
                                      f"unexpected: {sorted(set(by_key) - set(good))}")
    for key, pixels in by_key.items():
        assert pixels.shape == (SIZE, SIZE, 3) and pixels.dtype == np.uint8, key
        reference = _reference(corpus["image"], key).astype(np.int16)
        error = np.abs(pixels.astype(np.int16) - reference).mean()
        assert error < 12, f"{key}: mean abs error {error:.1f} against the source image"
        if "gray" in key:
            assert np.abs(pixels[..., 0].astype(int) - pixels[..., 2]).max() <= 2, f"{key}: not gray"
    # Every bad sample is reported once, with its key and a meaningful reason.
    reported = {}
    for f in failures:
        assert f.key not in reported, f"{f.key} reported twice"
        assert keys[f.sample_id] == f.key, f"failure for id {f.sample_id} names {f.key}"
        assert f.server == cluster.address(0)
        reported[f.key] = f.reason
    assert set(reported) == set(bad), (f"not reported: {sorted(set(bad) - set(reported))}; "
                                       f"reported but good: {sorted(set(reported) - set(bad))}")
    for key, reason in reported.items():
        assert re.search(bad[key][1], reason), f"{key}: reason {reason!r} does not match {bad[key][1]!r}"
    assert cluster.alive(0)


@pytest.mark.parametrize("pipeline", ["eval", "train"])
def test_hostile_corpus_with_on_error_skip(corpus, run_bounded, pipeline):
    import warnings

    with RemoteLoader(corpus["cluster"].address(0), batch_size=7, image_size=SIZE, pipeline=pipeline,
                      drop_last=False, return_ids=True, on_error="skip", connect_timeout=10) as loader:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches = run_bounded(loader, 60)
        # "skip" is silent about samples; a batch left out whole changes len(), and is said.
        said = [str(w.message) for w in caught]
        assert all("none of its" in m and "left out" in m for m in said), said
        assert len(said) == len(loader) - len(batches), said
        delivered = {}
        for images, _labels, ids in batches:
            for image, i in zip(images.numpy(), ids.tolist()):
                assert i not in delivered
                delivered[i] = image
        keys = _keys(loader)
    good = set(corpus["good"])
    assert {keys[i] for i in delivered} == good
    for i, pixels in delivered.items():
        assert pixels.shape == (SIZE, SIZE, 3) and pixels.max() > 0, keys[i]
    assert corpus["cluster"].alive(0)


def test_hostile_corpus_with_a_callable(corpus, run_bounded):
    failures: list[SampleFailure] = []
    with RemoteLoader(corpus["cluster"].address(0), batch_size=6, image_size=SIZE, pipeline="eval", shuffle=True,
                      seed=3, drop_last=False, return_ids=True, on_error=failures.extend,
                      connect_timeout=10) as loader:
        delivered = {}
        for images, _labels, ids in run_bounded(loader, 60):
            for image, i in zip(images.numpy(), ids.tolist()):
                assert i not in delivered
                delivered[i] = image
        # With a callable the batch comes whole: the failed rows are zeros.
        bad_ids = {f.sample_id for f in failures}
        for i in bad_ids:
            assert not delivered.pop(i).any(), f"failed sample {i} is not zeros"
        _check_epoch(corpus, loader, delivered, failures)


def test_server_log_names_no_crash(corpus):
    log = corpus["cluster"].stderr(0)
    assert "died with exit code" not in log and "stream reader failed" not in log, log[-3000:]


def test_the_native_decoder_and_rewrite_refuse_cost_bombs_themselves():
    """Beside the header check every decode passes (read_size), _jpeg's own entry points bound
    the scans they read and, for the rewrite, the pixels whose coefficients they hold."""
    from remoteloader.server import decode as dec

    if dec._jpeg is None:
        pytest.skip("the native JPEG module was not built")
    image = make_image(1, 3, np.random.default_rng(0), H, W)
    progressive = _pil(image, "RGB", "JPEG", quality=95, progressive=True)
    others = len(_scans(jpeg_repeating_a_scan(progressive, 1))) - 1
    at_limit, bomb = (jpeg_repeating_a_scan(progressive, 100 - others + extra) for extra in (0, 1))
    assert len(_scans(at_limit)) == 100 and len(_scans(bomb)) == 101
    assert dec._jpeg.transcode(at_limit, 0, 100) is not None and dec.read_size(at_limit, 10**8)
    with pytest.raises(ValueError, match="more than 100 scans"):
        dec._jpeg.transcode(bomb, 0, 100)
    with pytest.raises(ValueError, match="more than 100 scans"):
        dec.read_size(bomb, 10**8)
    sequential = encode_jpeg(image)
    with pytest.raises(ValueError, match=f"{W}x{H} = {W * H} pixels, over the limit of {W * H - 1}"):
        dec._jpeg.transcode(sequential, W * H - 1, 100)
    assert dec._jpeg.transcode(sequential, W * H, 100) is not None
    out = np.empty((H, W, 3), np.uint8)  # decode_region refuses progressive files anyway; its limit is
    dec._jpeg.decode_region(sequential, 1, 0, 0, W, H, out, 1)  # checked on the one scan it may read
    assert np.array_equal(out, dec.decode(sequential, "jpeg"))
