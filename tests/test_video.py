"""Video: the frame index and clip decode (server/video_decode.py), on small videos encoded here by
PyAV's bundled encoders (tests/videos.py), checked against PyAV's own plain decode."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest
import torch

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
    real = vd._keep

    def counting(frame, *args):  # every frame the decoder hands out passes here
        decoded.append(frame.pts)
        return real(frame, *args)

    monkeypatch.setattr(vd, "_keep", counting)
    got = vd.decode_frames(str(path), index, [30, 32])
    np.testing.assert_array_equal(got, plain_decode(path)[[30, 32]])
    key = index.keyframe_before(30)
    assert 26 <= key <= 30
    # decoded: from the keyframe to the clip's last frame (and the B-frames the decoder hands out on
    # the way), less the frames no other refers to (skip_frame=NONREF)
    assert min(decoded) == index.pts[key]
    assert len(decoded) <= 32 - key + 1 + 3, decoded


def test_frames_no_other_frame_refers_to_are_not_decoded_unless_kept(videos, monkeypatch):
    spec, path = videos["h264_long_gop"]  # one keyframe, then P- and B-frames
    index = vd.index_video(str(path))
    decoded: list[int] = []
    real = vd._keep
    monkeypatch.setattr(vd, "_keep", lambda frame, *args: decoded.append(frame.pts) or real(frame, *args))
    got = vd.decode_frames(str(path), index, [40, 42, 44])
    np.testing.assert_array_equal(got, plain_decode(path)[[40, 42, 44]])
    assert len(decoded) < 40, f"{len(decoded)} frames decoded for a clip ending at frame 44: no B-frame skipped"


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


# ---- a server on a folder of class folders of videos ----------------------------------------------

FOLDER_SPECS = [
    VideoSpec("a0", "libx264", "mp4", 48, 64, 24, 25, 6),
    VideoSpec("a1", "libx264", "mkv", 48, 64, 30, 30, 250),
    VideoSpec("b0", "libvpx-vp9", "webm", 48, 64, 20, 24, 8, vfr=True),
    VideoSpec("b1", "mpeg4", "avi", 60, 80, 16, 25, 4),
    VideoSpec("c0", "libx264", "mov", 48, 64, 5, 30, 12),  # shorter than a clip
    VideoSpec("c1", "libx264", "mp4", 64, 48, 26, 25, 12),  # portrait
]
CLIP = {"clip_frames": 4, "frame_stride": 2}


@pytest.fixture(scope="module")
def video_folder(tmp_path_factory) -> pathlib.Path:
    """``videos/<class>/<file>``: three classes, two videos each, and one broken file in class c."""
    root = tmp_path_factory.mktemp("kinetics") / "videos"
    for i, spec in enumerate(FOLDER_SPECS):
        folder = root / spec.name[0]
        folder.mkdir(parents=True, exist_ok=True)
        encode(spec, folder / spec.file, seed=i)
    (root / "c" / "c2_truncated.mp4").write_bytes((root / "a" / "a0.mp4").read_bytes()[:300])
    return root


@pytest.fixture(scope="module")
def video_server(module_cluster, video_folder):
    module_cluster.add(video_folder, "--workers", "2")
    return module_cluster


def _epoch(server, **options) -> list[dict]:
    from remoteloader.client import RemoteLoader

    arguments = {"batch_size": 2, "image_size": 32, "drop_last": False, "return_ids": True, **CLIP}
    arguments.update({"on_error": lambda failures: None, **options})  # (a failed clip is kept, zeros)
    with RemoteLoader(server.target, **arguments) as loader:
        batches = list(loader)
        keys = {int(i): loader.sample_key(int(i)) for b in batches for i in b["ids"]}
    for b in batches:
        b["keys"] = [keys[int(i)] for i in b["ids"]]
    return batches


def _eval_clip(path: pathlib.Path, size: int) -> np.ndarray:
    """The eval clip as a PyAV user gets it: the centre clip's frames decoded whole, then the "eval"
    geometry (resize to cover size / 0.875, centre crop) applied by albumentations."""
    from remoteloader.server.pipelines import PipelineSpec, build_compose

    frames = plain_decode(path)
    numbers = vd.clip_frames(len(frames), CLIP["clip_frames"], CLIP["frame_stride"])[0]
    return build_compose(PipelineSpec("eval", size, size), False)(images=frames[numbers])["images"]


def test_eval_serves_every_video_once_as_its_centre_clip(video_server, video_folder):
    failures = []
    batches = _epoch(video_server, pipeline="video-eval", shuffle=False, on_error=failures.extend)
    keys = [k for b in batches for k in b["keys"]]
    assert sorted(keys) == sorted(str(p.relative_to(video_folder)) for p in video_folder.glob("*/*"))
    assert [f.key for f in failures] == ["c/c2_truncated.mp4"] and "not a video" in failures[0].reason
    for batch in batches:
        assert batch["video"].dtype == torch.uint8 and batch["video"].shape[1:] == (4, 32, 32, 3)
        for key, video, label in zip(batch["keys"], batch["video"], batch["label"]):
            assert int(label) == "abc".index(key[0])
            if key.endswith("truncated.mp4"):
                continue
            expected = _eval_clip(video_folder / key, 32).astype(np.int16)
            difference = np.abs(video.numpy().astype(np.int16) - expected)
            assert difference.mean() < 2.5 and np.percentile(difference, 99) <= 12, (key, difference.mean())


def test_training_clips_repeat_bit_for_bit_and_change_with_the_epoch(video_server):
    from remoteloader.client import RemoteLoader

    def pixels(epoch: int, seed: int = 3) -> dict[str, np.ndarray]:
        with RemoteLoader(
            video_server.target,
            batch_size=3,
            image_size=32,
            pipeline="video-train",
            seed=seed,
            return_ids=True,
            on_error="skip",
            drop_last=False,
            **CLIP,
        ) as loader:
            loader.set_epoch(epoch)
            return {loader.sample_key(int(i)): v.numpy() for b in loader for i, v in zip(b["ids"], b["video"])}

    first, again, later = pixels(0), pixels(0), pixels(1)
    assert len(first) == 6 and first.keys() == again.keys() == later.keys()
    for key in first:
        np.testing.assert_array_equal(first[key], again[key], err_msg=key)
    assert sum(not np.array_equal(first[k], later[k]) for k in first) >= 4  # new clips, new crops


@pytest.mark.parametrize("layout", ["BCTHW", "BTCHW"])
def test_normalized_clips_come_in_the_layout_asked_for(video_server, layout):
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    plain = _epoch(video_server, pipeline="video-eval", shuffle=False)
    normal = _epoch(video_server, pipeline="video-eval", shuffle=False, normalize=(mean, std), video_layout=layout)
    for a, b in zip(plain, normal):
        expected = (a["video"].float() / 255 - 0.5) / 0.25  # [B, T, H, W, C]
        expected = expected.permute(0, 4, 1, 2, 3) if layout == "BCTHW" else expected.permute(0, 1, 4, 2, 3)
        assert b["video"].dtype == torch.float32 and b["video"].shape == expected.shape
        torch.testing.assert_close(b["video"], expected, atol=1e-5, rtol=0)


def test_frame_indices_name_each_clips_source_frames(video_server, video_folder):
    batches = _epoch(video_server, pipeline="video-eval", fields=["label", "frame_indices"])
    seen = 0
    for batch in batches:
        assert batch["frame_indices"].dtype == torch.int64 and batch["frame_indices"].shape[1:] == (4,)
        for key, numbers in zip(batch["keys"], batch["frame_indices"]):
            if key.endswith("truncated.mp4"):
                continue
            count = len(vd.index_video(str(video_folder / key)))
            np.testing.assert_array_equal(numbers.numpy(), vd.clip_frames(count, 4, 2)[0])
            seen += 1
    assert seen == 6


def test_clip_arguments_are_checked_before_any_connection():
    from remoteloader.client import RemoteLoader

    for bad, match in (
        ({"clip_frames": 0}, "clip_frames=0"),
        ({"clip_frames": 4, "frame_stride": 0}, "frame_stride=0"),
        ({"clip_frames": 4, "video_layout": "NCHW"}, "video_layout='NCHW'"),
        ({"frame_stride": 2}, "frame_stride given without clip_frames"),
    ):
        with pytest.raises(ValueError, match=match):
            RemoteLoader("127.0.0.1:1", connect_timeout=0.1, **bad)


def test_the_server_refuses_clips_out_of_bounds_or_larger_than_a_slot():
    from remoteloader.server.pipelines import PipelineError, PipelineSpec
    from remoteloader.server.video_pipelines import VideoPipeline, check_clip

    with pytest.raises(PipelineError, match="clip_frames"):
        check_clip(PipelineSpec("video-eval", 32, 32))
    with pytest.raises(PipelineError, match="clip_frames=600"):
        check_clip(PipelineSpec("video-eval", 600 * 32, 32, clip_frames=600))
    with pytest.raises(PipelineError, match="not clips_per_video x clip_frames"):
        check_clip(PipelineSpec("video-eval", 33, 32, clip_frames=4))
    with pytest.raises(PipelineError, match="video-train, video-eval"):
        VideoPipeline(PipelineSpec("train", 128, 32, clip_frames=4))
    VideoPipeline(PipelineSpec("video-train", 128, 32, clip_frames=4)).check_output()


def test_a_clip_larger_than_a_chunk_slot_is_refused_at_setup(video_server):
    from remoteloader.client import RemoteLoader

    with pytest.raises(Exception, match="does not fit this server's chunk slots"):
        with RemoteLoader(video_server.target, batch_size=1, image_size=512, clip_frames=64) as loader:
            next(iter(loader))


def test_a_pipeline_that_cannot_make_what_a_server_serves_is_refused_at_setup(video_server, cluster, tmp_path):
    from remoteloader.client import LoaderError, RemoteLoader
    from remoteloader.tools.textures import make_imagefolder

    images = cluster.add(make_imagefolder(tmp_path / "images", ["a"], 4, size=(40, 40)))
    for target, options, says in (
        (video_server.target, {}, "this server's data are videos; ask for clips (clip_frames=T"),
        (cluster.address(images), CLIP, "this server's data are images, not videos"),
    ):
        with pytest.raises(LoaderError, match=re.escape(says)):
            with RemoteLoader(target, batch_size=1, image_size=32, connect_timeout=30, **options) as loader:
                next(iter(loader))


def test_webdataset_tars_with_video_members_serve_clips(cluster, video_folder, tmp_path):
    import tarfile

    tar = tmp_path / "videos-000.tar"
    with tarfile.open(tar, "w") as out:
        for i, path in enumerate(sorted(video_folder.glob("[ab]/*"))):
            out.add(path, f"clip{i:03d}{path.suffix}")
            cls = tmp_path / f"clip{i:03d}.cls"
            cls.write_text(str("ab".index(path.parent.name)))
            out.add(cls, cls.name)
    cluster.add(tar)
    batches = _epoch(cluster, pipeline="video-eval", shuffle=False, fields=["label", "frame_indices"])
    served = {k: (v, int(label)) for b in batches for k, v, label in zip(b["keys"], b["video"], b["label"])}
    files = sorted(video_folder.glob("[ab]/*"))
    assert sorted(served) == [f"clip{i:03d}{p.suffix}" for i, p in enumerate(files)]
    for i, path in enumerate(files):
        video, label = served[f"clip{i:03d}{path.suffix}"]
        assert label == "ab".index(path.parent.name)
        expected = _eval_clip(path, 32).astype(np.int16)
        assert np.abs(video.numpy().astype(np.int16) - expected).mean() < 2.5


def test_a_video_folder_in_an_object_store_serves_the_clips_it_serves_from_disk(cluster, video_folder, tmp_path):
    import obstore
    from obstore.store import from_url

    from remoteloader.tools.local_s3 import LocalS3

    with LocalS3(tmp_path / "s3").start() as s3:
        store = from_url("s3://data", client_options={"allow_http": "true"}, endpoint=s3.endpoint,
                         access_key_id=s3.access_key, secret_access_key=s3.secret_key, region="us-east-1")
        for path in sorted(video_folder.glob("*/*")):
            obstore.put(store, f"videos/{path.relative_to(video_folder).as_posix()}", path.read_bytes())
        disk = cluster.add(video_folder)
        bucket = cluster.add("s3://data/videos", "--cache-dir", str(tmp_path / "cache"), env=s3.env())

        class One:
            def __init__(self, i: int):
                self.target = cluster.address(i)

        served = []
        for server in (One(disk), One(bucket)):
            failures = []
            batches = _epoch(server, pipeline="video-eval", shuffle=False, on_error=failures.extend)
            served.append(({k: v.numpy() for b in batches for k, v in zip(b["keys"], b["video"])},
                           [(f.key, f.reason) for f in failures]))
    (from_disk, disk_failures), (from_bucket, bucket_failures) = served
    assert len(from_bucket) == 7 and from_bucket.keys() == from_disk.keys()
    for key in from_disk:
        np.testing.assert_array_equal(from_bucket[key], from_disk[key], err_msg=key)
    assert [k for k, _ in bucket_failures] == [k for k, _ in disk_failures] == ["c/c2_truncated.mp4"]
    assert "not a video" in bucket_failures[0][1], bucket_failures


def test_two_replicas_one_killed_mid_epoch_serve_every_clip_once_and_the_same(cluster, video_folder):
    from remoteloader.client import RemoteLoader

    cluster.add_many([video_folder, video_folder], "--workers", "1")
    options = {
        "batch_size": 1,
        "image_size": 32,
        "pipeline": "video-train",
        "seed": 5,
        "return_ids": True,
        "on_error": lambda failures: None,
        "prefetch": 2,
        "max_inflight": 1,
        **CLIP,
    }
    with RemoteLoader(cluster.target, **options) as loader:
        assert len(loader.catalog.shards) == 1, "two servers of one folder are replicas of one shard"
        reference = {int(b["ids"][0]): b["video"][0].clone() for b in loader}
        loader.set_epoch(0)
        it = iter(loader)
        got = [next(it)]
        assert cluster.kill(1) == -9
        got += list(it)
    ids = [int(b["ids"][0]) for b in got]
    assert sorted(ids) == sorted(reference) and len(ids) == 7
    for b in got:
        assert torch.equal(b["video"][0], reference[int(b["ids"][0])])


def test_a_crops_region_converted_at_the_output_size_is_close_to_a_full_conversion(videos):
    import cv2

    spec, path = videos["h264_gop4"]
    index = vd.index_video(str(path))
    full = plain_decode(path)[[3, 9]]
    crop = (10, 6, 50, 40)  # x1, y1, x2, y2
    got = vd.decode_frames(str(path), index, [3, 9], (16, 20), crop=crop)
    expected = np.stack([cv2.resize(f[6:40, 10:50], (20, 16), interpolation=cv2.INTER_LINEAR) for f in full])
    difference = np.abs(got.astype(np.int16) - expected)
    assert got.shape == (2, 16, 20, 3) and difference.mean() < 3, difference.mean()
    # the whole frame at its own size: the conversion alone
    whole = vd.decode_frames(str(path), index, [3], (48, 64), crop=(0, 0, 64, 48))
    assert np.abs(whole.astype(np.int16) - full[:1]).mean() < 2


def _clips(loader, batches: int | None = None) -> list[tuple[list[int], np.ndarray]]:
    """(ids, clips) of each batch, up to ``batches`` of them."""
    out = []
    for batch in loader:
        out.append((batch["ids"].tolist(), batch["video"].numpy().copy()))
        if len(out) == batches:
            break
    return out


def _train_loader(server, **options):
    from remoteloader.client import RemoteLoader

    settings = {"batch_size": 2, "image_size": 32, "pipeline": "video-train", "seed": 9, "return_ids": True,
                "drop_last": False, "on_error": lambda failures: None, "connect_timeout": 30, **CLIP}
    return RemoteLoader(server.target, **{**settings, **options})


def test_a_clip_epoch_resumed_mid_way_in_a_fresh_loader_continues_bit_for_bit(video_server):
    with _train_loader(video_server) as whole:
        whole.set_epoch(1)
        uninterrupted = _clips(whole)
    with _train_loader(video_server) as first:
        first.set_epoch(1)
        before = _clips(first, 2)
        state = first.state_dict()
    with _train_loader(video_server) as fresh:
        fresh.load_state_dict(state)
        after = _clips(fresh)
    assert len(uninterrupted) == 4 and len(before) == 2
    for (ids, clips), (ids_again, clips_again) in zip(uninterrupted, before + after, strict=True):
        assert ids == ids_again
        np.testing.assert_array_equal(clips, clips_again)


def test_ddp_ranks_split_the_videos_and_jobs_on_one_plan_share_each_clips_decode(video_server):
    import threading

    ranks = []
    for rank in (0, 1):
        with _train_loader(video_server, rank=rank, world_size=2) as loader:
            ranks.append({i for ids, _ in _clips(loader) for i in ids})
    assert ranks[0] | ranks[1] == set(range(7)) and not ranks[0] & ranks[1]

    loaders = [_train_loader(video_server, job=f"sweep-{k}") for k in range(2)]
    results: list = [None, None]
    try:
        threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, _clips(loaders[k]))) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        shared = [lo.stats()["images_shared"] for lo in loaders]
    finally:
        for lo in loaders:
            lo.close()
    assert results[0] is not None and results[1] is not None
    for (ids, clips), (ids_b, clips_b) in zip(results[0], results[1], strict=True):
        assert ids == ids_b
        np.testing.assert_array_equal(clips, clips_b)
    assert sum(shared) > 0, shared  # clips one job's decode served to both (how many: the start's timing)


def test_a_workers_kept_index_of_a_constant_rate_video_is_small_and_gives_back_the_same_frames(videos):
    from remoteloader.server import video_pipelines as vp

    for name in ("h264_gop4", "vp9_vfr"):
        index = vd.index_video(str(videos[name][1]))
        kept = vp._pack(index)
        again = vp._unpack(kept)
        np.testing.assert_array_equal(again.pts, index.pts)
        np.testing.assert_array_equal(again.keyframe, index.keyframe)
        assert (again.time_base, again.height, again.width) == (index.time_base, index.height, index.width)
        regular = name != "vp9_vfr"
        assert isinstance(kept, vp._Regular) == regular, name
        assert vp._kept_bytes(kept) < 1000 if regular else vp._kept_bytes(kept) >= 9 * len(index)
