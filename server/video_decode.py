"""Video files, through PyAV (FFmpeg inside its wheel): a video's frame index, and its clips decoded.

``index_video`` reads a video's packets without decoding them (fast: no pixels) and returns a
``VideoIndex``: each frame's timestamp in display order, which frames are keyframes, the time
base and the frame size. It needs no frame count from the container, so .mkv and .webm (which
store none) and variable frame rates are indexed like .mp4. ``decode_frames`` returns the frames
a clip names by number (0-based, display order): it seeks to the keyframe at or before the
first, decodes forward, stops after the last, and converts to RGB only the frames it keeps, at
the size asked for (FFmpeg's swscale scales and converts in one pass). ``clip_frames`` says which
frame numbers a clip takes. Audio and every other stream are ignored.

A video that cannot be read raises ``VideoError`` (a ``DecodeError``: a worker reports it as the
sample's failure, naming the reason).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from remoteloader.server.decode import DecodeError
from remoteloader.server.seeds import splitmix64, stream_seeds

VIDEO_EXTENSIONS = (".mp4", ".mkv", ".webm", ".avi", ".mov")
MAX_FRAMES = 1 << 22  # frames in one video's index (about 19 hours at 60 fps): a bound on its memory

Source = str | bytes | BinaryIO  # a file's path, its bytes, or a readable, seekable file object


class VideoError(DecodeError):
    """A video that cannot be indexed or decoded: the message names the reason."""


@dataclass(frozen=True)
class VideoIndex:
    """One video's frames in display order: ``pts`` (int64, in ``time_base`` units, increasing) and
    ``keyframe`` (bool), beside the stream's time base (numerator, denominator) and frame size."""

    pts: np.ndarray
    keyframe: np.ndarray
    time_base: tuple[int, int]
    height: int
    width: int

    def __len__(self) -> int:
        return len(self.pts)

    def seconds(self) -> float:
        """The video's duration by its timestamps (first frame to last; 0 for one frame)."""
        if len(self.pts) < 2:
            return 0.0
        num, den = self.time_base
        return float(self.pts[-1] - self.pts[0]) * num / den

    def keyframe_before(self, frame: int) -> int:
        """The number of the last keyframe at or before ``frame`` (0 when none is: decode from the start)."""
        keys = np.flatnonzero(self.keyframe[: frame + 1])
        return int(keys[-1]) if len(keys) else 0


# FFmpeg's stream probe on opening (avformat_find_stream_info) decodes frames until it has guessed
# H.264's reordering delay: 7 to 20 of them, about 10 ms at 640x480, a sixth of a clip's CPU. With
# its probe decoder skipping all but keyframes it reads the streams' parameters without that (0.3
# ms). The option reaches only the probe's decoder: the container's own decoders skip nothing.
_PROBE = {"skip_frame": "nonkey"}


def _open(source: Source):
    import av

    try:
        if isinstance(source, (bytes, bytearray, memoryview)):
            source = io.BytesIO(bytes(source))
        return av.open(source, "r", options=_PROBE)
    except av.FFmpegError as exc:
        raise VideoError(f"not a video this server can read ({_reason(exc)})") from None


def _reason(exc: Exception) -> str:
    text = getattr(exc, "strerror", None) or str(exc)
    return str(text).rstrip(".")


def _video_stream(container):
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["no streams"]
        raise VideoError(f"holds no video stream ({', '.join(kinds)})")
    stream = container.streams.video[0]
    if stream.codec_context is None or stream.codec_context.name is None:
        raise VideoError("its video codec is one this server's FFmpeg cannot decode")
    return stream


def index_video(source: Source) -> VideoIndex:
    """The frame index of a video: every packet's timestamp and keyframe flag, read without
    decoding; VideoError when it cannot be read or has no video frames."""
    import av

    with _open(source) as container:
        stream = _video_stream(container)
        pts: list[int] = []
        keys: list[bool] = []
        try:
            for packet in container.demux(stream):
                stamp = packet.pts if packet.pts is not None else packet.dts
                if stamp is None or packet.size == 0:
                    continue  # the demuxer's flush packet
                pts.append(stamp)
                keys.append(packet.is_keyframe)
                if len(pts) > MAX_FRAMES:
                    raise VideoError(f"has over {MAX_FRAMES:,} frames, this server's limit for one video")
        except av.FFmpegError as exc:
            if not pts:
                raise VideoError(f"cannot be read ({_reason(exc)})") from None
            # A truncated file: its frames up to the damage are the video (decode_frames checks them).
        if not pts:
            raise VideoError("has no video frames")
        order = np.argsort(np.asarray(pts, np.int64), kind="stable")
        stamps = np.asarray(pts, np.int64)[order]
        if len(np.unique(stamps)) != len(stamps):
            raise VideoError("has frames with the same timestamp: their display order is unknown")
        base = stream.time_base
        if base is None:
            raise VideoError("its video stream has no time base")
        height, width = stream.codec_context.height, stream.codec_context.width
        if not height or not width:
            raise VideoError("its video stream has no frame size")
        return VideoIndex(stamps, np.asarray(keys, bool)[order], (base.numerator, base.denominator), height, width)


