"""``remoteloader pack SRC DST``: write WebDataset tar shards from an ImageFolder tree.

Each sample becomes ``<class>/<file>`` (under its ImageFolder key) and ``<class>/<stem>.cls``
(its label as decimal text); beside each tar,
``<tar>.index.npz`` holds its index so servers start without scanning it, written in a seeded random order so
every shard mixes all classes; ``classes.txt`` beside the shards names the labels. Reading
one large file by offset is much faster than opening many small files on real disks.

JPEGs are rewritten losslessly unless ``--verbatim``: the same DCT coefficients, so the same
pixels, as baseline with optimized Huffman tables and a restart marker after every MCU
(``_jpeg.transcode``, as ``jpegtran -optimize -restart 1B`` would). The server then decodes
only the MCUs a random crop covers (``_jpeg.decode_region``): about a third less decoding
per image for ImageNet-sized photos and RandomResizedCrop. Progressive JPEGs become
baseline. What cannot be rewritten (PNGs, damaged or exotic JPEGs) is copied as it is.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import pathlib
import re
import sys
import tarfile

import numpy as np

from remoteloader.server.catalog import CLASSES_FILE, ImageFolderShard, TarShard
from remoteloader.server.decode import DecodeError, _jpeg, read_size

# Rewriting holds all of a JPEG's coefficients in memory (up to 6 bytes a pixel): larger ones are copied.
TRANSCODE_MAX_PIXELS = 64_000_000

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 500MB, 1GiB or 200000")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="ImageFolder tree: SRC/<class>/<image>")
    parser.add_argument("dst", help="output folder for shard-NNNNN.tar and classes.txt")
    parser.add_argument("--shard-size", type=parse_size, default=parse_size("256MB"),
                        help="target bytes per tar shard (default 256MB)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample order (mixes classes across shards)")
    parser.add_argument("--no-shuffle", action="store_true", help="keep the ImageFolder order")
    parser.add_argument("--verbatim", action="store_true",
                        help="copy every file byte for byte; by default JPEGs are rewritten losslessly (same "
                             "pixels) with a restart marker per MCU, so servers decode only a crop's blocks")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes rewriting JPEGs (default: the usable cores)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def prepare(path: str, transcode: bool = True) -> tuple[bytes, str, str]:
    """A file's bytes for the shard, what was done ("transcoded", "kept" or "unreadable"), and why."""
    data = pathlib.Path(path).read_bytes()
    try:  # the header only (a full decode would cost ~1 ms per image)
        fmt, height, width = read_size(data, max_pixels=1 << 62)
    except DecodeError as exc:
        return data, "unreadable", str(exc)
    if not transcode or _jpeg is None:
        return data, "kept", "not asked" if not transcode else "the native JPEG module was not built"
    if fmt != "jpeg":
        return data, "kept", "PNG" if fmt == "png" else "lossless or unusual JPEG"
    if height * width > TRANSCODE_MAX_PIXELS:
        return data, "kept", f"{width}x{height} is over {TRANSCODE_MAX_PIXELS // 1_000_000} MP"
    try:
        return _jpeg.transcode(data), "transcoded", ""
    except ValueError as exc:  # damaged, 12-bit...: served (or refused) as it is
        return data, "kept", f"libjpeg: {exc}"


def _prepare_transcoding(path: str) -> tuple[bytes, str, str]:
    return prepare(path, True)


