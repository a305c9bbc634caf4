"""``remoteloader demo --video``: generated clips, local loader servers, a tiny 3D CNN.

It encodes short H.264 videos (PyAV's bundled libx264) of moving stripe textures, one kind of
motion per class (stripes rising, falling, drifting sideways, rings pulsing outwards: all of
them the same class after a horizontal flip, which "video-train" draws), splits them into one
video folder per server (``video-<i>/<class>/<video>.mp4``), and trains a tiny 3D CNN (three
Conv3d blocks) on 8-frame clips at stride 2 from the "video-train" pipeline, printing clips/s,
the share of time the loop waited for data and the loss per epoch, then the accuracy on the
"video-eval" clips. Torch is imported only where it trains (``--prepare`` needs none).
"""

from __future__ import annotations

import argparse
import contextlib
import fractions
import pathlib
import time

import numpy as np

from remoteloader.tools import signals
from remoteloader.tools.demo import remake

CLASSES = ["falling", "drifting", "pulsing", "rising"]
CLIP_FRAMES, FRAME_STRIDE = 8, 2
FRAMES, FPS, SIDE, GOP = 24, 25, 80, 12  # each generated video: 24 frames of 80x80 at 25 fps, a keyframe every 12
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


def frames(kind: str, rng: np.random.Generator) -> np.ndarray:
    """One video's frames, uint8 RGB [FRAMES, SIDE, SIDE, 3]: stripes of a random period, speed,
    phase and pair of colours, moving as ``kind`` says, with a little noise."""
    y, x = np.mgrid[0:SIDE, 0:SIDE].astype(np.float32)
    period, speed, phase = rng.uniform(10, 20), rng.uniform(1.5, 3.0), rng.uniform(0, 2 * np.pi)
    colours = rng.integers(0, 256, (2, 3)).astype(np.float32)
    sideways = rng.choice([-1.0, 1.0])
    out = np.empty((FRAMES, SIDE, SIDE, 3), np.uint8)
    for t in range(FRAMES):
        if kind == "rising":
            where = y + speed * t
        elif kind == "falling":
            where = y - speed * t
        elif kind == "drifting":
            where = x + sideways * speed * t
        else:  # pulsing: rings moving outwards from the centre
            where = np.hypot(y - SIDE / 2, x - SIDE / 2) - speed * t
        level = 0.5 + 0.5 * np.sin(2 * np.pi * where / period + phase)
        rgb = colours[0] * level[..., None] + colours[1] * (1 - level[..., None])
        out[t] = np.clip(rgb + rng.normal(0, 6, rgb.shape), 0, 255).astype(np.uint8)
    return out


