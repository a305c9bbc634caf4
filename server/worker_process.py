"""The body of one decode/augment worker process (started and fed by worker_pool.WorkerPool).

A worker maps the arena (and the sample cache) by descriptor, then renders tasks until its
task pipe closes or says stop: for each sample it reads the bytes (from the file or the
cache), decodes and augments them with the sample's seed, and writes the pixels straight
into the task's place in a slot. It answers each task with its per-sample errors only,
after every sample of the task is written. A sample that fails is zeros plus an error; no
sample, however broken, ends the worker.
"""

from __future__ import annotations

import mmap
import os
import signal
from collections import OrderedDict
from multiprocessing.connection import Connection

import cv2
import numpy as np

from remoteloader.protos import limits
from remoteloader.server.decode import DecodeError
from remoteloader.server.pipelines import Pipeline, PipelineError, PipelineSpec
from remoteloader.server.shared_memory import CACHE_FILL, CACHE_READ

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


def main(
    tasks: Connection,
    results: Connection,
    arena_fd: int,
    cache_fd: int | None,
    slots: int,
    slot_bytes: int,
    allow_custom: bool,
    max_pixels: int,
    cache_bytes: int,
    region_decode: bool,
    indexed_ns: int,
) -> None:
    """Runs the worker until its task pipe closes or sends None (arguments: see WorkerPool._spawn)."""
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
    pipelines = _Pipelines(allow_custom, max_pixels, region_decode)
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
        _, height, width, _ = spec
        out = np.ndarray(
            (len(locations), height, width, limits.CHANNELS),
            np.uint8,
            buffer=arena,
            offset=slot * slot_bytes + first * limits.sample_bytes(height, width),
        )
        errors = _render(pipelines.get(spec), out, locations, seeds, cache, indexed_ns)
        del out
        results.send((task_id, errors))


class _Pipelines:
    """The worker's pipelines by spec, the most recently used ``_MAX_PIPELINES``; a spec that does not
    build is kept as its error message, which each of its samples then reports."""

    def __init__(self, allow_custom: bool, max_pixels: int, region_decode: bool):
        self.allow_custom = allow_custom
        self.max_pixels = max_pixels
        self.region_decode = region_decode
        self._built: OrderedDict[tuple, Pipeline | str] = OrderedDict()

    def get(self, spec: tuple) -> Pipeline | str:
        pipeline = self._built.get(spec)
        if pipeline is not None:
            self._built.move_to_end(spec)
            return pipeline
        try:
            pipeline = Pipeline(PipelineSpec(*spec), self.allow_custom, self.max_pixels, self.region_decode)
        except PipelineError as exc:
            pipeline = f"pipeline error: {exc}"
        self._built[spec] = pipeline
        if len(self._built) > _MAX_PIPELINES:
            self._built.popitem(last=False)
        return pipeline


def _render(
    pipeline: Pipeline | str,
    out: np.ndarray,
    locations: list,
    seeds: list[int],
    cache: mmap.mmap | None,
    indexed_ns: int,
) -> list[tuple[int, str]]:
    """Renders each located sample into ``out[i]``; returns [(i, reason)] for those that failed (zeros)."""
    errors = []
    for i, ((path, offset, length, cache_mode, cache_offset, verified), seed) in enumerate(zip(locations, seeds)):
        try:
            if isinstance(pipeline, str):
                raise DecodeError(pipeline)
            if cache_mode == CACHE_READ:  # the very bytes that decoded before, if verified
                assert cache is not None, "cache modes come only from a server with a cache"
                data = cache[cache_offset : cache_offset + length]
            else:
                data, mtime_ns = read_sample(path, offset, length)
                # A file written since the server indexed it may differ from the bytes that
                # decoded whole before (same length, new content): decode it whole again.
                verified = verified and mtime_ns < indexed_ns
                if cache_mode == CACHE_FILL:
                    assert cache is not None, "cache modes come only from a server with a cache"
                    cache[cache_offset : cache_offset + length] = data
            out[i] = pipeline(data, seed, verified=verified)
        except (DecodeError, OSError) as exc:
            out[i] = 0
            errors.append((i, str(exc)))
        except Exception as exc:  # a transform failing on odd input must not kill the worker
            out[i] = 0
            errors.append((i, f"{type(exc).__name__}: {exc}"))
    return errors
