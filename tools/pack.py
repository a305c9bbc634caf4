"""``remoteloader pack SRC DST``: write WebDataset tar shards from an ImageFolder tree or a COCO file.

From an ImageFolder tree, each sample becomes ``<class>/<file>`` (under its ImageFolder key)
and ``<class>/<stem>.cls`` (its label as decimal text). From a COCO annotation ``.json`` (its
images under ``--image-root``, default its folder), each image becomes ``<stem>.<ext>`` (under
its ``file_name``, the key a server on the COCO file gives it) and ``<stem>.json``: the targets
that server reads from the file (``server/formats/coco.py``: pascal_voc boxes in pixels, labels 1..C,
crowds and boxes of no area left out), as ``{"bboxes": [[x1, y1, x2, y2], ...], "bbox_labels":
[...], "keypoints": [[x, y, v], ...]}`` with only the fields the sample has; with ``--masks``,
also ``<stem>.mask.png``, the semantic mask drawn from its segmentations at the image's own size
(a class id per pixel, 255 for crowds and overlaps: ``targets.draw_regions``). ``classes.txt``
then starts with "background", so servers on the tars and on the COCO file report the same
class names and labels. One thing does not carry over: which box each person keypoint belongs
to (a server on the COCO file drops a box's keypoints with it when a crop drops the box); a
tar's ``.json`` cannot say it, so a server on the tars keeps such keypoints (with visibility
0 where they fall outside the output). Images whose annotations cannot be used (an unknown
category, a NaN...) are left out with a warning.

Samples are written in a seeded random order so every shard mixes all classes; beside each
tar, ``<tar>.index.npz`` holds its index so servers start without scanning it, and
``classes.txt`` beside the shards names the labels. Reading one large file by offset is much
faster than opening many small files on real disks.

JPEGs are rewritten losslessly unless ``--verbatim``: the same DCT coefficients, so the same
pixels, as baseline with optimized Huffman tables and a restart marker after every MCU
(``decode.transcode_jpeg``, as ``jpegtran -copy all -optimize -restart 1B`` would). The server then
decodes only the MCUs a random crop covers (``decode.decode_crop``): for ImageNet-sized
photos and RandomResizedCrop, a quarter less decoding per image than the region decoder on
the original files. Whole decodes of rewritten files cost about 8% more. Progressive JPEGs
become baseline. What cannot or need not be rewritten (PNGs, CMYK, damaged JPEGs) is copied
as it is.

A folder of class folders of videos (``SRC/<class>/<video>``, .mp4 .mkv .webm .avi .mov: a
folder a server serves as videos, docs/video.md) packs the same way: each video becomes
``<class>/<file>``, its bytes as they are (never re-encoded), and ``<class>/<stem>.cls``. Each
video is indexed first as a server indexes it (which keeps the folder's video index beside its
class folders, as a server would); one that cannot be read is packed as it is, with a warning,
and fails with its reason when served, as from the folder.

Everything pack uses of the server comes from ``remoteloader.server.packing``.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import concurrent.futures
import contextlib
import dataclasses
import io
import itertools
import json
import logging
import multiprocessing
import os
import pathlib
import re
import shutil
import signal
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Iterator

import cv2
import numpy as np
import simplejpeg

from remoteloader.protos import loader_pb2
from remoteloader.server.packing import (
    CLASSES_FILE,
    IMAGE_EXTENSIONS,
    INDEX_SUFFIX,
    MASK_SUFFIX,
    MAX_JSON_BYTES,
    VIDEO_EXTENSIONS,
    CocoShard,
    DecodeError,
    FormatOptions,
    ImageFolderShard,
    Shard,
    Storage,
    TargetError,
    VideoFolderShard,
    arrays_of,
    can_transcode,
    default_workers,
    draw_regions,
    from_source,
    holds_videos,
    index_tar,
    is_remote,
    open_shards,
    open_storage,
    read_sample,
    read_size,
    transcode_jpeg,
)
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
    parser.add_argument(
        "src",
        help="ImageFolder tree (SRC/<class>/<image>), video folder (SRC/<class>/<video>: packed as they are), "
        "or a COCO annotation file (instances_*.json, ...)",
    )
    parser.add_argument(
        "dst",
        help="output folder, or object-store prefix (s3://bucket/prefix, gs://, az://; credentials from the "
        "standard variables), for shard-NNNNN.tar, their indexes and classes.txt",
    )
    parser.add_argument(
        "--shard-size", type=parse_size, default=parse_size("256MB"), help="target bytes per tar shard (default 256MB)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample order (mixes classes across shards)")
    parser.add_argument(
        "--no-shuffle", action="store_true", help="keep the source's order (ImageFolder: by class; COCO: by image id)"
    )
    parser.add_argument(
        "--verbatim",
        action="store_true",
        help="copy every file byte for byte; by default JPEGs are rewritten losslessly (same "
        "pixels) with a restart marker per MCU, so servers decode only a crop's blocks",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes rewriting JPEGs and drawing masks (default: the usable cores)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--image-root",
        default="",
        help="COCO source: the folder of its images (IMAGE_ROOT/file_name; default: the folder the .json is in)",
    )
    parser.add_argument(
        "--masks",
        action="store_true",
        help="COCO source: also write <stem>.mask.png, its segmentations drawn as a class id per pixel "
        "(255: crowd or overlap), what a server started with --coco-masks serves",
    )


# What pack did with a sample: rewrote its file; copied it (a PNG, CMYK, data after the image...
# or --verbatim); copied it because libjpeg would not rewrite it (damaged, most likely: a warning);
# copied a file whose header is unreadable (it fails when served: a warning); left out a file it
# could not read at all (a warning); or left out a sample whose annotations cannot be used (a
# COCO source: an unknown category, a NaN, an RLE mask not of the image's size...: a warning).
OUTCOMES = ("rewritten", "copied", "not rewritten", "unreadable", "left out", "bad targets")


@dataclasses.dataclass
class PackReport:
    paths: list[pathlib.Path]  # the shards written (to an object store: staged here, then uploaded)
    counts: dict[str, int]  # samples by outcome (OUTCOMES)
    bytes: int = 0  # of the shards
    rewritten_before: int = 0  # bytes of the rewritten files, before and after
    rewritten_after: int = 0
    videos: bool = False  # the source is a video folder (nothing to rewrite)


# What prepare() makes of a file: its bytes for the shard (None: leave it out), its outcome, why, its size as read.
Prepared = tuple[bytes | None, str, str, int]


def prepare(where: str | tuple[str, int, int], transcode: bool = True) -> Prepared:
    """A sample's bytes for the shard (None: leave it out), its outcome (one of OUTCOMES), why,
    and its size as read; ``where``: a file, or (file, offset, length) as a shard locates it."""
    try:
        if isinstance(where, str):
            data = pathlib.Path(where).read_bytes()
        else:
            data, _ = read_sample(*where)  # (a range of a TFRecord file, an LMDB's data.mdb...)
    except (OSError, DecodeError) as exc:  # one unreadable file must not end a run of hours
        return None, "left out", f"cannot read it: {getattr(exc, 'strerror', None) or exc}", 0
    if (where if isinstance(where, str) else where[0]).lower().endswith(VIDEO_EXTENSIONS):
        return data, "copied", "a video, packed as it is", len(data)  # (its index said whether it reads)
    try:  # the header only (a full decode would cost ~1 ms per image)
        fmt, height, width = read_size(data, max_pixels=1 << 62)
    except DecodeError as exc:
        return data, "unreadable", str(exc), len(data)
    if not transcode or not can_transcode():
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
        rewritten = transcode_jpeg(data, TRANSCODE_MAX_PIXELS)
    except ValueError as exc:
        return data, "not rewritten", f"libjpeg: {exc}", len(data)
    if rewritten is None:
        return data, "copied", "data after the image (an MPF part or a motion photo?)", len(data)
    return rewritten, "rewritten", "", len(data)


# A sample to prepare: where its bytes are (file, offset, length), and (--masks) its serialized
# loader_pb2.Targets, whose regions become its mask; None: no mask.
Job = tuple[tuple[str, int, int], bytes | None]
# What prepare_sample() makes of a Job: prepare()'s answer, the mask as a PNG (None: no mask),
# and why the mask cannot be drawn ("": it can).
PreparedSample = tuple[Prepared, bytes | None, str]


def prepare_sample(where: tuple[str, int, int], regions: bytes | None, transcode: bool = True) -> PreparedSample:
    """prepare() of the file and, when ``regions`` holds a Targets record, the semantic mask of
    its regions at the image's size as a PNG: what a server on the COCO file draws
    (``targets.draw_regions``)."""
    prepared = prepare(where, transcode)
    data, outcome = prepared[0], prepared[1]
    if regions is None or data is None or outcome == "unreadable":  # no size to draw at: it fails when served
        return prepared, None, ""
    _, height, width = read_size(data, max_pixels=1 << 62)
    try:
        mask = draw_regions(loader_pb2.Targets.FromString(regions).regions, height, width)
    except TargetError as exc:
        return prepared, None, f"its mask: {exc}"
    ok, png = cv2.imencode(".png", mask)
    if not ok:
        return prepared, None, f"its {width}x{height} mask does not encode as a PNG"
    return prepared, png.tobytes(), ""


def _prepare_all(jobs: list[Job], transcode: bool) -> list[PreparedSample]:
    return [prepare_sample(where, regions, transcode) for where, regions in jobs]


def _start_worker(parent: int) -> None:
    """Worker processes ignore Ctrl-C and SIGTERM (they are born ignoring them: see _Preparer):
    the main process stops them. They die with it even when it is killed."""
    signals.die_with_parent(signal.SIGKILL, parent)


class _Preparer:
    """prepare_sample() of every job, in order: in worker processes when there is rewriting or
    mask drawing to do, with at most a few batches of files in flight (bounded memory whatever
    the disk's speed)."""

    BATCH = 8

    def __init__(self, transcode: bool, workers: int, masks: bool = False):
        self.transcode = transcode
        self.pool = None
        if (transcode and can_transcode() or masks) and workers > 1:
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

    def results(self, jobs: Iterable[Job]) -> Iterator[PreparedSample]:
        """Takes the jobs as it goes: a few batches' worth of their targets in memory at a time."""
        pending_jobs = iter(jobs)
        batches = iter(lambda: list(itertools.islice(pending_jobs, self.BATCH)), [])
        if self.pool is None:
            for batch in batches:
                yield from _prepare_all(batch, self.transcode)
            return
        pending: collections.deque[concurrent.futures.Future[list[PreparedSample]]] = collections.deque()
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
    image_root: str = "",
    masks: bool = False,
) -> PackReport:
    """Writes the shards. ``transcode``: rewrite JPEGs losslessly (see above). ``src``: an
    ImageFolder tree or a COCO annotation ``.json`` (``image_root``: where its images are,
    default its folder; ``masks``: write each sample's semantic mask). If it fails or is
    interrupted, what it wrote is removed, folders it made included."""
    if shard_size <= 0:
        raise ValueError(f"shard_size={shard_size}: expected a positive number of bytes")
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers={workers}: expected at least 1")
    if is_remote(src):
        raise ValueError(
            f"{src}: pack reads its source from this machine; copy it here first (its output may go to a store)"
        )
    with _server_warnings_left_out():
        if _is_coco(src):
            source: Shard = _coco_source(src, image_root, masks)
        else:
            source = _image_folder_source(src, dst, image_root, masks)
        report = PackReport([], dict.fromkeys(OUTCOMES, 0), videos=isinstance(source, VideoFolderShard))
        transcode = transcode and not report.videos  # (no worker processes just to copy videos)
        upload = _Upload.to(dst) if is_remote(dst) else None
        out = pathlib.Path(upload.staging if upload is not None else dst)
        if upload is None and out.exists() and any(out.iterdir()):
            # A server reads every .tar in a folder: packing next to other files would mix datasets.
            raise FileExistsError(f"{out} is not empty; choose a new or empty folder for the shards")
        made = [d for d in (out, *out.parents) if not d.exists()]  # innermost first
        out.mkdir(parents=True, exist_ok=True)
        preparer = None
        try:
            preparer = _Preparer(transcode, workers, masks)
            _write_shards(
                source, out, shard_size, seed, shuffle, progress, transcode, masks, preparer, report, upload, dst
            )
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
                if upload is not None:
                    upload.undo()
            raise
        preparer.stop()
    return report


