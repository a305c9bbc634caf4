"""Small videos for the video tests, encoded by PyAV's bundled FFmpeg encoders from photo-like
frames (``photos.smooth_photo``), and PyAV's own plain decode to check clips against.

Each frame is a window panning across one larger photo, with the frame number drawn in, so
that every frame differs from its neighbours and a wrong frame cannot pass for the right one.
"""

from __future__ import annotations

import fractions
import pathlib
from dataclasses import dataclass

import numpy as np
from photos import smooth_photo


@dataclass(frozen=True)
class VideoSpec:
    """One test video: its codec, container, size, frame count and rate, and keyframe interval."""

    name: str
    codec: str
    container: str
    height: int
    width: int
    frames: int
    fps: int
    gop: int
    vfr: bool = False  # timestamps at irregular intervals (variable frame rate)

    @property
    def file(self) -> str:
        return f"{self.name}.{self.container}"


def frames_of(spec: VideoSpec, seed: int = 0) -> np.ndarray:
    """The frames the video is encoded from: uint8 RGB [frames, height, width, 3]."""
    rng = np.random.default_rng(seed)
    photo = smooth_photo(rng, spec.height + spec.frames, spec.width + 2 * spec.frames)
    out = np.empty((spec.frames, spec.height, spec.width, 3), np.uint8)
    for i in range(spec.frames):
        out[i] = photo[i // 2 : i // 2 + spec.height, 2 * i : 2 * i + spec.width]
        # the frame number as a bright bar of its own length at the top: frames differ clearly
        out[i, :4, : 2 + i % spec.width] = 255
    return out


def encode(spec: VideoSpec, path: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Encodes the video's frames with its codec into ``path`` (a file of its container)."""
    import av

    options = {"g": str(spec.gop), "keyint_min": str(spec.gop)}
    if spec.codec == "libx264":
        options.update({"preset": "veryfast", "bf": "3"})  # B-frames, some of them non-reference
    elif spec.codec == "libx265":
        options = {"preset": "ultrafast", "x265-params": f"keyint={spec.gop}:min-keyint={spec.gop}:log-level=error"}
    elif spec.codec == "libvpx-vp9":
        options.update({"deadline": "realtime", "cpu-used": "8", "lag-in-frames": "0"})
    with av.open(str(path), "w") as container:
        stream = container.add_stream(spec.codec, rate=spec.fps, options=options)
        stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, "yuv420p"
        stream.codec_context.time_base = fractions.Fraction(1, spec.fps * 10)
        stamp = 0
        for i, rgb in enumerate(frames_of(spec, seed)):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = stamp
            frame.time_base = stream.codec_context.time_base
            stamp += (10 if not spec.vfr else (5, 10, 25)[i % 3])
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def encode_audio_only(path: pathlib.Path) -> pathlib.Path:
    """A file with one audio stream and no video (.mp4, AAC)."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=16000)
        stream.layout = "mono"
        for i in range(4):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, i * 1024
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def plain_decode(path, size: tuple[int, int] | None = None) -> np.ndarray:
    """Every frame of the video in display order as PyAV decodes it start to end (full size RGB,
    or scaled to ``size`` as it converts): what the clips must equal."""
    import av

    with av.open(str(path)) as container:
        frames = sorted(container.decode(video=0), key=lambda f: f.pts)
        kw = {"height": size[0], "width": size[1]} if size else {}
        return np.stack([f.to_ndarray(format="rgb24", **kw) for f in frames])
