"""Image header checks and libjpeg-turbo decoding, optionally at a reduced DCT scale.

JPEGs are decoded with simplejpeg (libjpeg-turbo) in strict mode, so truncated or corrupt
files raise instead of yielding half-grey images; PNGs go through OpenCV.
Everything returns RGB uint8 HWC.

``decode_crop`` can decode only a crop's rows and columns with the native region decoder
(``_jpeg.c``, built at install time when a compiler and libjpeg-turbo's headers are there);
in a JPEG with a restart marker after every MCU (as ``remoteloader pack`` writes them) only
the crop's MCUs. It gives the same pixels as a whole decode, but it does not read what lies
outside the crop (at least the rows below it), so it cannot refuse damage there: the server
uses it alone only for files that have decoded without error before, or that ``remoteloader
pack`` rewrote (see render.Renderer and Shard.verified). A file not known to decode is
region-decoded with its rest read too (``whole=True``: the rows below the crop entropy-decoded,
not transformed, up to the end of the image), which fails wherever a whole decode fails: every
failure of a whole decode comes from reading the file, none from the inverse DCT, upsampling or
colour conversion. Where it fails, the whole decode is run and decides, so the reason reported
is the whole decode's, whatever the server's history.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator

import cv2
import numpy as np
import simplejpeg

try:
    from remoteloader.server import _jpeg
except ImportError:  # not built (no compiler or no libjpeg-turbo headers at install): see setup.py
    _jpeg = None

JPEG_MAGIC = b"\xff\xd8\xff"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FORMATS = ("jpeg", "png")
_SCALABLE_FRAMES = (0xC0, 0xC1, 0xC2, 0xC9, 0xCA)  # DCT-based: baseline, extended, progressive, arithmetic
_PROGRESSIVE_FRAMES = (0xC2, 0xC6, 0xCA, 0xCE)
# Most scans a JPEG may have (as jpegtran's -maxscans). Encoders write 1 (baseline), 3 (one per
# component) or about 10 (progressive); each scan is a pass over a component's blocks, so a
# file repeating one scan costs seconds for a few KB.
MAX_SCANS = 100
# The most pixels libjpeg's rows start left of a region: an iMCU is at most 4 blocks of 8 wide.
_IMCU_SLACK = 31


class DecodeError(ValueError):
    """A sample that cannot be served; the message is the reason reported to the client."""


def sniff_format(data: bytes) -> str:
    """Returns "jpeg" or "png" from the magic bytes; raises DecodeError for anything else."""
    if not data:
        raise DecodeError("empty file (0 bytes)")
    if data[:3] == JPEG_MAGIC:
        return "jpeg"
    if data[:8] == PNG_MAGIC:
        return "png"
    raise DecodeError(f"unsupported format (magic bytes {data[:8].hex()}); this server decodes {', '.join(FORMATS)}")


def read_size(data: bytes, max_pixels: int) -> tuple[str, int, int]:
    """Reads (format, height, width) from the header without decoding pixels.

    The format is "png", "jpeg", or "jpeg-full" for a JPEG that must be decoded at full size:
    a lossless one (simplejpeg crashed scaling those) or one whose frame marker was not found.

    Raises DecodeError when the header is unreadable or the image has more than
    ``max_pixels`` pixels (a decompression bomb or an absurd photo).
    """
    fmt = sniff_format(data)
    if fmt == "jpeg":
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        except (ValueError, KeyError) as exc:  # KeyError: an unknown subsampling or colour-space code
            raise DecodeError(f"corrupt JPEG header: {type(exc).__name__}: {exc}") from None
        frame, several_scans = _frame(data)
        if frame not in _SCALABLE_FRAMES:
            fmt = "jpeg-full"
        if several_scans and _more_scans_than(data, MAX_SCANS):
            raise DecodeError(f"JPEG has more than {MAX_SCANS} scans (a decoding cost bomb?)")
    else:
        if len(data) < 24 or data[12:16] != b"IHDR":
            raise DecodeError("corrupt PNG header")
        width, height = struct.unpack(">II", data[16:24])
    if height <= 0 or width <= 0:
        raise DecodeError(f"invalid image dimensions {width}x{height}")
    if height * width > max_pixels:
        raise DecodeError(f"image is {width}x{height} = {height * width} pixels, over the limit of {max_pixels}")
    return fmt, height, width


def _markers(data: bytes) -> Iterator[tuple[int, int]]:
    """(marker, offset) of each step through a JPEG's markers, a fill byte (0xFF) included;
    a scan's entropy-coded data is skipped, lazily, when the step after its SOS is asked for.
    Ends at EOI, at the end of the data, or where no marker stands."""
    i, n = 2, len(data)
    while i + 4 <= n and data[i] == 0xFF:
        marker = data[i + 1]
        yield marker, i
        if marker == 0xD9:
            return
        if marker == 0xFF:  # fill byte
            i += 1
        elif 0xD0 <= marker <= 0xD8 or marker == 0x01:  # no length
            i += 2
        else:  # as libjpeg: a length under 2 skips just the length field
            i += 2 + max(int.from_bytes(data[i + 2 : i + 4], "big"), 2)
        while marker == 0xDA:  # up to the next marker: a 0xFF in entropy-coded data is stuffed or a restart
            i = data.find(b"\xff", i)
            if i < 0 or i + 1 >= n:
                return
            if data[i + 1] == 0 or 0xD0 <= data[i + 1] <= 0xD7:
                i += 2
            else:
                break


def _frame(data: bytes, max_steps: int = 256) -> tuple[int | None, bool]:
    """The JPEG's SOFn marker (0xC0 baseline, 0xC2 progressive, 0xC3 lossless, ...) or None, and
    whether the file may hold more than one scan.

    libjpeg refuses a second scan unless the image is progressive or its first scan leaves
    out components; only such files can repeat scans (see MAX_SCANS). Unknown (True) when
    the first scan is not among the first ``max_steps`` markers and fill bytes (a real file
    has a dozen): a crafted file cannot make this slow.
    """
    frame, components = None, 0
    for marker, i in itertools.islice(_markers(data), max_steps):
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC) and frame is None:
            frame, components = marker, data[i + 9] if i + 9 < len(data) else 0
        elif marker == 0xDA:  # the first scan: its component count follows the length
            return frame, frame in _PROGRESSIVE_FRAMES or data[i + 4] < components
    return frame, True


def _more_scans_than(data: bytes, limit: int) -> bool:
    """Whether the JPEG has more than ``limit`` scans (SOS markers).

    Every scan starts with FF DA, which entropy-coded data cannot hold (a 0xFF there is
    followed by 0x00 or a restart marker), so counting those bytes is an upper bound that
    settles nearly every file at memory speed. Only above the limit are the markers walked
    (APPn payloads such as an EXIF thumbnail may hold FF DA too).
    """
    if data.count(b"\xff\xda") <= limit:
        return False
    scans = (marker for marker, _ in _markers(data) if marker == 0xDA)
    return next(itertools.islice(scans, limit, None), None) is not None


def dct_factor(height: int, width: int, min_height: int, min_width: int) -> int:
    """The largest of 1, 2, 4, 8 that keeps the decoded image at least min_height x min_width.

    Only powers of two: libjpeg-turbo's other scales (7/8, 6/8, 5/8, 3/8) decode slower
    than full size (measured 1.3-1.7x on ImageNet-sized photos). Images with a side under
    8 px are not reduced: several scales would give the same size there, and simplejpeg
    (asked for a size) might pick another one than the region decoder (given a scale).
    """
    if min(height, width) < 8:
        return 1
    factor = 1
    while factor < 8 and -(-height // (factor * 2)) >= min_height and -(-width // (factor * 2)) >= min_width:
        factor *= 2
    return factor


def _decode_factor(fmt: str, height: int, width: int, min_height: int, min_width: int) -> int:
    """The DCT scale denominator decode() and decode_crop() use: 1 unless a scalable JPEG of
    known size has a minimum (0 x 0 means full size)."""
    if fmt == "jpeg" and (min_height or min_width) and height:
        return dct_factor(height, width, min_height, min_width)
    return 1


def decode(
    data: bytes, fmt: str, min_height: int = 0, min_width: int = 0, height: int = 0, width: int = 0
) -> np.ndarray:
    """Decodes to RGB uint8 HWC.

    For a JPEG of ``height`` x ``width`` (from its header), decodes at 1/2, 1/4 or 1/8
    scale when that still gives at least ``min_height`` x ``min_width``; 0 means full size.
    A "jpeg-full" is decoded at full size.
    """
    if fmt in ("jpeg", "jpeg-full"):
        factor = _decode_factor(fmt, height, width, min_height, min_width)
        try:
            return simplejpeg.decode_jpeg(
                data,
                colorspace="RGB",
                fastdct=True,
                fastupsample=True,
                min_height=-(-height // factor) if factor > 1 else 0,
                min_width=-(-width // factor) if factor > 1 else 0,
                strict=True,
            )
        except ValueError as exc:
            message = str(exc)
            # simplejpeg before 1.9 cannot convert CMYK/YCCK to RGB; OpenCV can (full-size decode).
            if "color conversion" not in message.lower():
                raise DecodeError(f"corrupt JPEG: {message}") from None
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB)
    if image is None:
        raise DecodeError(f"corrupt {fmt.upper()}: OpenCV could not decode it")
    return image


def can_transcode() -> bool:
    """Whether the native module was built, so that ``transcode_jpeg`` works (and decode_crop decodes
    regions natively)."""
    return _jpeg is not None


def transcode_jpeg(data: bytes, max_pixels: int) -> bytes | None:
    """``remoteloader pack``'s lossless rewrite of a JPEG: the same DCT coefficients (so the same
    pixels) as baseline, with optimized Huffman tables and a restart marker after every MCU, so
    that decode_crop decodes only a crop's MCUs (as ``jpegtran -copy all -optimize -restart 1B``).

    Returns None for a JPEG followed by data the rewrite would drop (an MPF part, a motion
    photo...). Raises ValueError where libjpeg will not rewrite it (damaged, over ``max_pixels``
    or MAX_SCANS, not a JPEG), and RuntimeError when the native module was not built
    (``can_transcode``).
    """
    if _jpeg is None:
        raise RuntimeError("the native JPEG module was not built (see setup.py): no JPEG can be rewritten")
    return _jpeg.transcode(data, max_pixels, MAX_SCANS)


def region_decoder() -> str:
    """How decode_crop decodes JPEGs, for the server's start-up log."""
    if _jpeg is None:
        return "whole images (simplejpeg; the native region decoder was not built, see setup.py)"
    v = _jpeg.LIBJPEG_TURBO_VERSION_NUMBER
    return (
        f"crop regions only, with the rest of a file entropy-decoded too until it has decoded without error "
        f"(not those `remoteloader pack` rewrote); only the crop's MCUs in "
        f"JPEGs with a restart marker per MCU, as `remoteloader pack` writes them (native, libjpeg-turbo "
        f"{v // 1000000}.{v // 1000 % 1000}.{v % 1000})"
    )


