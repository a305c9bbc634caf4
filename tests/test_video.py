"""Video: the frame index and clip decode (server/video_decode.py), on small videos encoded here by
PyAV's bundled encoders (tests/videos.py), checked against PyAV's own plain decode."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

av = pytest.importorskip("av", reason="the video extra (pip install 'remoteloader[video]')")

from videos import VideoSpec, encode, encode_audio_only, plain_decode  # noqa: E402

from remoteloader.server import video_decode as vd  # noqa: E402

SPECS = [
    VideoSpec("h264_gop4", "libx264", "mp4", 48, 64, 40, 25, 4),
    VideoSpec("h264_long_gop", "libx264", "mkv", 48, 64, 60, 30, 250),
    VideoSpec("vp9_vfr", "libvpx-vp9", "webm", 48, 64, 30, 24, 10, vfr=True),
    VideoSpec("mpeg4", "mpeg4", "avi", 60, 80, 24, 25, 6),
    VideoSpec("short", "libx264", "mov", 48, 64, 5, 30, 12),
]
if "libx265" in av.codecs_available:
    SPECS.append(VideoSpec("hevc_gop8", "libx265", "mp4", 48, 64, 30, 25, 8))


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> dict[str, tuple[VideoSpec, pathlib.Path]]:
    """The test videos, encoded once for the module, by name."""
    folder = tmp_path_factory.mktemp("videos")
    return {s.name: (s, encode(s, folder / s.file)) for s in SPECS}


@pytest.fixture(scope="module")
def broken(tmp_path_factory, videos) -> dict[str, pathlib.Path]:
    """Files that are not readable videos: truncated, empty, not a video, audio only."""
    folder = tmp_path_factory.mktemp("broken")
    whole = videos["h264_gop4"][1].read_bytes()
    (folder / "truncated.mp4").write_bytes(whole[: len(whole) // 3])
    (folder / "empty.mp4").write_bytes(b"")
    (folder / "text.mp4").write_bytes(b"this is not a video at all\n" * 20)
    return {
        "truncated": folder / "truncated.mp4",
        "empty": folder / "empty.mp4",
        "text": folder / "text.mp4",
        "audio": encode_audio_only(folder / "audio.mp4"),
    }


@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_index_counts_every_frame_in_display_order(videos, name):
    spec, path = videos[name]
    index = vd.index_video(str(path))
    assert len(index) == spec.frames == len(plain_decode(path))
    assert (np.diff(index.pts) > 0).all()
    assert index.keyframe[0]
    assert (index.height, index.width) == (spec.height, spec.width)
    if spec.gop >= spec.frames:
        assert index.keyframe.sum() == 1
    else:
        assert index.keyframe.sum() > 1


@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_clip_frames_equal_a_plain_decode_of_the_same_frames(videos, name):
    spec, path = videos[name]
    index = vd.index_video(str(path))
    reference = plain_decode(path)
    n = len(index)
    for frames in ([0], [1, 3, 5], [n // 2, n // 2 + 2, n - 1], [n - 2, n - 1, n - 1, n - 1]):
        frames = [min(f, n - 1) for f in frames]
        got = vd.decode_frames(str(path), index, frames)
        np.testing.assert_array_equal(got, reference[frames], err_msg=f"{name} frames {frames}")
    # from the file's bytes (a tar member, an object) as from its path
    np.testing.assert_array_equal(vd.decode_frames(path.read_bytes(), index, [n - 1]), reference[[n - 1]])


def test_frames_are_converted_at_the_size_asked_for(videos):
    spec, path = videos["h264_gop4"]
    index = vd.index_video(str(path))
    got = vd.decode_frames(str(path), index, [10, 20], size=(24, 32), threads=2)
    np.testing.assert_array_equal(got, plain_decode(path, size=(24, 32))[[10, 20]])


def test_a_clip_decodes_from_the_keyframe_before_it_not_from_the_start(videos, monkeypatch):
    spec, path = videos["h264_gop4"]
    index = vd.index_video(str(path))
    decoded: list[int] = []
    real = vd._decode_into

    def counting(container, stream, *args):
        def frames(s):
            for frame in real_decode(s):
                decoded.append(frame.pts)
                yield frame

        real_decode = container.decode
        container.decode = frames
        return real(container, stream, *args)

    class Counting:  # a container whose decode() is counted (PyAV's containers take no new attributes)
        def __init__(self, container):
            self._c = container

        def __getattr__(self, name):
            return getattr(self._c, name)

    monkeypatch.setattr(vd, "_decode_into", lambda c, *a: counting(Counting(c), *a))
    vd.decode_frames(str(path), index, [30, 31])
    key = index.keyframe_before(30)
    assert 26 <= key <= 30
    # decoded: from the keyframe to the clip's last frame (and the B-frames the decoder hands out on the way)
    assert min(decoded) == index.pts[key]
    assert len(decoded) <= 31 - key + 1 + 3, decoded


@pytest.mark.parametrize("kind", ["truncated", "empty", "text", "audio"])
def test_broken_files_raise_a_video_error_naming_the_reason(broken, kind):
    with pytest.raises(vd.VideoError) as raised:
        index = vd.index_video(str(broken[kind]))
        vd.decode_frames(str(broken[kind]), index, [len(index) - 1])
    if kind == "audio":
        assert "no video stream" in str(raised.value) and "audio" in str(raised.value)
    assert str(raised.value)


def test_training_clips_are_a_function_of_the_seed_and_stay_inside():
    clips = [vd.clip_frames(100, 8, 3, seed=s)[0] for s in range(200)]
    assert all(c[0] >= 0 and c[-1] <= 99 and (np.diff(c) == 3).all() for c in clips)
    np.testing.assert_array_equal(vd.clip_frames(100, 8, 3, seed=7), vd.clip_frames(100, 8, 3, seed=7))
    starts = {int(c[0]) for c in clips}
    assert len(starts) > 40 and min(starts) <= 5 and max(starts) >= 70  # spread over the 0..79 starts


def test_eval_clips_are_centred_or_spread_and_short_videos_repeat_their_last_frame():
    np.testing.assert_array_equal(vd.clip_frames(21, 3, 5), [[5, 10, 15]])
    spread = vd.clip_frames(100, 4, 2, clips=3)
    np.testing.assert_array_equal(spread[:, 0], [0, 46, 93])
    assert spread[-1, -1] == 99
    np.testing.assert_array_equal(vd.clip_frames(5, 4, 2), [[0, 2, 4, 4]])
    np.testing.assert_array_equal(vd.clip_frames(1, 3, 1, seed=5), [[0, 0, 0]])
    with pytest.raises(ValueError, match="must be >= 1"):
        vd.clip_frames(10, 0, 1)