def decode_frames(
    source: Source,
    index: VideoIndex,
    frames: np.ndarray | list[int],
    size: tuple[int, int] | None = None,
    threads: int = 1,
    crop: tuple[int, int, int, int] | None = None,
) -> np.ndarray:
    """The frames numbered ``frames`` (display order, increasing, repeats allowed) as uint8 RGB
    [len(frames), height, width, 3]; ``size`` (height, width) scales them there as they are
    converted (None: the video's size). Decodes from the keyframe at or before the first frame
    to the last one, and converts only the frames kept. ``threads``: FFmpeg's threads for this
    decoder (1: none of its own; the server's workers are the parallelism). ``crop`` (x1, y1,
    x2, y2, in the frame's pixels) with ``size``: that region of each frame, resized to ``size``
    (``region_to_rgb``: the region's YUV planes resized, then converted at the output size)."""
    import av

    wanted = np.asarray(frames, np.int64)
    if not len(wanted):
        raise ValueError("no frames asked for")
    if np.any(np.diff(wanted) < 0) or wanted[0] < 0 or wanted[-1] >= len(index):
        raise ValueError(f"frame numbers must increase within 0..{len(index) - 1}; got {wanted.tolist()[:8]}")
    height, width = size or (index.height, index.width)
    out = np.empty((len(wanted), height, width, 3), np.uint8)
    unique, first_at = np.unique(wanted, return_index=True)
    targets = index.pts[unique]
    with _open(source) as container:
        stream = _video_stream(container)
        context = stream.codec_context
        context.thread_count = max(1, threads)
        context.thread_type = "AUTO" if threads > 1 else "SLICE"
        start = index.keyframe_before(int(unique[0]))
        try:
            if start > 0:
                container.seek(int(index.pts[start]), stream=stream, backward=True, any_frame=False)
            convert = _converter(height, width, crop)
            found = _decode_into(container, stream, targets, out, first_at, convert)
        except av.FFmpegError as exc:
            raise VideoError(f"cannot be decoded ({_reason(exc)})") from None
    missing = np.flatnonzero(~found)
    if len(missing):
        raise VideoError(
            f"frame(s) {unique[missing][:5].tolist()} of {len(index)} cannot be decoded (a truncated or damaged file?)"
        )
    # Repeats (a short video's padding) copy the frame decoded for their first place.
    for place in np.flatnonzero(np.diff(wanted) == 0) + 1:
        out[place] = out[place - 1]
    return out


def _converter(height: int, width: int, crop: tuple[int, int, int, int] | None):
    """How a kept frame becomes RGB at (height, width): swscale, or the crop's region."""
    if crop is None:
        return lambda frame: frame.to_ndarray(format="rgb24", width=width, height=height)
    return lambda frame: region_to_rgb(frame, crop, height, width)


