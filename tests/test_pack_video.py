"""``remoteloader pack`` of a video folder (the real CLI): tars of the videos as they are, which a
real server serves as it serves the folder: every video once, the same eval clips."""

from __future__ import annotations

import pathlib

import pytest
import torch

pytest.importorskip("av", reason="the video extra (pip install 'remoteloader[video]')")

from packing import members, pack_cli  # noqa: E402
from videos import VideoSpec, encode  # noqa: E402

pytestmark = pytest.mark.timeout(120)

SPECS = [  # (class, spec): short GOPs and long, three containers, one video shorter than a clip
    ("archery", VideoSpec("a0", "libx264", "mp4", 48, 64, 20, 25, 4)),
    ("archery", VideoSpec("a1", "libvpx-vp9", "webm", 48, 64, 16, 24, 8)),
    ("bowling", VideoSpec("b0", "libx264", "mkv", 64, 48, 24, 30, 250)),
    ("bowling", VideoSpec("b1", "libx264", "mov", 48, 64, 5, 30, 12)),
    ("curling", VideoSpec("c0", "mpeg4", "avi", 48, 64, 18, 25, 6)),
]
CLIP = {"clip_frames": 4, "frame_stride": 2}


@pytest.fixture(scope="module")
def video_folder(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("kinetics") / "videos"
    for i, (cls, spec) in enumerate(SPECS):
        (root / cls).mkdir(parents=True, exist_ok=True)
        encode(spec, root / cls / spec.file, seed=i)
    (root / "curling" / "c1_truncated.mp4").write_bytes((root / "archery" / "a0.mp4").read_bytes()[:300])
    return root


def _eval_epoch(address: str) -> dict[str, tuple[torch.Tensor, int]]:
    """key -> (eval clip, label) of one epoch; a key served twice fails."""
    from remoteloader.client import RemoteLoader

    served: dict[str, tuple[torch.Tensor, int]] = {}
    options = {"batch_size": 2, "image_size": 32, "pipeline": "video-eval", "shuffle": False, **CLIP}
    with RemoteLoader(address, drop_last=False, return_ids=True, on_error=lambda failures: None, **options) as loader:
        for batch in loader:
            for i, video, label in zip(batch["ids"], batch["video"], batch["label"]):
                key = loader.sample_key(int(i))
                assert key not in served, f"{key} served twice in an epoch"
                served[key] = (video.clone(), int(label))
    return served


def test_a_video_folder_packs_into_tars_a_server_serves_as_the_folder(video_folder, tmp_path, cluster):
    dst = tmp_path / "shards"
    result = pack_cli(video_folder, dst, "--shard-size", "20000")
    assert result.returncode == 0, result.stderr
    tars = sorted(dst.glob("*.tar"))
    assert len(tars) >= 2 and f"wrote {len(tars)} shard(s)" in result.stdout, result.stdout
    assert "rewritten" not in result.stdout  # nothing to rewrite in a video
    assert "1 file(s) are videos that cannot be read" in result.stderr and "curling/c1_truncated.mp4" in result.stderr
    assert "video" in result.stderr  # the progress bar counts videos
    assert (dst / "classes.txt").read_text() == "archery\nbowling\ncurling\n"

    files = sorted(str(p.relative_to(video_folder)) for p in video_folder.glob("*/*"))
    packed = {name: data for tar in tars for name, data in members(tar)}
    for key in files:  # each video byte for byte, with its label
        assert packed.pop(key) == (video_folder / key).read_bytes(), key
        stem = key.rpartition(".")[0]
        assert packed.pop(f"{stem}.cls") == str(["archery", "bowling", "curling"].index(key.split("/")[0])).encode()
    assert packed == {}, sorted(packed)

    folder, shards = cluster.add(video_folder), cluster.add(tars)
    from_folder, from_tars = _eval_epoch(cluster.address(folder)), _eval_epoch(cluster.address(shards))
    assert sorted(from_tars) == sorted(from_folder) == files  # every video once, the broken one too (failed)
    for key in files:
        assert from_tars[key][1] == from_folder[key][1]
        if not key.endswith("truncated.mp4"):
            assert torch.equal(from_tars[key][0], from_folder[key][0]), key
            assert from_tars[key][0].float().std() > 5  # a clip, not a failed sample's zeros
