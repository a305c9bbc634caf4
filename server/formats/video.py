"""Video folders: ``DIR/<class>/<video>`` (.mp4 .mkv .webm .avi .mov), one sample per video, labels
in the sorted order of the class folders (as an ImageFolder's).

Each video is indexed once (``video_decode.index_video``: its frames, timestamps and keyframes,
read from its packets without decoding) and the result kept in one file for the folder,
``.remoteloader-video-index.npz`` beside the class folders, or in the index folder (--cache-dir)
where the data cannot be written: a later start re-reads only the videos whose size or time
changed. A video that cannot be read is kept as a sample that fails with the reason when served
(one start-up warning names how many and which); the server serves the rest. Audio is ignored.

In an object store the folder is listed, not read, at start (indexing would download every
video): each video is indexed by the worker that first decodes it, as a tar's video members
are, and one that cannot be read fails with the reason when served.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import pathlib
import time

import numpy as np

from remoteloader.server.catalog import CatalogError, KeyTable, Location, Shard, utf8, warn_shard
from remoteloader.server.formats import PROGRESS_SECONDS, FormatOptions, Found
from remoteloader.server.storage import Storage
from remoteloader.server.video_decode import VIDEO_EXTENSIONS

log = logging.getLogger(__name__)

INDEX_FILE = ".remoteloader-video-index.npz"
_INDEX_VERSION = 1


class VideoFolderShard(Shard):
    """``root/<class>/<video>``: one sample per video file; ``frames`` holds each video's frame
    count (0 for one that cannot be read, which fails with its reason when served, and for every
    video in an object store, whose frames are counted when first decoded)."""

    def __init__(self, storage: Storage, name: str, options: FormatOptions):
        root = storage.location(name)
        self._base = root + "/"
        self.storage, self.remote = storage, storage.remote
        classes = [c for c in storage.children(name)[0] if not c.startswith(".")]
        files: list[tuple[str, int, int, int]] = []  # (key, label, size, mtime_ns: 0 in a store)
        for label, cls in enumerate(classes):
            for entry in storage.children(storage.join(name, cls))[1]:
                file = entry.name.rpartition("/")[2]
                if file.lower().endswith(VIDEO_EXTENSIONS) and utf8(f"{cls}/{file}"):
                    mtime = 0 if storage.remote else os.stat(self._base + f"{cls}/{file}").st_mtime_ns
                    files.append((f"{cls}/{file}", label, entry.size, mtime))
        if not files:
            raise CatalogError(f"{root} holds no videos ({', '.join(VIDEO_EXTENSIONS)}) in class folders")
        if storage.remote:
            log.info("%s: %s videos, each indexed when first decoded (an object store's)", root, f"{len(files):,}")
            frames, errors = np.zeros(len(files), np.int64), [""] * len(files)
        else:
            frames, errors = _index_all(root, files, options.index_folder)
        table = KeyTable()
        digest = hashlib.sha256(("\0".join(classes) + "\n").encode("utf-8", "surrogateescape"))
        for key, label, size, _ in files:
            table.add(key, label, 0, size)
            digest.update(f"{key}\0{size}\n".encode())
        self.frames = frames
        failed = {i: f"{files[i][0]}: {error}" for i, error in enumerate(errors) if error}
        if failed:
            self.failed = failed
            warn_shard(
                log,
                "video folders hold videos that cannot be read: each fails with the reason when served",
                f"{root} ({len(failed)})",
                f"{root}: {len(failed)} of {len(files)} video(s) cannot be read and fail with the reason when "
                f"served, e.g. {'; '.join(list(failed.values())[:3])}",
            )
        super().__init__(name.rpartition("/")[2] or root, table, classes, "vf-" + digest.hexdigest()[:24])

    def locate(self, index: int) -> Location:
        return Location(self._base + self.key(index), 0, int(self._sizes[index]))


def _index_all(root: str, files: list[tuple[str, int, int, int]], index_folder: str) -> tuple[np.ndarray, list[str]]:
    """Each video's frame count and error ("" when it reads), from the kept index where the file's
    size and time still match, else read now (and the index kept again)."""
    from remoteloader.server.video_decode import VideoError, index_video

    kept_at = _kept_paths(root, index_folder)
    kept = _load(kept_at)
    frames = np.zeros(len(files), np.int64)
    errors: list[str] = []
    started = said = time.perf_counter()
    scanned = 0
    for i, (key, _, size, mtime) in enumerate(files):
        known = kept.get(key)
        if known is not None and known[:2] == (size, mtime):
            frames[i] = known[2]
            errors.append(known[3])
            continue
        try:
            frames[i] = len(index_video(root + "/" + key))
            errors.append("")
        except VideoError as exc:
            errors.append(str(exc))
        scanned += 1
        now = time.perf_counter()
        if now - said >= PROGRESS_SECONDS:
            said = now
            log.info(
                "indexing videos in %s: %s of %s so far, %.0fs", root, f"{i + 1:,}", f"{len(files):,}", now - started
            )
    if scanned:
        _save(kept_at, files, frames, errors)
    log.info(
        "%s: %s videos, %s frames, in %.1fs (%s read, %s from the kept index)",
        root,
        f"{len(files):,}",
        f"{int(frames.sum()):,}",
        time.perf_counter() - started,
        f"{scanned:,}",
        f"{len(files) - scanned:,}",
    )
    return frames, errors


def _kept_paths(root: str, index_folder: str) -> list[pathlib.Path]:
    """Where the folder's index may be kept, in order: beside its class folders, the index folder."""
    paths = [pathlib.Path(root) / INDEX_FILE]
    if index_folder:
        name = hashlib.sha256(os.path.abspath(root).encode("utf-8", "surrogateescape")).hexdigest()[:24]
        paths.append(pathlib.Path(index_folder) / f"video-{name}.npz")
    return paths


