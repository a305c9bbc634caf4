"""Clips/s delivered to a training loop: RemoteLoader (one server) vs. a PyAV DataLoader, by GOP and size.

    python benchmarks/video.py [--videos N] [--frames F] [--clip T] [--stride S] [--size P]
                               [--gops 12,250] [--resolutions 240x320,480x640] [--workers K]
                               [--rounds R] [--json PATH]

One run, on the same cores, for each (GOP length, resolution): N generated videos (photo-like
frames panning across a large photo, H.264 by PyAV's bundled libx264, ``--frames`` frames at
30 fps, keyframes every GOP frames) in class folders, and these loaders, each making the same
thing (a training clip of T frames S apart at a random start, one random-resized-crop + flip
draw for the whole clip, uint8 [B, T, P, P, 3]):

  remote   RemoteLoader(clip_frames=T, frame_stride=S, pipeline="video-train") fed by one local
           ``remoteloader-server --workers K`` on the folder (same-host path)
  grpc     the same loader with shared_memory=False: the same server's chunks over gRPC
  pyav     torch DataLoader(num_workers=K) doing what a PyAV user writes: open the file, seek to
           the clip's start time, decode forward keeping every S-th frame, each converted to
           full-size RGB, then albumentations' RandomResizedCrop + HorizontalFlip on ``images=``
  torchcodec  the same with torchcodec's VideoDecoder.get_frames_at, when it is importable (it
           needs the system's FFmpeg libraries; on Debian 12 with torch 2.13.0:
           apt-get install libavcodec59 libavformat59 libavutil57 libswscale6 libswresample4
           libavdevice59 libavfilter8, and pip install --no-deps torchcodec==0.12.0 in a venv)

Rounds alternate (remote, pyav[, torchcodec], remote, ...) after one warm-up epoch each, so
drift and neighbours' load hit them alike. Reported per loader: clips/s (median of rounds) and
training-host CPU ms per clip (this process and its children: the DataLoader's workers, or the
RemoteLoader's receiver; the server's CPU is reported apart).
Nothing is downloaded; the videos are cached under ~/.cache/remoteloader-bench/videos-*.
"""

from __future__ import annotations

import argparse
import fractions
import json
import multiprocessing as mp
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
import albumentations as A  # noqa: E402
import av  # noqa: E402
import cv2  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset, get_worker_info  # noqa: E402

from remoteloader.client import RemoteLoader  # noqa: E402
from remoteloader.tools.local import LocalServer  # noqa: E402

CACHE = pathlib.Path.home() / ".cache" / "remoteloader-bench"
CLASSES = 4


