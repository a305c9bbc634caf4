"""Decoding (``server/decode.py`` and the native region decoder ``server/_jpeg.c``): the region
decoder against a whole decode, pack's lossless transcode, damaged and unusual JPEGs, the
decode scale. In process, no server.
"""

from __future__ import annotations

import io
import math
import struct
import subprocess
import sys

import cv2
import numpy as np
import pytest
from photos import needs_region_decoder

from remoteloader.server import decode as dec
from remoteloader.tools.textures import encode_jpeg, make_image

pytestmark = pytest.mark.timeout(120)


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


@needs_region_decoder
def test_region_decode_reading_the_rest_gives_the_pixels_of_a_whole_decode(monkeypatch):
    """decode_crop(native=True, whole=True), a first epoch's decode of a file not yet known to
    decode: the same pixels as a whole decode's crop, in every layout, box and scale."""
    rng = np.random.default_rng(3)
    for name, (data, h, w) in jpeg_variants().items():
        for box in random_boxes(rng, h, w, 8):
            for min_h, min_w in ((0, 0), (h // 2, w // 2), (h // 4, 1), (1, 1)):  # scales 1, 2, 4, 8
                region = dec.decode_crop(data, "jpeg", h, w, box, min_h, min_w, native=True, whole=True)
                with monkeypatch.context() as m:
                    m.setattr(dec, "_jpeg", None)
                    whole = dec.decode_crop(data, "jpeg", h, w, box, min_h, min_w)
                assert np.array_equal(region, whole), f"{name}: box {box} at min {min_h}x{min_w}"


def damaged_below_the_top(data: bytes) -> dict[str, bytes]:
    """A JPEG damaged only in its last rows or after them, where a crop of its top does not reach."""
    start, segments = entropy_segments(data)
    end = segments[-1][1]  # the EOI marker
    late = start + (end - start) * 9 // 10
    flipped = bytearray(data)
    for i in range(late, end, 97):
        flipped[i] ^= 0x5A if flipped[i] != 0xFF and flipped[i] ^ 0x5A != 0xFF else 0
    return {
        "cut at 9/10": data[: len(data) * 9 // 10],
        "cut before EOI": data[:-2],
        "last tenth zeroed": data[:late] + bytes(end - late) + data[end:],
        "bytes flipped in the last tenth": bytes(flipped),
        "garbage before EOI": data[:end] + b"\x12\x34\x56" + data[end:],
        "EOI as a restart marker": data[:end] + b"\xff\xd3",
    }


def reason(crop: tuple, **kwargs) -> str | None:
    """The DecodeError decode_crop(*crop, **kwargs) raises (its message), or None when it returns pixels."""
    try:
        dec.decode_crop(*crop, **kwargs)
    except dec.DecodeError as exc:
        return str(exc)
    return None


@needs_region_decoder
def test_damage_outside_the_crop_fails_as_a_whole_decode_fails(monkeypatch):
    """What keeps the first epoch's region decode honest: for a file damaged outside the crop
    (below it, or after the last row), reading the rest refuses exactly what a whole decode
    refuses, with the same reason, at every scale; the region alone (a verified file's decode)
    would have taken some of them."""
    blind = refused = 0
    for name in ("420", "422", "444", "grey", "restarts", "restart-per-mcu"):
        clean, h, w = jpeg_variants()[name]
        for damage, data in damaged_below_the_top(clean).items():
            for min_h, min_w in ((0, 0), (h // 4, w // 4)):
                top = (5, 3, 57, 41)
                crop = (data, "jpeg", h, w, top, min_h, min_w)
                with monkeypatch.context() as m:
                    m.setattr(dec, "_jpeg", None)
                    expected = reason(crop)
                got = reason(crop, native=True, whole=True)
                assert got == expected, f"{name}, {damage}, min {min_h}: {got!r} != whole decode's {expected!r}"
                if expected is None:
                    continue
                refused += 1
                assert "corrupt" in expected.lower(), expected
                factor = dec._decode_factor("jpeg", h, w, min_h, min_w)
                box = dec._scale_box(top, h, w, -(-h // factor), -(-w // factor))
                args = (data, factor, box[0], box[1], box[2] - box[0], box[3] - box[1])
                out = np.empty((box[3] - box[1], box[2] - box[0] + 31, 3), np.uint8)
                with pytest.raises(ValueError):  # refused natively, not only by the whole decode after it
                    dec._jpeg.decode_region(*args, out, dec.MAX_SCANS, out.shape[1], True)
                blind += reason(crop, native=True) is None
    assert refused > 40 and blind > 20, (refused, blind)  # the damage is refused, and unseen by the region alone


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