def _load(paths: list[pathlib.Path]) -> dict[str, tuple[int, int, int, str]]:
    """The kept index: key -> (size, mtime_ns, frames, error); {} where none can be read."""
    for path in paths:
        try:
            with np.load(path, allow_pickle=False) as kept:
                if int(kept["version"]) != _INDEX_VERSION:
                    continue
                keys = bytes(kept["keys"]).decode().split("\0")
                errors = bytes(kept["errors"]).decode().split("\0")
                numbers = kept["numbers"]
                return {k: (int(n[0]), int(n[1]), int(n[2]), e) for k, n, e in zip(keys, numbers, errors)}
        except (OSError, KeyError, ValueError, UnicodeDecodeError):
            continue
    return {}


def _save(paths: list[pathlib.Path], files, frames: np.ndarray, errors: list[str]) -> None:
    """Keeps the index at the first of ``paths`` that can be written (a warning where none can)."""
    buffer = io.BytesIO()
    numbers = np.asarray([(size, mtime, n) for (_, _, size, mtime), n in zip(files, frames)], np.int64)
    np.savez(
        buffer,
        version=np.int64(_INDEX_VERSION),
        keys=np.frombuffer("\0".join(f[0] for f in files).encode(), np.uint8),
        errors=np.frombuffer("\0".join(errors).encode(), np.uint8),
        numbers=numbers,
    )
    failure: OSError | None = None
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + f".{os.getpid()}.partial")
            partial.write_bytes(buffer.getvalue())
            os.replace(partial, path)
            return
        except OSError as exc:
            failure = exc
    log.warning(
        "%s: the video index cannot be kept (%s): the videos are read again at every start; give the server "
        "a writable --cache-dir",
        paths[0].parent,
        failure.strerror if failure else "",
    )


def holds_videos(storage: Storage, name: str) -> bool:
    """Whether a folder's class folders hold video files (the first class folder that holds files decides)."""
    for cls in storage.children(name)[0]:
        if cls.startswith("."):
            continue
        files = [e.name.lower() for e in storage.children(storage.join(name, cls))[1]]
        if files:
            return any(f.endswith(VIDEO_EXTENSIONS) for f in files)
    return False


def shards_at(storage: Storage, name: str, found: Found, options: FormatOptions) -> list[Shard] | None:
    """A folder whose class folders hold videos."""
    if found.kind != "folder" or not holds_videos(storage, name):
        return None
    try:
        import av  # noqa: F401
    except ImportError:
        raise CatalogError(
            f"{storage.location(name)} holds videos: this server reads them with PyAV, which is not installed "
            f"(pip install 'remoteloader[video]')"
        ) from None
    return [VideoFolderShard(storage, name, options)]