def make_videos(root: pathlib.Path, count: int, frames: int, height: int, width: int, gop: int) -> pathlib.Path:
    """``count`` H.264 .mp4 videos in ``CLASSES`` class folders (kept: made once per parameters)."""
    folder = root / f"videos-{count}x{frames}-{height}x{width}-gop{gop}"
    done = folder / ".complete"
    if done.exists():
        return folder
    rng = np.random.default_rng(0)
    for i in range(count):
        photo = _common.make_photo(rng, height + frames, width + 2 * frames)
        path = folder / f"class{i % CLASSES}" / f"video{i:04d}.mp4"
        path.parent.mkdir(parents=True, exist_ok=True)
        with av.open(str(path), "w") as container:
            stream = container.add_stream("libx264", rate=30, options={"g": str(gop), "keyint_min": str(gop),
                                                                        "preset": "veryfast", "crf": "23"})
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.codec_context.time_base = fractions.Fraction(1, 30)
            for f in range(frames):
                frame = av.VideoFrame.from_ndarray(
                    np.ascontiguousarray(photo[f // 2 : f // 2 + height, 2 * f : 2 * f + width]), format="rgb24")
                frame.pts = f
                for packet in stream.encode(frame):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
    done.write_text("")
    return folder


class PyAVClips(Dataset):
    """A training clip per video as a PyAV user writes it (see the module docstring)."""

    def __init__(self, files: list[tuple[str, int]], clip: int, stride: int, size: int, decoder: str = "pyav"):
        self.files, self.clip, self.stride, self.decoder = files, clip, stride, decoder
        self.transform = A.Compose([A.RandomResizedCrop(size=(size, size), scale=(0.08, 1.0)), A.HorizontalFlip()])

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int):
        path, label = self.files[index]
        frames = self._torchcodec(path) if self.decoder == "torchcodec" else self._pyav(path)
        return torch.from_numpy(self.transform(images=frames)["images"]), label

    def _pyav(self, path: str) -> np.ndarray:
        with av.open(path) as container:
            stream = container.streams.video[0]
            count, rate = stream.frames, stream.average_rate
            span = (self.clip - 1) * self.stride + 1
            start = int(np.random.randint(0, max(1, count - span + 1)))
            container.seek(int(start / rate / stream.time_base), stream=stream, backward=True)
            out = []
            for frame in container.decode(stream):
                number = round(frame.pts * stream.time_base * rate)
                if number < start or (number - start) % self.stride:
                    continue
                out.append(frame.to_ndarray(format="rgb24"))
                if len(out) == self.clip:
                    break
            while len(out) < self.clip:
                out.append(out[-1])
            return np.stack(out)

    def _torchcodec(self, path: str) -> np.ndarray:
        from torchcodec.decoders import VideoDecoder

        decoder = VideoDecoder(path, dimension_order="NHWC")
        count = decoder.metadata.num_frames
        span = (self.clip - 1) * self.stride + 1
        start = int(np.random.randint(0, max(1, count - span + 1)))
        numbers = [min(count - 1, start + k * self.stride) for k in range(self.clip)]
        return decoder.get_frames_at(numbers).data.numpy()


def _worker_init(_worker_id: int) -> None:
    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    info = get_worker_info()
    np.random.seed(torch.initial_seed() % 2**32)
    info.dataset.transform.set_random_seed(torch.initial_seed() % 2**32)


def run_epoch(name: str, loader, epoch: int, server_pid: int | None, expect: int) -> dict:
    if name in ("remote", "grpc"):
        loader.set_epoch(epoch)
    cpu0 = _common.cpu_split(os.getpid(), server_pid)
    started = time.perf_counter()
    clips = 0
    for batch in loader:
        video = batch["video"] if isinstance(batch, dict) else batch[0]
        clips += video.shape[0]
    wall = time.perf_counter() - started
    cpu1 = _common.cpu_split(os.getpid(), server_pid)
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
    if clips != expect:
        raise RuntimeError(f"{name}: epoch {epoch} delivered {clips} clips, expected {expect}")
    host, server = cpu["client"] + cpu["client_children"], cpu["server_main"] + cpu["server_workers"]
    return {"loader": name, "clips_per_s": clips / wall, "host_cpu_ms_per_clip": 1000 * host / clips,
            "server_cpu_ms_per_clip": 1000 * server / clips}


def one_case(args, folder: pathlib.Path, log_dir: str) -> dict[str, dict]:
    files = [(str(p), int(p.parent.name[5:])) for p in sorted(folder.glob("*/*.mp4"))]
    expect = len(files) // args.batch_size * args.batch_size
    loaders: dict[str, object] = {}
    for name in ("pyav", "torchcodec"):
        if name == "torchcodec":
            try:
                import torchcodec.decoders  # noqa: F401
            except Exception as exc:  # (needs the system's FFmpeg libraries)
                print(f"torchcodec: not measured ({type(exc).__name__}: {str(exc)[:80]})", flush=True)
                continue
        dataset = PyAVClips(files, args.clip, args.stride, args.size, name)
        loaders[name] = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                   num_workers=args.workers, persistent_workers=True, worker_init_fn=_worker_init)
        run_epoch(name, loaders[name], 0, None, expect)  # warm-up (forks the workers before gRPC starts)
    server = LocalServer(folder, args=["--workers", str(args.workers), "--grace", "2", "--log-level", "INFO"],
                         log_path=pathlib.Path(log_dir) / f"server-{folder.name}.log")
    server.start(timeout=300)
    try:
        for name, shared in (("remote", True), ("grpc", False)):
            loaders[name] = RemoteLoader(server.address, batch_size=args.batch_size, image_size=args.size,
                                         clip_frames=args.clip, frame_stride=args.stride, pipeline="video-train",
                                         shared_memory=shared)
            run_epoch(name, loaders[name], 0, server.process.pid, expect)
        records: dict[str, list[dict]] = {name: [] for name in loaders}
        for r in range(args.rounds):
            for name in ["remote", "grpc", *(n for n in loaders if n not in ("remote", "grpc"))]:
                records[name].append(run_epoch(name, loaders[name], r + 1, server.process.pid, expect))
        return {name: {key: statistics.median(x[key] for x in rs) for key in rs[0] if key != "loader"}
                for name, rs in records.items()}
    finally:
        for name in ("remote", "grpc"):
            if name in loaders:
                loaders[name].close()  # type: ignore[attr-defined]
        server.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--videos", type=int, default=32)
    parser.add_argument("--frames", type=int, default=150)
    parser.add_argument("--clip", type=int, default=16)
    parser.add_argument("--stride", type=int, default=2)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--gops", default="12,250")
    parser.add_argument("--resolutions", default="240x320,480x640")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="remoteloader-video-bench-")
    results = []
    for resolution in args.resolutions.split(","):
        height, width = (int(v) for v in resolution.split("x"))
        for gop in (int(g) for g in args.gops.split(",")):
            # (encoded in a child: FFmpeg's encoder threads in this process would deadlock the forked workers)
            with mp.get_context("spawn").Pool(1) as pool:
                folder = pool.apply(make_videos, (CACHE, args.videos, args.frames, height, width, gop))
            figures = one_case(args, folder, log_dir)
            results.append({"gop": gop, "resolution": resolution, **figures})
            bases = {b: figures[b]["clips_per_s"] for b in ("pyav", "torchcodec") if b in figures}
            for name, f in figures.items():
                ratios = "  ".join(f"{f['clips_per_s'] / v:4.2f}x {b}" for b, v in bases.items())
                print(f"gop {gop:4d} {resolution:>8}  {name:10s} {f['clips_per_s']:7.1f} clips/s ({ratios})  "
                      f"host CPU {f['host_cpu_ms_per_clip']:6.1f} ms/clip  "
                      f"server CPU {f['server_cpu_ms_per_clip']:6.1f} ms/clip", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