class _Upload:
    """Shards written to an object store: each tar and its index are staged in a temporary
    folder, uploaded as soon as the tar is complete and removed from it, so the staging never
    holds more than one shard."""

    def __init__(self, storage: Storage, prefix: str):
        self.storage, self.prefix = storage, prefix
        self.staging = tempfile.mkdtemp(prefix="remoteloader-pack-")
        self.uploaded: list[str] = []

    @classmethod
    def to(cls, dst: str) -> _Upload:
        storage, prefix = open_storage(dst)
        try:
            storage.children(prefix)
        except FileNotFoundError:
            return cls(storage, prefix)
        raise FileExistsError(f"{dst} is not empty; choose a new or empty prefix for the shards")

    def file(self, path: pathlib.Path) -> None:
        """Uploads a staged file beside the others, then removes it from the staging."""
        name = self.storage.join(self.prefix, path.name)
        self.storage.upload(name, path)
        self.uploaded.append(name)
        path.unlink()

    def undo(self) -> None:
        """Removes what was uploaded and the staging (after a failure or an interruption)."""
        for name in self.uploaded:
            with contextlib.suppress(OSError):
                self.storage.delete(name)
        shutil.rmtree(self.staging, ignore_errors=True)


def _is_coco(src: str) -> bool:
    return pathlib.Path(src).suffix.lower() == ".json" and not pathlib.Path(src).is_dir()


