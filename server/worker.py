"""The body of one decode/augment worker process (see workers.WorkerPool)."""

from __future__ import annotations

import mmap
import os
import signal
from collections import OrderedDict

import cv2
import numpy as np

from remoteloader.server.decode import DecodeError
from remoteloader.server.pipelines import Pipeline, PipelineError, PipelineSpec

_MAX_PIPELINES = 16
_MAX_FILE_BYTES = 256 << 20


def read_sample(path: str, offset: int, length: int) -> tuple[bytes, int]:
    """Reads ``length`` bytes at ``offset`` (a whole file when offset is 0 and it has that size).

    Returns them with the file's modification time (ns).
    """
    if length > _MAX_FILE_BYTES:
        raise DecodeError(f"sample is {length} bytes, over the limit of {_MAX_FILE_BYTES}")
    with open(path, "rb") as f:
        mtime_ns = os.fstat(f.fileno()).st_mtime_ns
        if offset:
            f.seek(offset)
        data = f.read(length + 1 if offset == 0 else length)
    if len(data) != length:
        raise DecodeError(f"file changed since the server indexed it: read {len(data)} bytes, expected {length}")
    return data, mtime_ns


def main(tasks, results, arena_fd: int, cache_fd: int | None, slots: int, slot_bytes: int, allow_custom: bool,
         max_pixels: int, cache_bytes: int, region_decode: bool, indexed_ns: int) -> None:
    # The parent owns shutdown: Ctrl-C and SIGTERM go to it, and it tells us to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    cv2.setNumThreads(1)
    arena = mmap.mmap(arena_fd, slots * slot_bytes)
    os.close(arena_fd)
    cache = None
    if cache_fd is not None:
        cache = mmap.mmap(cache_fd, cache_bytes)
        os.close(cache_fd)
    pipelines: OrderedDict[tuple, Pipeline | str] = OrderedDict()
    specs: dict[int, tuple] = {}
    while True:
        try:
            message = tasks.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        if message[0] == "spec":  # a pipeline spec, sent once, named by its id in tasks
            specs[message[1]] = message[2]
            continue
        if message[0] == "forget":
            specs.clear()
            continue
        task_id, slot, first, spec_id, locations, seeds = message
        spec = specs[spec_id]
        name, height, width, albu_json = spec
        pipeline = pipelines.get(spec)
        if pipeline is not None:
            pipelines.move_to_end(spec)
        else:
            try:
                pipeline = Pipeline(PipelineSpec(name, height, width, albu_json), allow_custom, max_pixels,
                                    region_decode)
            except PipelineError as exc:
                pipeline = f"pipeline error: {exc}"
            pipelines[spec] = pipeline
            if len(pipelines) > _MAX_PIPELINES:
                pipelines.popitem(last=False)
        out = np.ndarray((len(locations), height, width, 3), np.uint8,
                         buffer=arena, offset=slot * slot_bytes + first * height * width * 3)
        errors = []
        for i, ((path, offset, length, cache_mode, cache_offset, verified), seed) in enumerate(zip(locations, seeds)):
            try:
                if isinstance(pipeline, str):
                    raise DecodeError(pipeline)
                if cache_mode == 2:  # the very bytes that decoded before, if verified
                    data = cache[cache_offset:cache_offset + length]
                else:
                    data, mtime_ns = read_sample(path, offset, length)
                    # A file written since the server indexed it may differ from the bytes that
                    # decoded whole before (same length, new content): decode it whole again.
                    verified = verified and mtime_ns < indexed_ns
                    if cache_mode == 1:
                        cache[cache_offset:cache_offset + length] = data
                out[i] = pipeline(data, seed, verified=verified)
            except (DecodeError, OSError) as exc:
                out[i] = 0
                errors.append((i, str(exc)))
            except Exception as exc:  # a transform failing on odd input must not kill the worker
                out[i] = 0
                errors.append((i, f"{type(exc).__name__}: {exc}"))
        del out
        results.send((task_id, errors))
