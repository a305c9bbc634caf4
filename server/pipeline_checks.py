"""The pipelines clients ask for: each built and tried once, off the event loop, then kept.

A Setup names a pipeline and an output size. Before a stream may order anything, its
pipeline is built and run on test images (pipelines.Pipeline.check_output), in a thread so
that the event loop keeps serving. Invariants:
* One check per spec however many Setups ask for it at once; they all wait for that one.
* Presets are checked on their own executor; custom pipelines one at a time on another, so
  a slow custom one (a huge blur kernel) holds up only other custom Setups.
* A check whose Setups have all left before it ran is dropped; one already running finishes
  and its pipeline is kept.
* At most ``MAX_KEPT`` checked pipelines are kept (then the set starts afresh).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

from remoteloader.protos import CUSTOM_PIPELINE, limits, loader_pb2, wire
from remoteloader.server import targets as tg
from remoteloader.server.pipelines import PRESETS, Pipeline, PipelineError, PipelineSpec
from remoteloader.server.video_pipelines import VIDEO_PRESETS, VideoPipeline, check_clip, is_video, make_pipeline

OFFERED = PRESETS + VIDEO_PRESETS  # the presets a server offers (Describe lists them), images' then clips'

log = logging.getLogger(__name__)

MAX_KEPT = 64


class _Check:
    """A pipeline being built and tried in a thread, and how many Setups wait for it."""

    def __init__(self, future: concurrent.futures.Future[Pipeline | VideoPipeline]):
        self.future = future
        self.waiters = 0


class PipelineChecks:
    """Builds, tries and keeps the pipelines Setups ask for; ``close`` stops the checks.

    Args:
        allow_custom: Whether clients may send albumentations pipelines.
        max_pixels: Largest image the pipelines decode.
        min_image_size / max_image_size: Output sizes clients may ask for (pixels per side).
        slot_bytes: Bytes of a chunk slot, which a sample with its mask must fit.
        media: What the server's samples are (``catalog.media_of``): a stream's pipeline must make
            that ("both": either).

    ``wires``: the wire encodings beside raw it offers (protos.wire.offered), as Describe says.
    """

    def __init__(
        self,
        allow_custom: bool,
        max_pixels: int,
        min_image_size: int,
        max_image_size: int,
        slot_bytes: int,
        media: str = "images",
    ):
        self.allow_custom = allow_custom
        self.media = media
        self.slot_bytes = slot_bytes
        self.max_pixels = max_pixels
        self.min_image_size = min_image_size
        self.max_image_size = max_image_size
        self.wires = wire.offered()  # the encodings beside raw that its workers can make
        self._kept: dict[PipelineSpec, Pipeline | VideoPipeline] = {}
        self._checks: dict[PipelineSpec, _Check] = {}
        self._preset_checks = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="preset-check")
        self._custom_checks = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pipeline-check")

    async def get(self, setup: loader_pb2.Setup) -> Pipeline | VideoPipeline:
        """The checked pipeline for a Setup; raises PipelineError for one this server cannot honour."""
        spec = PipelineSpec(
            setup.pipeline,
            setup.height,
            setup.width,
            setup.albumentations_json,
            self._fields(setup),
            self._wire(setup),
            setup.clip_frames,
            setup.frame_stride or 1,
            setup.clips_per_video or 1,
        )
        if spec.name not in OFFERED and spec.name != CUSTOM_PIPELINE:
            custom = (CUSTOM_PIPELINE,) if self.allow_custom else ()
            raise PipelineError(f"unknown pipeline {spec.name!r}; this server offers {', '.join(OFFERED + custom)}")
        self._for_media(spec)
        frame_height = self._clip_height(spec)
        for name, value in (("height", frame_height), ("width", setup.width)):
            if not self.min_image_size <= value <= self.max_image_size:
                raise PipelineError(
                    f"{name}={value} is outside the sizes this server offers: "
                    f"{self.min_image_size}..{self.max_image_size}"
                )
        pipeline = self._kept.get(spec)
        if pipeline is not None:
            return pipeline
        check = self._checks.get(spec)
        if check is None or check.future.cancelled():
            executor = self._preset_checks if spec.name in OFFERED else self._custom_checks
            check = self._checks[spec] = _Check(executor.submit(self._build, spec))
            loop = asyncio.get_running_loop()
            started = check
            check.future.add_done_callback(lambda _f: loop.call_soon_threadsafe(self._checked, spec, started))
        check.waiters += 1
        try:
            return await asyncio.shield(asyncio.wrap_future(check.future))
        finally:
            check.waiters -= 1
            if not check.waiters:
                check.future.cancel()  # no client waits: dropped if queued; if running, kept when done

    def _fields(self, setup: loader_pb2.Setup) -> tuple[str, ...]:
        """The Setup's target fields ("label" always travels, so it is left out); PipelineError
        for names that cannot be fields, too many, or a mask that does not fit a slot."""
        fields = tuple(dict.fromkeys(f for f in setup.fields if f != tg.LABEL))
        if len(fields) > tg.MAX_FIELDS:
            raise PipelineError(f"{len(fields)} fields asked for, over the limit of {tg.MAX_FIELDS}")
        for name in fields:
            try:
                tg.check_field_name(name)
            except tg.TargetError as exc:
                raise PipelineError(f"fields: {exc}") from None
        if tg.MASK in fields and limits.sample_bytes(setup.height, setup.width, mask=True) > limits.pixel_bytes(
            self.slot_bytes
        ):
            raise PipelineError(
                f"masks of {setup.height}x{setup.width} do not fit this server's chunk slots "
                f"({self.slot_bytes} bytes); start it with a larger --chunk-bytes"
            )
        return fields

    def _for_media(self, spec: PipelineSpec) -> None:
        """PipelineError for clips from a server of images only, or images from one of videos only."""
        if is_video(spec) and self.media == "images":
            raise PipelineError(f"pipeline {spec.name!r} makes clips: this server's data are images, not videos")
        if not is_video(spec) and self.media == "videos":
            raise PipelineError(
                f"pipeline {spec.name!r} makes images: this server's data are videos; ask for clips "
                f"(clip_frames=T, pipeline {' or '.join(repr(p) for p in VIDEO_PRESETS)})"
            )

    def _clip_height(self, spec: PipelineSpec) -> int:
        """A frame's height (the spec's height for images); PipelineError for clip parameters out of
        bounds or clips larger than a chunk slot (server/video_pipelines.py)."""
        if not is_video(spec):
            return spec.height
        check_clip(spec)
        if limits.sample_bytes(spec.height, spec.width) > limits.pixel_bytes(self.slot_bytes):
            raise PipelineError(
                f"a sample of {spec.clips_per_video} x {spec.clip_frames} frames of "
                f"{spec.height // (spec.clip_frames * spec.clips_per_video)}x{spec.width} "
                f"({limits.sample_bytes(spec.height, spec.width):,} bytes) does not fit this server's chunk slots "
                f"({limits.pixel_bytes(self.slot_bytes):,} bytes); start it with a larger --chunk-bytes or "
                f"--max-image-size, or ask for fewer or smaller frames"
            )
        return spec.height // (spec.clip_frames * spec.clips_per_video)

    def _wire(self, setup: loader_pb2.Setup) -> str:
        """The Setup's wire encoding (protos.wire); PipelineError for one this server does not offer,
        or for any but raw with shared memory (the client reads the slots as the workers wrote them)."""
        if setup.shared_memory and setup.wire not in ("", wire.RAW):
            raise PipelineError(
                f"wire={setup.wire!r} with shared_memory: shared chunks are raw pixels; ask for one or the other"
            )
        if setup.wire in ("", wire.RAW) or setup.wire in self.wires:
            return setup.wire or wire.RAW
        raise PipelineError(f"wire={setup.wire!r}: this server offers {', '.join([wire.RAW, *self.wires])}")

    def close(self) -> None:
        """Stops the checks (queued ones are dropped; one running finishes on its own)."""
        for executor in (self._preset_checks, self._custom_checks):
            executor.shutdown(wait=False, cancel_futures=True)

    def _build(self, spec: PipelineSpec) -> Pipeline | VideoPipeline:
        started = time.perf_counter()
        pipeline = make_pipeline(spec, self.allow_custom, self.max_pixels)
        pipeline.check_output()
        log.info(
            "pipeline %s %dx%d built and tried in %.2fs",
            spec.name,
            spec.height,
            spec.width,
            time.perf_counter() - started,
        )
        return pipeline

    def _checked(self, spec: PipelineSpec, check: _Check) -> None:
        if self._checks.get(spec) is check:
            del self._checks[spec]
        if not check.future.cancelled() and check.future.exception() is None:
            if len(self._kept) > MAX_KEPT:
                self._kept.clear()
            self._kept[spec] = check.future.result()