def decode_crop(
    data: bytes,
    fmt: str,
    height: int,
    width: int,
    box: tuple[int, int, int, int],
    min_height: int,
    min_width: int,
    native: bool = False,
    whole: bool = False,
) -> np.ndarray:
    """The region ``box`` = (x1, y1, x2, y2) of a ``height`` x ``width`` image (header coordinates).

    Decoded at the smallest DCT scale that keeps the whole image at least ``min_height`` x
    ``min_width`` (0 x 0: full size); the box is scaled with it, so the region comes back
    at that scale.

    ``native=True`` uses the region decoder for baseline JPEGs: rows below the box are never
    decoded, and rows above and columns beside it are only entropy-decoded, or not at all
    with a restart marker after every MCU (see ``_jpeg.c``). Damage in a file
    can then go unseen (see the module's docstring): pass it only for files known to decode.
    ``whole=True`` (with ``native``) reads the rest of the file too, as a whole decode does, for
    a file not known to decode: it fails wherever a whole decode would.
    Whatever the region decoder refuses is decoded whole, which decides (and gives the reason).
    """
    factor = _decode_factor(fmt, height, width, min_height, min_width)
    if native and _jpeg is not None and fmt == "jpeg":
        x1, y1, x2, y2 = _scale_box(box, height, width, -(-height // factor), -(-width // factor))
        # Rows wide enough for libjpeg's, which start at the iMCU column left of x1: it writes
        # them in place, and the region is a view of them.
        out = np.empty((y2 - y1, x2 - x1 + _IMCU_SLACK, 3), np.uint8)
        try:
            column = _jpeg.decode_region(data, factor, x1, y1, x2 - x1, y2 - y1, out, MAX_SCANS, out.shape[1], whole)
            return out[:, column : column + x2 - x1]
        except ValueError:  # progressive, CMYK, damaged...: the whole decode below decides
            pass
    image = decode(data, fmt, min_height, min_width, height, width)
    x1, y1, x2, y2 = _scale_box(box, height, width, *image.shape[:2])
    return image[y1:y2, x1:x2]


def _scale_box(
    box: tuple[int, int, int, int], height: int, width: int, to_height: int, to_width: int
) -> tuple[int, int, int, int]:
    """A box in a height x width image, in the same image scaled to to_height x to_width (at least 1 px)."""
    x1, y1, x2, y2 = box
    if (to_height, to_width) == (height, width):
        return box
    sy, sx = to_height / height, to_width / width
    x1, y1 = min(round(x1 * sx), to_width - 1), min(round(y1 * sy), to_height - 1)
    return x1, y1, min(max(round(x2 * sx), x1 + 1), to_width), min(max(round(y2 * sy), y1 + 1), to_height)
