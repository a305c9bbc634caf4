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
import dataclasses
import io
import multiprocessing
import os
import pathlib
import re
import signal
import sys
import tarfile
from collections.abc import Iterator

import numpy as np
import simplejpeg

from remoteloader.server.catalog import CLASSES_FILE, INDEX_SUFFIX, ImageFolderShard, TarShard
from remoteloader.server.config import default_workers
from remoteloader.server.decode import MAX_SCANS, DecodeError, _jpeg, read_size
from remoteloader.tools import signals

# Rewriting holds all of a JPEG's coefficients in memory (up to 6 bytes a pixel): larger ones are copied.
TRANSCODE_MAX_PIXELS = 64_000_000

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 500MB, 1GiB or 200000")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="ImageFolder tree: SRC/<class>/<image>")
    parser.add_argument("dst", help="output folder for shard-NNNNN.tar and classes.txt")
    parser.add_argument(
        "--shard-size", type=parse_size, default=parse_size("256MB"), help="target bytes per tar shard (default 256MB)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample order (mixes classes across shards)")
    parser.add_argument("--no-shuffle", action="store_true", help="keep the ImageFolder order")
    parser.add_argument(
        "--verbatim",
        action="store_true",
        help="copy every file byte for byte; by default JPEGs are rewritten losslessly (same "
        "pixels) with a restart marker per MCU, so servers decode only a crop's blocks",
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="processes rewriting JPEGs (default: the usable cores)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


# What pack did with a file: rewrote it; copied it (a PNG, CMYK, data after the image... or
# --verbatim); copied it because libjpeg would not rewrite it (damaged, most likely: a warning);
# copied a file whose header is unreadable (it fails when served: a warning); or left out a file
# it could not read at all (a warning).
OUTCOMES = ("rewritten", "copied", "not rewritten", "unreadable", "left out")


@dataclasses.dataclass
class PackReport:
    paths: list[pathlib.Path]  # the shards written
    counts: dict[str, int]  # files by outcome (OUTCOMES)
    rewritten_before: int = 0  # bytes of the rewritten files, before and after
    rewritten_after: int = 0


# What prepare() makes of a file: its bytes for the shard (None: leave it out), its outcome, why, its size as read.
Prepared = tuple[bytes | None, str, str, int]


def prepare(path: str, transcode: bool = True) -> Prepared:
    """A file's bytes for the shard (None: leave it out), its outcome (one of OUTCOMES), why,
    and its size as read."""
    try:
        data = pathlib.Path(path).read_bytes()
    except OSError as exc:  # one unreadable file must not end a run of hours
        return None, "left out", f"cannot read it: {exc.strerror or exc}", 0
    try:  # the header only (a full decode would cost ~1 ms per image)
        fmt, height, width = read_size(data, max_pixels=1 << 62)
    except DecodeError as exc:
        return data, "unreadable", str(exc), len(data)
    if not transcode or _jpeg is None:
        return data, "copied", "not asked" if not transcode else "the native JPEG module was not built", len(data)
    if fmt != "jpeg":
        return data, "copied", "PNG" if fmt == "png" else "lossless or unusual JPEG", len(data)
    if simplejpeg.decode_jpeg_header(data)[2] in ("CMYK", "YCCK"):
        return data, "copied", "CMYK, always decoded whole", len(data)
    if height * width > TRANSCODE_MAX_PIXELS:
        return (
            data,
            "copied",
            (f"{width}x{height}: rewriting one over {TRANSCODE_MAX_PIXELS // 1_000_000} MP would take too much memory"),
            len(data),
        )
    try:
        rewritten = _jpeg.transcode(data, TRANSCODE_MAX_PIXELS, MAX_SCANS)
    except ValueError as exc:
        return data, "not rewritten", f"libjpeg: {exc}", len(data)
    if rewritten is None:
        return data, "copied", "data after the image (an MPF part or a motion photo?)", len(data)
    return rewritten, "rewritten", "", len(data)


def _prepare_all(paths: list[str], transcode: bool) -> list[Prepared]:
    return [prepare(path, transcode) for path in paths]


def _start_worker(parent: int) -> None:
    """Worker processes ignore Ctrl-C and SIGTERM (they are born ignoring them: see _Preparer):
    the main process stops them. They die with it even when it is killed."""
    signals.die_with_parent(signal.SIGKILL, parent)


class _Preparer:
    """prepare() of every path, in order: in worker processes when there is rewriting to do,
    with at most a few batches of files in flight (bounded memory whatever the disk's speed)."""

    BATCH = 8

    def __init__(self, transcode: bool, workers: int):
        self.transcode = transcode
        self.pool = None
        if transcode and _jpeg is not None and workers > 1:
            with signals.signals_ignored():
                self.pool = concurrent.futures.ProcessPoolExecutor(
                    workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start_worker,
                    initargs=(os.getpid(),),
                )
                # A spawn pool starts a process per task submitted while none is idle: all of them now.
                for started in [self.pool.submit(os.getpid) for _ in range(workers)]:
                    started.result()
        self.in_flight = 2 * workers

    def results(self, paths: list[str]) -> Iterator[Prepared]:
        batches = [paths[i : i + self.BATCH] for i in range(0, len(paths), self.BATCH)]
        if self.pool is None:
            for batch in batches:
                yield from _prepare_all(batch, self.transcode)
            return
        pending: collections.deque[concurrent.futures.Future[list[Prepared]]] = collections.deque()
        try:
            for batch in batches:
                if len(pending) >= self.in_flight:
                    yield from pending.popleft().result()
                pending.append(self.pool.submit(_prepare_all, batch, self.transcode))
            while pending:
                yield from pending.popleft().result()
        except concurrent.futures.process.BrokenProcessPool:
            raise RuntimeError("a worker process died (out of memory?); try fewer --workers") from None

    def stop(self) -> None:
        """Ends the worker processes once their current batch is done (killing one mid-way
        could leave the executor waiting for the rest of its result for ever)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


def pack(
    src: str,
    dst: str,
    shard_size: int,
    seed: int = 0,
    shuffle: bool = True,
    progress: bool = True,
    transcode: bool = True,
    workers: int | None = None,
) -> PackReport:
    """Writes the shards. ``transcode``: rewrite JPEGs losslessly (see above). If it fails or
    is interrupted, what it wrote is removed, folders it made included."""
    if shard_size <= 0:
        raise ValueError(f"shard_size={shard_size}: expected a positive number of bytes")
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers={workers}: expected at least 1")
    source_dir, out_dir = pathlib.Path(src).resolve(), pathlib.Path(dst).resolve()
    if out_dir == source_dir or source_dir in out_dir.parents:
        # Its folder would become a class of the source, and the source changes while it is read.
        where = "the source" if out_dir == source_dir else "inside the source"
        raise ValueError(f"the output folder {dst} is {where} {src}; choose one outside it")
    if out_dir in source_dir.parents:
        raise ValueError(
            f"the source {src} is inside the output folder {dst}; choose a new or empty folder outside the source"
        )
    if pathlib.Path(src).is_dir() and any(pathlib.Path(src).glob("*.tar")):
        raise ValueError(
            f"{src} holds .tar files: pack reads an ImageFolder (SRC/<class>/<image>); "
            f"servers read tar shards as they are"
        )
    source = ImageFolderShard(pathlib.Path(src), tars_too=False)
    out = pathlib.Path(dst)
    if out.exists() and any(out.iterdir()):
        # A server reads every .tar in a folder: packing next to other files would mix datasets.
        raise FileExistsError(f"{out} is not empty; choose a new or empty folder for the shards")
    made = [d for d in (out, *out.parents) if not d.exists()]  # innermost first
    out.mkdir(parents=True, exist_ok=True)
    report = PackReport([], dict.fromkeys(OUTCOMES, 0))
    preparer = None
    try:
        preparer = _Preparer(transcode, workers)
        _write_shards(source, out, shard_size, seed, shuffle, progress, transcode, preparer, report)
    except BaseException:
        with signals.signals_ignored():
            if preparer is not None:
                preparer.stop()
            for path in report.paths:
                path.unlink(missing_ok=True)
                path.with_name(path.name + INDEX_SUFFIX).unlink(missing_ok=True)
            (out / CLASSES_FILE).unlink(missing_ok=True)
            for folder in made:
                folder.rmdir()
        raise
    preparer.stop()
    return report


def _write_shards(
    source: ImageFolderShard,
    out: pathlib.Path,
    shard_size: int,
    seed: int,
    shuffle: bool,
    progress: bool,
    transcode: bool,
    preparer: _Preparer,
    report: PackReport,
) -> None:
    order = np.random.default_rng(seed).permutation(len(source)) if shuffle else np.arange(len(source))
    (out / CLASSES_FILE).write_text("".join(f"{c}\n" for c in source.class_names))
    counts, paths = report.counts, report.paths
    named: dict[str, list[str]] = {outcome: [] for outcome in OUTCOMES}  # the first five of each
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(source), unit="img", desc=f"packing into {out}", file=sys.stderr)
    tar = None
    written = 0
    try:
        files = [source.locate(index).path for index in order.tolist()]
        for index, (data, outcome, why, size) in zip(order.tolist(), preparer.results(files)):
            signals.raise_if_stopped()
            key = source.key(index)
            counts[outcome] += 1
            if len(named[outcome]) < 5:
                named[outcome].append(f"{key} ({why})")
            if bar is not None:
                bar.update(1)
            if data is None:
                continue
            if outcome == "rewritten":
                report.rewritten_before += size
                report.rewritten_after += len(data)
            if tar is None or written >= shard_size:
                if tar is not None:
                    tar.close()
                paths.append(out / f"shard-{len(paths):05d}.tar")
                # PAX: names of any length (ustar stops at 100-255 bytes), read by any tar reader
                tar = tarfile.open(paths[-1], "w", format=tarfile.PAX_FORMAT)
                written = 0
            stem, _ = os.path.splitext(key)
            _add(tar, key, data)  # the ImageFolder key, so both layouts name samples alike
            _add(tar, f"{stem}.cls", str(int(source.labels[index])).encode())
            written += len(data) + 1536
    finally:
        if tar is not None:
            tar.close()
        if bar is not None:
            bar.close()
    names = list(source.class_names)
    for path in paths:  # the sidecar indexes: servers start without scanning the tars
        TarShard(path, names)

    _warn(counts, named, transcode)


def _warn(counts: dict[str, int], named: dict[str, list[str]], transcode: bool) -> None:
    """One line on stderr per outcome that needs saying, naming its first five files."""

    def listed(outcome: str) -> str:
        return "; ".join(named[outcome]) + (" ..." if counts[outcome] > 5 else "")

    if counts["left out"]:
        print(
            f"remoteloader pack: warning: {counts['left out']} file(s) could not be read and are left out: "
            f"{listed('left out')}",
            file=sys.stderr,
        )
    if counts["unreadable"]:
        print(
            f"remoteloader pack: warning: {counts['unreadable']} file(s) have no readable image header; they are "
            f"packed as they are and will fail when served: {listed('unreadable')}",
            file=sys.stderr,
        )
    if counts["not rewritten"]:
        print(
            f"remoteloader pack: warning: libjpeg would not rewrite {counts['not rewritten']} JPEG(s), most "
            f"likely damaged (a server fails those when it decodes them whole); packed as they are: "
            f"{listed('not rewritten')}",
            file=sys.stderr,
        )
    if transcode and _jpeg is None:
        print(
            "remoteloader pack: warning: files copied as they are: the native JPEG module was not built "
            "(see setup.py), so servers will decode each JPEG's rows down to the crop",
            file=sys.stderr,
        )
    elif transcode and counts["copied"]:
        print(
            f"remoteloader pack: {counts['copied']} file(s) copied as they are, not rewritten: {listed('copied')}",
            file=sys.stderr,
        )


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def run(args: argparse.Namespace) -> int:
    """The command: 0 when written, 2 on an error (one line), 130 after Ctrl-C and 143 after
    SIGTERM (what it wrote removed either way)."""
    try:
        # The first Ctrl-C or SIGTERM stops pack; a signal its parent made it ignore (a
        # background job's SIGINT) stays ignored.
        with signals.StopSignals(once=True, keep_ignored=True):
            report = pack(
                args.src,
                args.dst,
                args.shard_size,
                args.seed,
                not args.no_shuffle,
                progress=not args.quiet,
                transcode=not args.verbatim,
                workers=args.workers,
            )
    except (KeyboardInterrupt, signals.Terminated) as exc:
        how = "interrupted" if isinstance(exc, KeyboardInterrupt) else "terminated"
        print(f"\nremoteloader pack: {how}; removed what it had written to {args.dst}", file=sys.stderr)
        return 130 if isinstance(exc, KeyboardInterrupt) else 143
    except (OSError, ValueError, RuntimeError) as exc:  # CatalogError is a ValueError
        print(f"remoteloader pack: error: {exc}", file=sys.stderr)
        return 2
    total = sum(p.stat().st_size for p in report.paths)
    rewritten = ""
    if not args.verbatim:
        growth = report.rewritten_after / report.rewritten_before - 1 if report.rewritten_before else 0.0
        rewritten = (
            f"; {report.counts['rewritten']} of {sum(report.counts.values())} files rewritten "
            f"losslessly ({growth:+.1%} bytes)"
        )
    print(f"wrote {len(report.paths)} shard(s), {total / 1e6:.1f} MB, to {args.dst}{rewritten}")
    return 0
