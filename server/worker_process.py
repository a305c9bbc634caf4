"""The body of one decode/augment worker process (started and fed by worker_pool.WorkerPool).

A worker maps the arena (and the sample cache) by descriptor, then renders tasks until its
task pipe closes or says stop (the messages: worker_messages): for each sample it reads the
bytes (from the file, the cache or the server's ``--source`` object), decodes and augments
them with the sample's seed, together with its targets when the stream asked for any, and
writes the pixels (and the mask) straight into the task's place in a slot. It answers each
task with its per-sample errors and the samples' transformed targets, after every sample of
the task is written. A sample that fails is zeros plus an error; no sample, however broken,
ends the worker.
"""

from __future__ import annotations

import mmap
import os
import signal
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import NamedTuple

import cv2
import numpy as np

from remoteloader.protos import limits, loader_pb2, wire
from remoteloader.protos.malloc import map_now
from remoteloader.server import targets as tg
from remoteloader.server.decode import DecodeError
from remoteloader.server.pipelines import Pipeline, PipelineError, PipelineSpec
from remoteloader.server.sample_reads import SampleFiles
from remoteloader.server.shared_memory import CACHE_FILL, CACHE_READ
from remoteloader.server.sources import load_source, source_sample
from remoteloader.server.video_pipelines import FRAME_INDICES, VideoPipeline, make_pipeline
from remoteloader.server.worker_messages import (
    DefinePipeline,
    ForgetPipelines,
    RenderTask,
    Stop,
    TaskDone,
    TaskSample,
    WorkerSettings,
)

_MAX_PIPELINES = 16


def main(tasks: Connection, results: Connection, arena_fd: int, cache_fd: int | None, settings: WorkerSettings) -> None:
    """Runs the worker until its task pipe closes or sends Stop (the arena's and the cache's
    descriptors, and the settings: see WorkerPool._spawn)."""
    # The parent owns shutdown: Ctrl-C and SIGTERM go to it, and it tells us to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    cv2.setNumThreads(1)
    arena = mmap.mmap(arena_fd, settings.slots * settings.slot_bytes)
    os.close(arena_fd)
    map_now(arena, write=True)  # before the first task, not a fault per page during the first epoch
    cache = None
    if cache_fd is not None:
        cache = mmap.mmap(cache_fd, settings.cache_bytes)
        os.close(cache_fd)
    renderer = _Tasks(arena, settings, cache)
    specs: dict[int, PipelineSpec] = {}  # the pipelines defined so far, by the id tasks name them by
    while True:
        try:
            message = tasks.recv()
        except (EOFError, OSError):
            return
        match message:
            case RenderTask():
                results.send(renderer.render(message, specs[message.spec_id]))
            case DefinePipeline():
                specs[message.spec_id] = message.spec
            case ForgetPipelines():
                specs.clear()
            case Stop():
                return
            case _:
                raise TypeError(f"decode worker: unexpected message {type(message).__name__} ({message!r:.200})")


class _Tasks:
    """Renders RenderTasks into the arena: the worker's pipelines, encoders and --source objects."""

    def __init__(self, arena: mmap.mmap, settings: WorkerSettings, cache: mmap.mmap | None):
        self.arena = arena
        self.slot_bytes = settings.slot_bytes
        self.cache = cache
        self.indexed_ns = settings.indexed_ns
        self.pipelines = _Pipelines(settings.allow_custom, settings.max_pixels, settings.region_decode)
        self.encoders = _Encoders()
        self.objects = [_load(spec, args) for spec, args in settings.sources]

    def render(self, task: RenderTask, spec: PipelineSpec) -> TaskDone:
        """Writes the task's samples (pixels, then masks after the whole chunk's pixels, then with a
        wire encoding their encoded sizes into the slot's size table); returns the answer."""
        arena, height, width, first, count = self.arena, spec.height, spec.width, task.first, len(task.samples)
        base = task.slot * self.slot_bytes
        out = np.ndarray(
            (count, height, width, limits.CHANNELS),
            np.uint8,
            buffer=arena,
            offset=base + first * limits.sample_bytes(height, width),
        )
        masks = None
        if tg.MASK in spec.fields:  # after the pixels of the whole chunk
            masks = np.ndarray(
                (count, height, width),
                np.uint8,
                buffer=arena,
                offset=base + task.chunk * limits.sample_bytes(height, width) + first * height * width,
            )
        samples = _Samples(self.pipelines.get(spec), self.cache, self.indexed_ns, self.objects)
        errors, targets = samples.render(out, masks, task.samples, task.seeds, bool(spec.fields))
        if spec.wire != wire.RAW:
            sizes = np.ndarray(
                (2, limits.MAX_CHUNK_SAMPLES), "<u4", buffer=arena, offset=base + limits.pixel_bytes(self.slot_bytes)
            )
            self.encoders.get(spec.wire).encode(out, masks, {i for i, _ in errors}, sizes[0, first:], sizes[1, first:])
            del sizes
        del out, masks
        return TaskDone(task.task_id, errors, targets)