def region_to_rgb(frame, crop: tuple[int, int, int, int], height: int, width: int) -> np.ndarray:
    """The region ``crop`` (x1, y1, x2, y2) of a decoded frame as RGB resized to (height, width).

    For 4:2:0 frames (H.264's, HEVC's and VP9's usual) and an even output size, the region's Y, U
    and V planes are resized to the output and converted there (BT.601, as swscale's rgb24):
    the conversion costs output pixels, not the frame's. Otherwise the whole frame is converted,
    then cropped and resized. Both resize bilinearly (as the image pipeline's crop)."""
    import cv2

    x1, y1, x2, y2 = crop
    if frame.format.name == "yuv420p" and height % 2 == 0 and width % 2 == 0:
        x1, y1 = x1 & ~1, y1 & ~1  # chroma rows and columns cover two of luma's
        x2, y2 = min(frame.width, x2 + (x2 & 1)), min(frame.height, y2 + (y2 & 1))
        if x2 - x1 >= 2 and y2 - y1 >= 2:
            planes = [_plane(p) for p in frame.planes[:3]]
            luma = cv2.resize(planes[0][y1:y2, x1:x2], (width, height), interpolation=cv2.INTER_LINEAR)
            chroma = [
                cv2.resize(
                    p[y1 // 2 : y2 // 2, x1 // 2 : x2 // 2], (width // 2, height // 2), interpolation=cv2.INTER_LINEAR
                )
                for p in planes[1:]
            ]
            i420 = np.concatenate([luma.reshape(-1), chroma[0].reshape(-1), chroma[1].reshape(-1)])
            return cv2.cvtColor(i420.reshape(height * 3 // 2, width), cv2.COLOR_YUV2RGB_I420)
    rgb = frame.to_ndarray(format="rgb24")
    return cv2.resize(rgb[y1:y2, x1:x2], (width, height), interpolation=cv2.INTER_LINEAR)


def _plane(plane) -> np.ndarray:
    """A frame's plane as a uint8 [height, width] view (its rows padded to line_size)."""
    return np.frombuffer(plane, np.uint8).reshape(plane.height, plane.line_size)[:, : plane.width]


def _decode_into(container, stream, targets, out, first_at, convert) -> np.ndarray:
    """Decodes forward from where the container stands, writing each target frame into its first
    place in ``out``; stops after the last target. Returns which targets were found.

    A packet whose frame the clip does not keep is decoded only if other frames refer to it:
    the decoder skips it where it is not a reference frame (FFmpeg's skip_frame=NONREF, per
    packet; most B-frames), which saves a third of the decoding on x264's defaults."""
    found = np.zeros(len(targets), bool)
    wanted = set(targets.tolist())
    context = stream.codec_context
    for packet in container.demux(stream):
        stamp = packet.pts if packet.pts is not None else packet.dts
        context.skip_frame = "DEFAULT" if stamp is None or stamp in wanted else "NONREF"
        for frame in context.decode(packet):  # (the demuxer's last, empty packet drains the decoder)
            if _keep(frame, targets, found, out, first_at, convert) and found.all():
                return found
    return found


def _keep(frame, targets, found, out, first_at, convert) -> bool:
    """Writes ``frame`` into its place if it is a target not found yet; whether it was one."""
    stamp = frame.pts if frame.pts is not None else getattr(frame, "dts", None)
    if stamp is None:
        return False
    k = int(np.searchsorted(targets, stamp))
    if k < len(targets) and targets[k] == stamp and not found[k]:
        out[first_at[k]] = convert(frame)
        found[k] = True
        return True
    return False


def clip_frames(
    frame_count: int, length: int, stride: int, *, start: int | None = None, seed: int | None = None, clips: int = 1
) -> np.ndarray:
    """The frame numbers of a video's clip(s) of ``length`` frames ``stride`` apart: [clips, length].

    ``start`` given: the clip starting there. Else with ``seed``: ``clips`` clips at starts drawn
    from the seed, uniform over the starts that keep a clip inside the video (training clips: the
    seed is the sample's, from (seed, epoch, shard, index)). Else ``clips`` clips with starts
    spread uniformly (one: the centre clip; an evaluation's). A video shorter than the clip
    repeats its last frame to the clip's length."""
    if frame_count < 1 or length < 1 or stride < 1 or clips < 1:
        raise ValueError(
            f"frame_count, length, stride and clips must be >= 1; got {frame_count}, {length}, {stride}, {clips}"
        )
    span = (length - 1) * stride + 1
    room = max(0, frame_count - span)  # the last start that keeps the clip inside
    if start is not None:
        starts = np.asarray([start], np.int64)
    elif seed is not None:
        # The sample seed's first stream (its transforms' streams start at the second: Pipeline.reseed)
        first = int(splitmix64(seed & ((1 << 64) - 1)))
        draws = [first] if clips == 1 else stream_seeds(first, clips)
        starts = np.asarray([d % (room + 1) for d in draws], np.int64)
    elif clips == 1:
        starts = np.asarray([room // 2], np.int64)
    else:
        starts = np.round(np.linspace(0, room, clips)).astype(np.int64)
    numbers = starts[:, None] + stride * np.arange(length, dtype=np.int64)[None, :]
    return np.minimum(numbers, frame_count - 1)
