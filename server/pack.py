"""``remoteloader pack SRC DST``: write WebDataset tar shards from an ImageFolder tree.

Each sample becomes ``<class>/<file>`` (under its ImageFolder key) and ``<class>/<stem>.cls``
(its label as decimal text); beside each tar,
``<tar>.index.npz`` holds its index so servers start without scanning it, written in a seeded random order so
every shard mixes all classes; ``classes.txt`` beside the shards names the labels. Reading
one large file by offset is much faster than opening many small files on real disks.

JPEGs are rewritten losslessly unless ``--verbatim``: the same DCT coefficients, so the same
pixels, as baseline with optimized Huffman tables and a restart marker after every MCU
(``_jpeg.transcode``, as ``jpegtran -copy all -optimize -restart 1B`` would). The server then
decodes only the MCUs a random crop covers (``_jpeg.decode_region``): for ImageNet-sized
photos and RandomResizedCrop, a quarter less decoding per image than the region decoder on
the original files. Whole decodes of rewritten files cost about 8% more. Progressive JPEGs
become baseline. What cannot or need not be rewritten (PNGs, CMYK, damaged JPEGs) is copied
as it is.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import io
import multiprocessing
import os
import pathlib
import re
import signal
import sys
import tarfile

import numpy as np
import simplejpeg

from remoteloader.server.catalog import CLASSES_FILE, INDEX_SUFFIX, ImageFolderShard, TarShard
from remoteloader.server.config import default_workers
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


# What pack did with a file: rewrote it; copied it (a PNG, CMYK...: nothing to gain, or --verbatim);
# copied it because libjpeg would not rewrite it (damaged, most likely: a warning); or copied a
# file whose header is unreadable (it fails when served: a warning).
OUTCOMES = ("rewritten", "copied", "not rewritten", "unreadable")


def prepare(path: str, transcode: bool = True) -> tuple[bytes, str, str]:
    """A file's bytes for the shard, its outcome (one of OUTCOMES) and why."""
    data = pathlib.Path(path).read_bytes()
    try:  # the header only (a full decode would cost ~1 ms per image)
        fmt, height, width = read_size(data, max_pixels=1 << 62)
    except DecodeError as exc:
        return data, "unreadable", str(exc)
    if not transcode or _jpeg is None:
        return data, "copied", "not asked" if not transcode else "the native JPEG module was not built"
    if fmt != "jpeg":
        return data, "copied", "PNG" if fmt == "png" else "lossless or unusual JPEG"
    if simplejpeg.decode_jpeg_header(data)[2] in ("CMYK", "YCCK"):
        return data, "copied", "CMYK, always decoded whole"
    if height * width > TRANSCODE_MAX_PIXELS:
        return data, "copied", f"{width}x{height} is over {TRANSCODE_MAX_PIXELS // 1_000_000} MP"
    try:
        return _jpeg.transcode(data), "rewritten", ""
    except ValueError as exc:
        return data, "not rewritten", f"libjpeg: {exc}"


def _prepare_all(paths: list[str], transcode: bool) -> list[tuple[bytes, str, str]]:
    return [prepare(path, transcode) for path in paths]


def _ignore_interrupts() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle


def _prepared(paths: list[str], transcode: bool, workers: int):
    """prepare() of every path, in order: in worker processes when there is rewriting to do,
    with at most a few batches of files in flight (bounded memory whatever the disk's speed)."""
    batches = [paths[i:i + 8] for i in range(0, len(paths), 8)]
    if not (transcode and _jpeg is not None and workers > 1):
        for batch in batches:
            yield from _prepare_all(batch, transcode)
        return
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_ignore_interrupts) as pool:
        pending = collections.deque()
        try:
            for batch in batches:
                if len(pending) >= 2 * workers:
                    yield from pending.popleft().result()
                pending.append(pool.submit(_prepare_all, batch, transcode))
            while pending:
                yield from pending.popleft().result()
        except concurrent.futures.process.BrokenProcessPool:
            raise RuntimeError("a worker process died (out of memory?); try fewer --workers") from None
        finally:
            for future in pending:
                future.cancel()