def _coco_source(src: str, image_root: str, masks: bool) -> CocoShard:
    if image_root and not os.path.isdir(image_root):
        raise ValueError(f"--image-root {image_root}: no such folder")
    return CocoShard(*open_storage(src), image_root, masks)


def _image_folder_source(src: str, dst: str, image_root: str, masks: bool) -> Shard:
    if image_root or masks:
        raise ValueError(
            f"--image-root and --masks are for a COCO annotation .json source; {src} is not one (an ImageFolder "
            f"tree's labels come from its folders)"
        )
    source_dir, out_dir = pathlib.Path(src).resolve(), pathlib.Path(dst).resolve()
    if out_dir == source_dir or source_dir in out_dir.parents:
        # Its folder would become a class of the source, and the source changes while it is read.
        where = "the source" if out_dir == source_dir else "inside the source"
        raise ValueError(f"the output folder {dst} is {where} {src}; choose one outside it")
    if out_dir in source_dir.parents:
        raise ValueError(
            f"the source {src} is inside the output folder {dst}; choose a new or empty folder outside the source"
        )
    if pathlib.Path(src).is_dir() and any(pathlib.Path(src).glob("*.tar")) or src.endswith(".tar"):
        raise ValueError(
            f"{src} holds .tar files: pack reads an ImageFolder (SRC/<class>/<image>), a COCO annotation .json, "
            f"a TFRecord file, an LMDB database or a Parquet file; servers read tar shards as they are"
        )
    if pathlib.Path(src).is_dir() and holds_videos(*open_storage(src)):
        return _video_source(src)
    if pathlib.Path(src).is_dir() and not _other_format(src):
        return ImageFolderShard(*open_storage(src), tars_too=False)
    # A TFRecord file, an LMDB database, a Parquet file: as a server reads it (a Parquet file's
    # images are extracted into a temporary folder first, as a server's --cache-dir holds them).
    scratch = tempfile.mkdtemp(prefix="remoteloader-pack-source-")
    atexit.register(shutil.rmtree, scratch, True)
    shards = open_shards([src], FormatOptions(index_folder=os.path.join(scratch, "indexes")))
    if len(shards) != 1:
        raise ValueError(f"{src} holds {len(shards)} shard files: pack one file (or database) at a time")
    return shards[0]