class _Encoders:
    """The worker's wire encoders (protos.wire.Encoder), one per encoding, made when first needed."""

    def __init__(self):
        self._made: dict[str, _Encode] = {}

    def get(self, name: str) -> _Encode:
        encoder = self._made.get(name)
        if encoder is None:
            encoder = self._made[name] = _Encode(wire.Encoder(name))
        return encoder


class _Encode:
    """Encodes a task's rendered samples in place (protos.limits: the slot's size table)."""

    def __init__(self, encoder: wire.Encoder):
        self.encoder = encoder

    def encode(
        self,
        out: np.ndarray,
        masks: np.ndarray | None,
        failed: set[int],
        image_sizes: np.ndarray,
        mask_sizes: np.ndarray,
    ) -> None:
        """Writes each sample's encoded image over its pixels (and its mask's over the mask) where
        that is smaller, and the sizes: 0 for a failed sample, the raw size where it stays raw."""
        for i in range(len(out)):
            if i in failed:
                image_sizes[i] = mask_sizes[i] = 0
                continue
            image_sizes[i] = _put(out[i], self.encoder.image(out[i]))
            if masks is not None:
                mask_sizes[i] = _put(masks[i], self.encoder.mask(masks[i]))


def _put(place: np.ndarray, data: bytes | None) -> int:
    """Writes ``data`` at the start of ``place`` (None: leaves the raw bytes); returns the size sent."""
    if data is None:
        return place.nbytes
    place.reshape(-1)[: len(data)] = np.frombuffer(data, np.uint8)
    return len(data)


def _load(spec: str, args: str) -> object:
    """The server's source object (it loaded in the server), or why it does not load here."""
    try:
        return load_source(spec, args)
    except Exception as exc:  # its samples fail with the reason; the worker goes on
        return f"the decode worker cannot load the source: {exc}"


class _Pipelines:
    """The worker's pipelines by spec, the most recently used ``_MAX_PIPELINES``; a spec that does not
    build is kept as its error message, which each of its samples then reports."""

    def __init__(self, allow_custom: bool, max_pixels: int, region_decode: bool):
        self.allow_custom = allow_custom
        self.max_pixels = max_pixels
        self.region_decode = region_decode
        self._built: OrderedDict[PipelineSpec, Pipeline | VideoPipeline | str] = OrderedDict()

    def get(self, spec: PipelineSpec) -> Pipeline | VideoPipeline | str:
        pipeline = self._built.get(spec)
        if pipeline is not None:
            self._built.move_to_end(spec)
            return pipeline
        try:
            pipeline = make_pipeline(spec, self.allow_custom, self.max_pixels, self.region_decode)
        except PipelineError as exc:
            pipeline = f"pipeline error: {exc}"
        self._built[spec] = pipeline
        if len(self._built) > _MAX_PIPELINES:
            self._built.popitem(last=False)
        return pipeline


class _Read(NamedTuple):
    """A sample's encoded bytes; whether they decoded without error before, unchanged since (a crop may
    then decode its region only); and, read from a file, which bytes they are: (path, offset,
    length, mtime_ns), None from the cache."""

    data: bytes
    verified: bool
    identity: tuple[str, int, int, int] | None