def pack(src: str, dst: str, shard_size: int, seed: int = 0, shuffle: bool = True, progress: bool = True,
         transcode: bool = True, workers: int | None = None) -> tuple[list[pathlib.Path], dict[str, int]]:
    """Writes the shards; returns their paths and how many files had each of OUTCOMES.
    ``transcode``: rewrite JPEGs losslessly (see above). If it fails or is interrupted, what
    it wrote is removed."""
    if shard_size <= 0:
        raise ValueError(f"shard_size={shard_size}: expected a positive number of bytes")
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers={workers}: expected at least 1")
    source = ImageFolderShard(pathlib.Path(src))
    out = pathlib.Path(dst)
    if out.exists() and any(out.iterdir()):
        # A server reads every .tar in a folder: packing next to other files would mix datasets.
        raise FileExistsError(f"{out} is not empty; choose a new or empty folder for the shards")
    made_folder = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    paths: list[pathlib.Path] = []
    try:
        counts = _write_shards(source, out, shard_size, seed, shuffle, progress, transcode, workers, paths)
    except BaseException:
        for path in paths:
            path.unlink(missing_ok=True)
            path.with_name(path.name + INDEX_SUFFIX).unlink(missing_ok=True)
        (out / CLASSES_FILE).unlink(missing_ok=True)
        if made_folder:
            out.rmdir()
        raise
    return paths, counts


def _write_shards(source: ImageFolderShard, out: pathlib.Path, shard_size: int, seed: int, shuffle: bool,
                  progress: bool, transcode: bool, workers: int, paths: list[pathlib.Path]) -> dict[str, int]:
    order = np.random.default_rng(seed).permutation(len(source)) if shuffle else np.arange(len(source))
    (out / CLASSES_FILE).write_text("".join(f"{c}\n" for c in source.class_names))
    counts = dict.fromkeys(OUTCOMES, 0)
    named: dict[str, list[str]] = {outcome: [] for outcome in OUTCOMES}  # the first five of each
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(source), unit="img", desc=f"packing into {out}", file=sys.stderr)
    tar = None
    written = 0
    prepared = _prepared([source.locate(index).path for index in order.tolist()], transcode, workers)
    try:
        for index, (data, outcome, why) in zip(order.tolist(), prepared):
            key = source.key(index)
            counts[outcome] += 1
            if len(named[outcome]) < 5:
                named[outcome].append(f"{key} ({why})")
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
        prepared.close()  # stops the worker processes, also on an error or Ctrl-C
        if tar is not None:
            tar.close()
        if bar is not None:
            bar.close()
    names = list(source.class_names)
    for path in paths:  # the sidecar indexes: servers start without scanning the tars
        TarShard(path, names)

    def listed(outcome: str) -> str:
        return "; ".join(named[outcome]) + (" ..." if counts[outcome] > 5 else "")

    if counts["unreadable"]:
        print(f"remoteloader pack: warning: {counts['unreadable']} file(s) have no readable image header; they are "
              f"packed as they are and will fail when served: {listed('unreadable')}", file=sys.stderr)
    if counts["not rewritten"]:
        print(f"remoteloader pack: warning: libjpeg would not rewrite {counts['not rewritten']} JPEG(s), most "
              f"likely damaged (a server fails those when it decodes them whole); packed as they are: "
              f"{listed('not rewritten')}", file=sys.stderr)
    if transcode and _jpeg is None:
        print("remoteloader pack: warning: files copied as they are: the native JPEG module was not built "
              "(see setup.py), so servers will decode each JPEG's rows down to the crop", file=sys.stderr)
    elif transcode and counts["copied"]:
        print(f"remoteloader pack: {counts['copied']} file(s) copied as they are, with nothing to gain from "
              f"rewriting: {listed('copied')}", file=sys.stderr)
    return counts


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def run(args: argparse.Namespace) -> int:
    try:
        paths, counts = pack(args.src, args.dst, args.shard_size, args.seed, not args.no_shuffle,
                             progress=not args.quiet, transcode=not args.verbatim, workers=args.workers)
    except KeyboardInterrupt:
        print(f"\nremoteloader pack: interrupted; removed the shards written to {args.dst}", file=sys.stderr)
        return 130
    except (OSError, ValueError, RuntimeError) as exc:  # CatalogError is a ValueError
        print(f"remoteloader pack: error: {exc}", file=sys.stderr)
        return 2
    total = sum(p.stat().st_size for p in paths)
    rewritten = f"; {counts['rewritten']} of {sum(counts.values())} files rewritten losslessly" if not args.verbatim else ""
    print(f"wrote {len(paths)} shard(s), {total / 1e6:.1f} MB, to {args.dst}{rewritten}")
    return 0
