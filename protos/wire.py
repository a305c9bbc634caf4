"""How a sample's pixels travel: raw, or encoded per sample (``Setup.wire``).

Each sample's image (and mask) is encoded on its own, by the server's decode worker that
rendered it, and decoded by the client straight into the sample's row of its batch:

* ``"raw"`` (the default): the pixels as they are.
* ``"zstd"``, lossless: an image's rows are delta-coded (each row minus the row above, mod 256)
  and zstd-compressed (level 1); a mask is zstd-compressed as it is.
* ``"jpeg95"``, LOSSY: an image is a JPEG at quality 95 with 4:2:0 chroma; its pixels come out
  close to, not equal to, the server's. Masks travel as with "zstd", exact.

A sample whose encoding would not be smaller than its raw bytes travels raw; a failed
sample travels as nothing (zeros). ``ChunkHeader.encoded_sizes`` says which is which. The
decoders trust nothing from the wire: an encoded part must be smaller than the raw part it
stands for and decode to exactly its size (a zstd frame states its size up front, a JPEG its
dimensions, both checked before anything is written); anything else raises ValueError.

zstandard and simplejpeg are optional on the client (``pip install remoteloader[wire]``) and
part of the server's extra; ``missing`` says which one a wire needs.
"""

from __future__ import annotations

import importlib
import threading

import numpy as np

RAW, ZSTD, JPEG95 = "raw", "zstd", "jpeg95"
WIRES = (RAW, ZSTD, JPEG95)
LOSSY = frozenset({JPEG95})
JPEG_QUALITY = 95
ZSTD_LEVEL = 1  # levels 2-3 gained 1-3% on photos for 1.5-2x the encode time
_MODULES = {ZSTD: ("zstandard",), JPEG95: ("simplejpeg", "zstandard")}  # (masks travel zstd)


def normalize(wire: str) -> str:
    """The wire a Setup names ("" is raw); ValueError listing the choices for any other."""
    wire = wire or RAW
    if wire not in WIRES:
        raise ValueError(f"wire={wire!r}: expected one of {', '.join(WIRES)}")
    return wire


def missing(wire: str) -> str | None:
    """Why this process cannot encode or decode ``wire`` (a package is not installed), or None."""
    for name in _MODULES.get(wire, ()):
        try:
            importlib.import_module(name)
        except ImportError:
            return f"wire={wire!r} needs the {name} package: pip install 'remoteloader[wire]'"
    return None


def offered() -> list[str]:
    """The encodings beside raw that this process can encode (what a server describes)."""
    return [w for w in WIRES if w != RAW and missing(w) is None]


# ---- encoding (the server's decode workers) --------------------------------------------------


class Encoder:
    """Encodes one stream's images and masks with ``wire`` (not raw); one per worker process.

    ``image``/``mask`` return the encoded bytes, or None where they would not be smaller than
    the raw ones (the sample then travels raw).
    """

    def __init__(self, wire: str):
        import zstandard

        self.wire = wire
        self._zstd = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
        self._delta: np.ndarray | None = None

    def image(self, pixels: np.ndarray) -> bytes | None:
        if self.wire == JPEG95:
            import simplejpeg

            data = simplejpeg.encode_jpeg(
                np.ascontiguousarray(pixels), quality=JPEG_QUALITY, colorspace="RGB", colorsubsampling="420"
            )
        else:
            delta = self._delta
            if delta is None or delta.shape != pixels.shape:
                delta = self._delta = np.empty_like(pixels)
            delta[0] = pixels[0]
            np.subtract(pixels[1:], pixels[:-1], out=delta[1:])
            data = self._zstd.compress(delta.data)
        return data if len(data) < pixels.nbytes else None

    def mask(self, mask: np.ndarray) -> bytes | None:
        data = self._zstd.compress(np.ascontiguousarray(mask).data)
        return data if len(data) < mask.nbytes else None


# ---- decoding (the client, into the batch) ----------------------------------------------------

_local = threading.local()


def _zstd_decompress(data: memoryview, nbytes: int) -> bytes:
    """A zstd frame's content, which must state it is exactly ``nbytes``."""
    import zstandard

    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    try:
        size = zstandard.frame_content_size(data)
        if size != nbytes:
            raise ValueError(f"its zstd frame holds {size} bytes, expected {nbytes}")
        out = dctx.decompress(data, max_output_size=nbytes)
    except zstandard.ZstdError as exc:
        raise ValueError(f"bad zstd frame: {exc}") from None
    if len(out) != nbytes:
        raise ValueError(f"its zstd frame decoded to {len(out)} bytes, expected {nbytes}")
    return out


def decode_image(wire: str, data: memoryview, out: np.ndarray) -> None:
    """Decodes one encoded image into ``out`` (uint8 H x W x 3, C-contiguous); ValueError if the
    bytes are not a valid encoding of exactly that shape."""
    if wire == JPEG95:
        import simplejpeg

        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            if (height, width) != out.shape[:2]:
                raise ValueError(f"its JPEG is {height}x{width}, expected {out.shape[0]}x{out.shape[1]}")
            simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=out)
        except ValueError as exc:  # simplejpeg raises ValueError for data that is not a good JPEG
            raise ValueError(f"bad JPEG: {exc}") from None
    elif wire == ZSTD:
        delta = np.frombuffer(_zstd_decompress(data, out.nbytes), np.uint8).reshape(len(out), -1)
        rows = out.reshape(len(out), -1)
        rows[0] = delta[0]
        for r in range(1, len(rows)):  # undoes the row deltas (mod 256): twice as fast as np.cumsum
            np.add(rows[r - 1], delta[r], out=rows[r])
    else:
        raise ValueError(f"wire={wire!r} encodes no images")


def decode_mask(data: memoryview, out: np.ndarray) -> None:
    """Decodes one zstd-encoded mask into ``out`` (uint8 H x W); ValueError as decode_image."""
    out[...] = np.frombuffer(_zstd_decompress(data, out.nbytes), np.uint8).reshape(out.shape)


def parts(sizes: list[int], count: int, image_bytes: int, mask_bytes: int, total: int) -> list[tuple[int, int]]:
    """Where each part of an encoded chunk is in its payload: (offset, size) of its ``count``
    images, then (``mask_bytes`` > 0) its masks. ValueError unless ``sizes`` has one entry per
    part, each at most its raw size, and they add up to the payload's ``total`` bytes."""
    expected = count * (2 if mask_bytes else 1)
    if len(sizes) != expected:
        raise ValueError(f"{len(sizes)} encoded sizes for {expected} images and masks")
    out, offset = [], 0
    for i, size in enumerate(sizes):
        raw = image_bytes if i < count else mask_bytes
        if size > raw:
            raise ValueError(f"an encoded part of {size} bytes is larger than its raw {raw} bytes")
        out.append((offset, size))
        offset += size
    if offset != total:
        raise ValueError(f"encoded sizes add up to {offset} bytes, the payload has {total}")
    return out


def decode_part(wire: str, data: memoryview, out: np.ndarray, mask: bool) -> None:
    """One part into ``out``: zeros (no bytes: the sample failed), raw bytes (its raw size), or
    decoded; ValueError for bytes that do not decode to exactly ``out``."""
    if not len(data):
        out[...] = 0
    elif len(data) == out.nbytes:
        out.reshape(-1)[:] = np.frombuffer(data, np.uint8)
    elif mask:
        decode_mask(data, out)
    else:
        decode_image(wire, data, out)