class _Samples:
    """Renders a task's samples with one pipeline (or its error message)."""

    def __init__(
        self, pipeline: Pipeline | VideoPipeline | str, cache: mmap.mmap | None, indexed_ns: int, sources: list
    ):
        self.pipeline = pipeline
        self.cache = cache
        self.indexed_ns = indexed_ns
        self.sources = sources
        self.files = SampleFiles()  # the task's (closed when it is rendered)

    def render(
        self,
        out: np.ndarray,
        masks: np.ndarray | None,
        samples: list[TaskSample],
        seeds: list[int],
        with_targets: bool,
    ) -> tuple[list[tuple[int, str]], list[bytes]]:
        """Renders each sample into ``out[i]`` (and ``masks[i]``); returns [(i, reason)] for
        those that failed (zeros) and, ``with_targets``, each sample's transformed targets."""
        errors = []
        targets: list[bytes] = []
        try:
            for i, (sample, seed) in enumerate(zip(samples, seeds)):
                record = b""
                try:
                    if isinstance(self.pipeline, str):
                        raise DecodeError(self.pipeline)
                    if sample.failure:  # its bytes could not be fetched (an object store): why
                        raise DecodeError(sample.failure)
                    if with_targets or sample.source >= 0:  # (a --source's sample comes with its targets)
                        record = self._with_targets(out, masks, i, sample, seed)
                    else:
                        read = self._read(sample)
                        out[i] = self.pipeline(read.data, seed, verified=read.verified)
                except (DecodeError, OSError, tg.TargetError) as exc:
                    errors.append((i, str(exc)))
                except Exception as exc:  # a transform failing on odd input must not kill the worker
                    errors.append((i, f"{type(exc).__name__}: {exc}"))
                if errors and errors[-1][0] == i:
                    out[i] = 0
                    if masks is not None:
                        masks[i] = 0
                    record = b""
                if with_targets:
                    targets.append(record)
        finally:
            self.files.close()  # the task's files: none stays open between tasks
        return errors, targets

    def _read(self, sample: TaskSample) -> _Read:
        """The sample's encoded bytes, from the cache or its file (see ``_Read``)."""
        cache, start, length = self.cache, sample.cache_offset, sample.length
        if sample.cache_mode == CACHE_READ:  # the very bytes that decoded before, if verified
            assert cache is not None, "cache modes come only from a server with a cache"
            return _Read(cache[start : start + length], sample.verified, None)
        data, mtime_ns = self.files.read(sample.path, sample.offset, length)
        # A file written since the server indexed it may differ from the bytes that
        # decoded before (same length, new content): read it whole again.
        verified = sample.verified and mtime_ns < self.indexed_ns
        if sample.cache_mode == CACHE_FILL:
            assert cache is not None, "cache modes come only from a server with a cache"
            cache[start : start + length] = data
        return _Read(data, verified, (sample.path, sample.offset, length, mtime_ns))

    def _clip_targets(self, out: np.ndarray, i: int, sample: TaskSample, seed: int) -> bytes:
        """Renders video sample ``i``; returns its targets: the clip's source frames (FRAME_INDICES)."""
        assert isinstance(self.pipeline, VideoPipeline)
        if sample.source >= 0:
            raise tg.TargetError("a --source's samples are images, not videos")
        read = self._read(sample)
        out[i], numbers = self.pipeline.render(read.data, seed, identity=read.identity)
        fields = self.pipeline.spec.fields
        arrays = {FRAME_INDICES: numbers[0] if len(numbers) == 1 else numbers} if FRAME_INDICES in fields else {}
        return tg.check_size(tg.to_message(arrays), "its")

    def _with_targets(self, out: np.ndarray, masks: np.ndarray | None, i: int, sample: TaskSample, seed: int) -> bytes:
        """Renders sample ``i`` with its targets; returns them transformed, serialized."""
        if isinstance(self.pipeline, VideoPipeline):
            return self._clip_targets(out, i, sample, seed)
        assert isinstance(self.pipeline, Pipeline)
        path, source = sample.path, sample.source
        image: bytes | np.ndarray
        verified = False
        if source >= 0:
            if isinstance(self.sources[source], str):
                raise tg.TargetError(self.sources[source])
            image, arrays = source_sample(self.sources[source], sample.offset)
            stored = loader_pb2.Targets()
        else:
            image, verified, _ = self._read(sample)
            stored = loader_pb2.Targets.FromString(sample.targets)
            if stored.error:
                raise tg.TargetError(stored.error)
            arrays = tg.arrays_of(stored)

        def mask_of(height: int, width: int) -> np.ndarray | None:
            if tg.MASK in arrays:
                return tg.check_mask(arrays.pop(tg.MASK), height, width)
            if stored.mask_length:
                data, _ = self.files.read(path, stored.mask_offset, stored.mask_length)
                return tg.read_mask_png(data, height, width)
            if stored.regions:
                return tg.draw_regions(stored.regions, height, width)
            return None

        def instances_of(boxes: int, height: int, width: int) -> np.ndarray | None:
            if tg.MASKS in arrays:
                return tg.check_instances(arrays.pop(tg.MASKS), boxes, height, width)
            if stored.regions:
                return tg.draw_instances(stored.regions, boxes, height, width)
            return None

        pixels, transformed, mask = self.pipeline.with_targets(image, seed, arrays, mask_of, instances_of, verified)
        out[i] = pixels
        if masks is not None:
            masks[i] = 0 if mask is None else mask
        return tg.check_size(tg.to_message(transformed), "its transformed")