def pack(src: str, dst: str, shard_size: int, seed: int = 0, shuffle: bool = True, progress: bool = True,
         transcode: bool = True, workers: int | None = None) -> tuple[list[pathlib.Path], dict[str, int]]:
    """Writes the shards; returns their paths and how many files were "transcoded", "kept" as
    they are and "unreadable". ``transcode``: rewrite JPEGs losslessly (see above)."""
    if shard_size <= 0:
        raise ValueError(f"shard_size={shard_size}: expected a positive number of bytes")
    if workers is None:
        workers = len(os.sched_getaffinity(0))
    if workers < 1:
        raise ValueError(f"workers={workers}: expected at least 1")
    source = ImageFolderShard(pathlib.Path(src))
    out = pathlib.Path(dst)
    if out.exists() and any(out.iterdir()):
        # A server reads every .tar in a folder: packing next to other files would mix datasets.
        raise FileExistsError(f"{out} is not empty; choose a new or empty folder for the shards")
    out.mkdir(parents=True, exist_ok=True)
    order = np.random.default_rng(seed).permutation(len(source)) if shuffle else np.arange(len(source))
    (out / CLASSES_FILE).write_text("".join(f"{c}\n" for c in source.class_names))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(source), unit="img", desc=f"packing into {out}", file=sys.stderr)
    paths: list[pathlib.Path] = []
    tar = None
    written = 0
    counts = {"transcoded": 0, "kept": 0, "unreadable": 0}
    first = {"kept": [], "unreadable": []}  # the first five of each, named
    files = (source.locate(index).path for index in order.tolist())
    rewriting = transcode and _jpeg is not None and workers > 1
    pool = multiprocessing.get_context("spawn").Pool(workers) if rewriting else None
    try:
        results = (pool.imap(_prepare_transcoding, files, chunksize=8) if pool is not None
                   else (prepare(path, transcode) for path in files))
        for index, (data, done, why) in zip(order.tolist(), results):
            key = source.key(index)
            counts[done] += 1
            if done in first and len(first[done]) < 5 and why != "not asked":
                first[done].append(f"{key} ({why})")
            if tar is None or written >= shard_size:
                if tar is not None:
                    tar.close()
                paths.append(out / f"shard-{len(paths):05d}.tar")
                tar = tarfile.open(paths[-1], "w", format=tarfile.USTAR_FORMAT)
                written = 0
            stem, _ = os.path.splitext(key)
            _add(tar, key, data)  # the ImageFolder key, so both layouts name samples alike
            _add(tar, f"{stem}.cls", str(int(source.labels[index])).encode())
            written += len(data) + 1536
            if bar is not None:
                bar.update(1)
    finally:
        if pool is not None:
            pool.terminate()
        if tar is not None:
            tar.close()
        if bar is not None:
            bar.close()
    names = list(source.class_names)
    for path in paths:  # the sidecar indexes: servers start without scanning the tars
        TarShard(path, names)
    if counts["unreadable"]:
        print(f"remoteloader pack: warning: {counts['unreadable']} file(s) have no readable image header; they are "
              f"packed as they are and will fail when served: {'; '.join(first['unreadable'])}"
              f"{' ...' if counts['unreadable'] > 5 else ''}", file=sys.stderr)
    if transcode and _jpeg is None:
        print("remoteloader pack: warning: files copied as they are: the native JPEG module was not built "
              "(see setup.py), so servers will decode each JPEG's rows down to the crop", file=sys.stderr)
    elif transcode and counts["kept"]:
        print(f"remoteloader pack: {counts['kept']} file(s) copied as they are, not rewritten: "
              f"{'; '.join(first['kept'])}{' ...' if counts['kept'] > 5 else ''}", file=sys.stderr)
    return paths, counts


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def run(args: argparse.Namespace) -> int:
    try:
        paths, counts = pack(args.src, args.dst, args.shard_size, args.seed, not args.no_shuffle,
                             progress=not args.quiet, transcode=not args.verbatim, workers=args.workers)
    except (OSError, ValueError) as exc:  # CatalogError is a ValueError
        print(f"remoteloader pack: error: {exc}", file=sys.stderr)
        return 2
    total = sum(p.stat().st_size for p in paths)
    rewritten = f"; {counts['transcoded']} of {sum(counts.values())} files rewritten losslessly" if not args.verbatim else ""
    print(f"wrote {len(paths)} shard(s), {total / 1e6:.1f} MB, to {args.dst}{rewritten}")
    return 0