def _video_source(src: str) -> Shard:
    """A folder of class folders of videos, opened (and its videos indexed) as a server opens it."""
    scratch = tempfile.mkdtemp(prefix="remoteloader-pack-source-")
    atexit.register(shutil.rmtree, scratch, True)
    (shard,) = open_shards([src], FormatOptions(index_folder=os.path.join(scratch, "indexes")))
    return shard


def _other_format(src: str) -> bool:
    """Whether a folder is an LMDB database or holds TFRecord or Parquet files (not an ImageFolder)."""
    names = [p.name.lower() for p in pathlib.Path(src).iterdir() if p.is_file()]
    return "data.mdb" in names or any(n.endswith((".tfrecord", ".tfrecords", ".record", ".parquet")) for n in names)


class _ForServers(logging.Filter):
    """Leaves out CocoShard's warnings that COCO samples "fail when served": pack leaves those
    out instead, and says so itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "fail when served" not in str(record.msg)


@contextlib.contextmanager
def _server_warnings_left_out() -> Iterator[None]:
    logger = logging.getLogger(CocoShard.__module__)
    quiet = _ForServers()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _write_shards(
    source: Shard,
    out: pathlib.Path,
    shard_size: int,
    seed: int,
    shuffle: bool,
    progress: bool,
    transcode: bool,
    masks: bool,
    preparer: _Preparer,
    report: PackReport,
    upload: _Upload | None = None,
    dst: str = "",
) -> None:
    """Each sample's members: its image under its key; its label (``.cls``) when it has one; its
    targets (``.json``) and, ``masks``, its mask (``.mask.png``) when its source has targets.
    Each tar gets its index as soon as it is complete (and goes to ``upload``'s store, if given)."""
    order = np.random.default_rng(seed).permutation(len(source)) if shuffle else np.arange(len(source))
    (out / CLASSES_FILE).write_text(_classes_text(source.class_names))
    counts, paths = report.counts, report.paths
    named: dict[str, list[str]] = {outcome: [] for outcome in OUTCOMES}  # the first five of each

    def note(outcome: str, key: str, why: str) -> None:
        counts[outcome] += 1
        if len(named[outcome]) < 5:
            named[outcome].append(f"{key} ({why})")

    samples = []
    for index in order.tolist():
        record = source.targets(index)
        error = loader_pb2.Targets.FromString(record).error if record else ""
        if error and source.locate(index).length:  # its annotations, not its file (missing: CocoShard says so)
            note("bad targets", source.key(index), error)
            continue
        samples.append(index)

    def job(index: int) -> Job:  # made as the preparer takes it: not every sample's regions at once
        record = source.targets(index) if masks else b""
        location = source.locate(index)
        regions = record if record and not loader_pb2.Targets.FromString(record).error else None
        return (location.path, location.offset, location.length), regions

    bar = None
    if progress:
        from tqdm import tqdm

        unit = "video" if report.videos else "img"
        bar = tqdm(total=len(samples), unit=unit, desc=f"packing into {dst or out}", file=sys.stderr)
    tar = None
    written = 0
    rewritten: list[bool] = []  # the current tar's samples, in order: rewritten losslessly
    try:
        for index, ((data, outcome, why, size), mask, mask_error) in zip(samples, preparer.results(map(job, samples))):
            signals.raise_if_stopped()
            key = source.key(index)
            if bar is not None:
                bar.update(1)
            if report.videos and data is not None and source.failure(index):  # as its index found it
                outcome, why = "unreadable", source.failure(index).removeprefix(f"{key}: ")
            members: list[tuple[str, bytes]] = []
            name = _image_name(key, data)
            stem, _ = os.path.splitext(name)
            if data is not None:
                label = int(source.labels[index])
                if label >= 0:
                    members.append((f"{stem}.cls", str(label).encode()))
                record = source.targets(index)
                if record:
                    message = loader_pb2.Targets.FromString(record)
                    problem = mask_error
                    if not problem and message.error and outcome != "unreadable":
                        problem = message.error  # a file missing or empty when indexed, there now
                    if not problem and not message.error:  # (an unreadable image goes without: it fails anyway)
                        text, problem = _targets_json(message)
                        if not problem:
                            members.append((f"{stem}.json", text))
                    if problem:  # left out for its targets, whatever became of its file
                        note("bad targets", key, problem)
                        continue
                if mask is not None:
                    members.append((f"{stem}{MASK_SUFFIX}", mask))
            note(outcome, key, why)
            if data is None:
                continue
            if outcome == "rewritten":
                report.rewritten_before += size
                report.rewritten_after += len(data)
            if tar is None or written >= shard_size:
                if tar is not None:
                    tar.close()
                    _complete(paths[-1], source, report, upload, rewritten)
                paths.append(out / f"shard-{len(paths):05d}.tar")
                # PAX: names of any length (ustar stops at 100-255 bytes), read by any tar reader
                tar = tarfile.open(paths[-1], "w", format=tarfile.PAX_FORMAT)
                written, rewritten = 0, []
            _add(tar, name, data)  # the source's key, so both layouts name samples alike
            rewritten.append(outcome == "rewritten")
            for member, content in members:
                _add(tar, member, content)
            written += len(data) + 1024 + sum(len(content) + 512 for _, content in members)
    finally:
        if tar is not None:
            tar.close()
        if bar is not None:
            bar.close()
    if paths:
        _complete(paths[-1], source, report, upload, rewritten)
    if upload is not None:
        upload.file(out / CLASSES_FILE)
        shutil.rmtree(upload.staging, ignore_errors=True)
    _warn(counts, named, transcode, report.videos)
    if not paths:
        raise ValueError(f"none of the {len(source)} samples could be packed (see the warnings above)")


def _complete(
    path: pathlib.Path, source: Shard, report: PackReport, upload: _Upload | None, rewritten: list[bool]
) -> None:
    """A tar is written: its sidecar index, so that servers start without scanning it (and both
    uploaded, where the shards go to an object store). The index marks the JPEGs rewritten
    losslessly as verified: libjpeg read all of them without a warning, so servers may decode
    only a crop's region of them from the first epoch (Shard.verified)."""
    verified = np.array(rewritten, np.bool_) if any(rewritten) else None
    index_tar(str(path), list(source.class_names), verified)
    report.bytes += path.stat().st_size
    if upload is not None:
        upload.file(path)
        upload.file(path.with_name(path.name + INDEX_SUFFIX))


def _classes_text(names: list[str]) -> str:
    """classes.txt: one name a line, which servers read back stripped, skipping empty lines."""
    unreadable = [n for n in names if [line.strip() for line in f"{n}\n".splitlines() if line.strip()] != [n]]
    if unreadable:
        raise ValueError(
            f"class name(s) {', '.join(map(repr, unreadable[:5]))} cannot be written to {CLASSES_FILE} (one "
            f"name a line, read back stripped, empty lines skipped): a server on the shards would report other "
            f"names or labels; rename them"
        )
    return "".join(f"{n}\n" for n in names)


def _image_name(key: str, data: bytes | None) -> str:
    """The image member's name: the sample's key, with an extension a tar reader takes for an
    image added when it has none (a COCO ``file_name`` need not have one)."""
    if key.lower().endswith(IMAGE_EXTENSIONS + VIDEO_EXTENSIONS) or data is None:
        return key
    return key + (".png" if data.startswith(b"\x89PNG") else ".jpg")


def _targets_json(message: loader_pb2.Targets) -> tuple[bytes, str]:
    """A sample's ``<stem>.json``: its arrays as lists (float32 values as the shortest decimals
    that read back to them), and why a tar reader could not use it ("": it can)."""
    arrays = {name: array for name, array in arrays_of(message).items() if not name.startswith("_")}
    # Internal arrays (_keypoint_box: the box each keypoint belongs to) cannot be named in a tar.
    try:
        text = json.dumps({name: _json_values(a) for name, a in arrays.items()}, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return b"", "its targets hold NaN or infinity"
    data = text.encode()
    if len(data) > MAX_JSON_BYTES:
        return b"", f"its targets take {len(data)} bytes as JSON, over a tar's limit of {MAX_JSON_BYTES}"
    try:
        from_source(json.loads(data))  # what a server on the tars reads
    except TargetError as exc:
        return b"", str(exc)
    return data, ""


def _json_values(array: np.ndarray) -> list:
    if array.dtype != np.float32:
        return array.tolist()
    flat = array.reshape(-1)
    short = np.array([float(str(v)) for v in flat], np.float64) if flat.size else flat.astype(np.float64)
    exact = flat.astype(np.float64)
    return np.where(short.astype(np.float32) == flat, short, exact).reshape(array.shape).tolist()


def _warn(counts: dict[str, int], named: dict[str, list[str]], transcode: bool, videos: bool = False) -> None:
    """One line on stderr per outcome that needs saying, naming its first five files."""

    def listed(outcome: str) -> str:
        return "; ".join(named[outcome]) + (" ..." if counts[outcome] > 5 else "")

    if counts["bad targets"]:
        print(
            f"remoteloader pack: warning: {counts['bad targets']} sample(s) have annotations that cannot be used "
            f"and are left out: {listed('bad targets')}",
            file=sys.stderr,
        )
    if counts["left out"]:
        print(
            f"remoteloader pack: warning: {counts['left out']} file(s) could not be read and are left out: "
            f"{listed('left out')}",
            file=sys.stderr,
        )
    if counts["unreadable"]:
        print(
            f"remoteloader pack: warning: {counts['unreadable']} file(s) "
            f"{'are videos that cannot be read' if videos else 'have no readable image header'}; they are "
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
    if transcode and not can_transcode():
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
                image_root=args.image_root,
                masks=args.masks,
            )
    except (KeyboardInterrupt, signals.Terminated) as exc:
        how = "interrupted" if isinstance(exc, KeyboardInterrupt) else "terminated"
        print(f"\nremoteloader pack: {how}; removed what it had written to {args.dst}", file=sys.stderr)
        return 130 if isinstance(exc, KeyboardInterrupt) else 143
    except (OSError, ValueError, RuntimeError) as exc:  # CatalogError is a ValueError
        print(f"remoteloader pack: error: {exc}", file=sys.stderr)
        return 2
    total = report.bytes
    rewritten = ""
    if not args.verbatim and not report.videos:
        growth = report.rewritten_after / report.rewritten_before - 1 if report.rewritten_before else 0.0
        rewritten = (
            f"; {report.counts['rewritten']} of {sum(report.counts.values()) - report.counts['bad targets']} "
            f"files rewritten "
            f"losslessly ({growth:+.1%} bytes)"
        )
    print(f"wrote {len(report.paths)} shard(s), {total / 1e6:.1f} MB, to {args.dst}{rewritten}")
    return 0