def encode(path: pathlib.Path, video: np.ndarray) -> None:
    """Writes frames as an H.264 .mp4 (libx264 through PyAV's bundled FFmpeg)."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=FPS, options={"g": str(GOP), "preset": "veryfast"})
        stream.width, stream.height, stream.pix_fmt = SIDE, SIDE, "yuv420p"
        stream.codec_context.time_base = fractions.Fraction(1, FPS)
        for t, rgb in enumerate(video):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts, frame.time_base = t, stream.codec_context.time_base
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_shards(root: pathlib.Path, args: argparse.Namespace) -> list[pathlib.Path]:
    """``root/video-<i>/<class>/<class>_<n>.mp4``, one folder per server; a folder written
    whole with these arguments before is reused (its marker is written last)."""
    try:
        import av  # noqa: F401
    except ImportError:
        raise SystemExit("demo --video needs PyAV: pip install 'remoteloader[server,video]'") from None
    classes = CLASSES[: args.classes]
    per = args.videos_per_class // args.servers
    shards = []
    started = time.perf_counter()
    for i in range(args.servers):
        shard = root / f"video-{i}"
        recipe = f"classes={len(classes)} videos_per_class={args.videos_per_class} seed={args.seed}\n"
        rng = np.random.default_rng(args.seed * 1000 + i)

        def write(shard: pathlib.Path = shard, rng: np.random.Generator = rng) -> None:
            for kind in classes:
                (shard / kind).mkdir(parents=True, exist_ok=True)
                for n in range(per):
                    signals.raise_if_stopped()
                    encode(shard / kind / f"{kind}_{n:04d}.mp4", frames(kind, rng))

        remake(shard, recipe, ["*/*.mp4"], write)
        shards.append(shard)
    print(
        f"dataset: {args.servers} video folder(s) under {root}, {len(classes)} classes, {per * len(classes)} "
        f"videos each ({time.perf_counter() - started:.1f}s)",
        flush=True,
    )
    return shards


def model(num_classes: int):
    """A tiny 3D CNN: three Conv3d blocks, then pooling over time and space and a linear layer."""
    import torch.nn as nn

    def block(cin: int, cout: int, pool: tuple[int, int, int]):
        return nn.Sequential(
            nn.Conv3d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm3d(cout), nn.ReLU(), nn.MaxPool3d(pool)
        )

    return nn.Sequential(
        block(3, 16, (1, 2, 2)),
        block(16, 32, (2, 2, 2)),
        block(32, 64, (2, 2, 2)),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(64, num_classes),
    )


def loaders(stack: contextlib.ExitStack, addresses: str, args: argparse.Namespace, device: str):
    """The "video-train" and "video-eval" loaders, closed when ``stack`` unwinds."""
    from remoteloader.client import RemoteLoader

    common = {
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "clip_frames": CLIP_FRAMES,
        "frame_stride": FRAME_STRIDE,
        "normalize": (MEAN, STD),
        "device": device,
    }
    try:
        train = stack.enter_context(RemoteLoader(addresses, pipeline="video-train", seed=args.seed, **common))
        evaluate = stack.enter_context(
            RemoteLoader(addresses, pipeline="video-eval", shuffle=False, drop_last=False, **common)
        )
    except (OSError, ValueError) as exc:
        if not args.connect:
            raise
        raise SystemExit(f"--connect={args.connect}: {exc}") from None
    return train, evaluate


def train_and_evaluate(stack: contextlib.ExitStack, addresses: str, args: argparse.Namespace, device: str) -> None:
    """Trains ``args.epochs`` epochs (a row each: clips/s, data wait, loss), then the eval accuracy."""
    import torch

    train, evaluate = loaders(stack, addresses, args, device)
    net = model(len(train.class_names)).to(device)
    print(
        f"{train.num_samples} videos, {len(train)} batches of {args.batch_size} clips "
        f"({CLIP_FRAMES} frames at stride {FRAME_STRIDE}, {args.image_size}x{args.image_size}) per epoch"
    )
    if len(train) == 0:
        raise SystemExit(f"the servers hold {train.num_samples} videos, fewer than --batch-size {args.batch_size}")
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    print(f"{'epoch':>5} {'clips/s':>9} {'data wait':>9} {'loss':>7}")
    for epoch in range(args.epochs):
        train.set_epoch(epoch)
        seen, total_loss, waited = 0, 0.0, 0.0
        start = fetch = time.perf_counter()
        for batch in train:
            waited += time.perf_counter() - fetch
            loss = loss_fn(net(batch["video"]), batch["label"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += len(batch["label"])
            total_loss += loss.item() * len(batch["label"])
            signals.raise_if_stopped()
            fetch = time.perf_counter()
        elapsed = time.perf_counter() - start
        print(f"{epoch:>5} {seen / elapsed:>9.1f} {waited / elapsed:>8.0%} {total_loss / seen:>7.3f}", flush=True)
    correct = total = 0
    net.eval()
    with torch.no_grad():
        for batch in evaluate:
            signals.raise_if_stopped()
            correct += (net(batch["video"]).argmax(1) == batch["label"]).sum().item()
            total += len(batch["label"])
    print(f"accuracy (video-eval clips, {total} videos): {correct / total:.1%}")
