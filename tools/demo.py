"""``remoteloader demo``: two local loader servers feed a small CNN through RemoteLoader.

It writes a labelled JPEG dataset (class = stripe texture), splits it into two shards,
starts one server per shard on 127.0.0.1, trains for a few epochs (on CUDA when there is
one) and prints per-epoch images/s, the share of time the loop waited for data and the
loss, then the accuracy on the eval pipeline. Servers are stopped on exit and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import re
import sys
import tempfile
import time

from remoteloader.server.config import ServerConfig
from remoteloader.tools import signals

CLASSES = ["diagonal", "horizontal", "slanted", "steep", "vertical", "wavy"]
DONE_MARKER = ".remoteloader-demo-complete"
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--servers", type=int, default=2, help="loader servers (one shard each)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--images-per-class", type=int, default=160)
    parser.add_argument("--classes", type=int, default=4, help=f"2..{len(CLASSES)}")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1, help="decode workers per server")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument(
        "--data",
        default=None,
        help="write the generated dataset here and keep it: a new or empty folder, or one "
        "an earlier demo wrote (default: a temp dir, removed at exit)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--prepare",
        metavar="DIR",
        default=None,
        help="only write the dataset as DIR/shard-<i> (one per server) and exit",
    )
    parser.add_argument(
        "--connect",
        metavar="ADDRESSES",
        default=None,
        help="train against running loader servers (e.g. loader-0:50051,loader-1:50051) instead of starting local ones",
    )


def run(args: argparse.Namespace) -> int:
    """The command: 0 when trained, 130 after Ctrl-C or SIGTERM (servers stopped, temporary data
    removed); bad arguments and unreachable servers are one-line SystemExits."""
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("interrupted; loader servers stopped", file=sys.stderr)  # by the ExitStack, on the way out
        return 130


def _run(args: argparse.Namespace) -> int:
    import torch

    _check(args)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            f"--device={args.device}: this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu or auto"
        )
    torch.manual_seed(args.seed)
    with contextlib.ExitStack() as stack:  # unwound on exit, Ctrl-C and SIGTERM alike
        # SIGTERM (docker stop, kill) cleans up as Ctrl-C does: servers and temp data.
        stack.enter_context(signals.StopSignals(sigterm=KeyboardInterrupt))
        if args.prepare:
            _write_shards(pathlib.Path(args.prepare), args)
            return 0
        addresses = args.connect or _start_servers(stack, args)
        print(f"loader servers: {addresses}; training on {device}")
        train, evaluate = _loaders(stack, addresses, args, device)
        model = _model(len(train.class_names)).to(device).to(memory_format=torch.channels_last)
        print(f"{train.num_samples} images, {len(train)} batches of {args.batch_size} per epoch")
        if len(train) == 0:
            raise SystemExit(
                f"the servers hold {train.num_samples} images, fewer than --batch-size "
                f"{args.batch_size}: no whole batch to train on"
            )
        _train(model, train, args.epochs)
        correct, total = _accuracy(model, evaluate)
        print(f"accuracy (eval pipeline, {total} images): {correct / total:.1%}")
    return 0


def _start_servers(stack: contextlib.ExitStack, args: argparse.Namespace) -> str:
    """Writes the dataset (into a temporary folder without ``--data``) and starts a server per
    shard, each stopped when ``stack`` unwinds; returns their addresses."""
    from remoteloader.tools.local import LocalServer

    root = pathlib.Path(args.data or stack.enter_context(tempfile.TemporaryDirectory()))
    servers = []
    for shard in _write_shards(root, args):
        server = LocalServer(shard, args=["--workers", str(args.workers), "--log-level", "WARNING"])
        stack.callback(server.stop)
        servers.append(server.start())
    return ",".join(s.address for s in servers)


def _loaders(stack: contextlib.ExitStack, addresses: str, args: argparse.Namespace, device: str):
    """The train and eval loaders, closed when ``stack`` unwinds."""
    from remoteloader.client import RemoteLoader

    try:
        train = stack.enter_context(
            RemoteLoader(
                addresses,
                batch_size=args.batch_size,
                image_size=args.image_size,
                pipeline="train",
                seed=args.seed,
                normalize=(MEAN, STD),
                device=device,
            )
        )
        evaluate = stack.enter_context(
            RemoteLoader(
                addresses,
                batch_size=args.batch_size,
                image_size=args.image_size,
                pipeline="eval",
                shuffle=False,
                drop_last=False,
                normalize=(MEAN, STD),
                device=device,
            )
        )
    except (OSError, ValueError) as exc:  # ConnectionError, a bad address, a server that refuses the setup
        if not args.connect:
            raise  # the demo's own servers: a bug, with its traceback
        raise SystemExit(f"--connect={args.connect}: {exc}") from None
    return train, evaluate


def _train(model, train, epochs: int) -> None:
    """Trains ``epochs`` epochs, printing a row per epoch: images/s, the share of the time the
    loop waited for data, and the mean loss."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    print(f"{'epoch':>5} {'images/s':>9} {'data wait':>9} {'loss':>7}")
    for epoch in range(epochs):
        signals.raise_if_stopped()
        train.set_epoch(epoch)
        seen, total_loss, waited = 0, 0.0, 0.0
        start = time.perf_counter()
        fetch = time.perf_counter()
        for images, labels in train:
            waited += time.perf_counter() - fetch
            loss = loss_fn(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += len(labels)
            total_loss += loss.item() * len(labels)
            fetch = time.perf_counter()
            signals.raise_if_stopped()
        elapsed = time.perf_counter() - start
        print(f"{epoch:>5} {seen / elapsed:>9.0f} {waited / elapsed:>8.0%} {total_loss / seen:>7.3f}", flush=True)


def _accuracy(model, evaluate) -> tuple[int, int]:
    """(correct, total) over one pass of the eval loader."""
    import torch

    correct = total = 0
    model.eval()
    with torch.no_grad():
        for images, labels in evaluate:
            signals.raise_if_stopped()
            correct += (model(images).argmax(1) == labels).sum().item()
            total += len(labels)
    return correct, total


def _check(args: argparse.Namespace) -> None:
    """Refuses bad arguments before anything is written or started."""
    if not 2 <= args.classes <= len(CLASSES):
        raise SystemExit(f"--classes={args.classes}: expected 2..{len(CLASSES)}")
    for name, low in (("servers", 1), ("epochs", 1), ("batch_size", 1), ("workers", 1)):
        if getattr(args, name) < low:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)}: expected at least {low}")
    low, high = ServerConfig.min_image_size, ServerConfig.max_image_size
    if not low <= args.image_size <= high:
        raise SystemExit(f"--image-size={args.image_size}: expected {low}..{high} (the servers' default limits)")
    if args.device not in ("auto", "cpu") and not re.fullmatch(r"cuda(:\d+)?", args.device):
        raise SystemExit(f"--device={args.device}: expected auto, cpu, cuda or cuda:N")
    _check_folder(args.prepare or (None if args.connect else args.data))
    if args.connect and not args.prepare:
        return
    per_shard = args.images_per_class // args.servers
    if per_shard < 1:
        raise SystemExit(
            f"--images-per-class={args.images_per_class}: each of the {args.servers} shards needs "
            f"at least one image per class"
        )
    if not args.prepare and args.classes * per_shard * args.servers < args.batch_size:
        raise SystemExit(
            f"{args.classes * per_shard * args.servers} images in all, fewer than --batch-size "
            f"{args.batch_size}: raise --images-per-class or lower --batch-size"
        )


def _check_folder(root) -> None:
    """The dataset folder must be new, empty, or hold only shard-<i> folders (the demo's)."""
    if root is None:
        return
    root = pathlib.Path(root)
    if root.exists() and not root.is_dir():
        raise SystemExit(f"{root} is not a folder")
    strangers = [p.name for p in root.iterdir() if not re.fullmatch(r"shard-\d+", p.name)] if root.exists() else []
    if strangers:
        raise SystemExit(
            f"{root} holds {', '.join(sorted(strangers)[:3])}{' ...' if len(strangers) > 3 else ''}, "
            f"which the demo did not write; give it a new or empty folder"
        )


def _write_shards(root: pathlib.Path, args: argparse.Namespace) -> list[pathlib.Path]:
    from remoteloader.tools.textures import make_imagefolder

    classes = CLASSES[: args.classes]
    shards = []
    t0 = time.perf_counter()
    for i in range(args.servers):
        shard = root / f"shard-{i}"
        done = shard / DONE_MARKER
        recipe = f"classes={len(classes)} images_per_class={args.images_per_class} seed={args.seed}\n"
        # Written last: a shard whose writing was cut short (Ctrl-C, a killed container), or
        # made with other arguments, is written again, never served half-made. Its folder
        # may be a mounted volume, so it is emptied of the demo's own files, not renamed.
        if not done.exists() or done.read_text() != recipe:
            done.unlink(missing_ok=True)
            for name in CLASSES:
                for old in shard.glob(f"{name}/*.jpg"):
                    old.unlink()
                if (shard / name).is_dir() and not any((shard / name).iterdir()):
                    (shard / name).rmdir()
            per = args.images_per_class // args.servers
            make_imagefolder(shard, classes, per, size=(96, 128), seed=args.seed * 1000 + i, jitter=0.2)
            done.write_text(recipe)
        shards.append(shard)
    print(
        f"dataset: {args.servers} shard(s) under {root}, {len(classes)} classes ({time.perf_counter() - t0:.1f}s)",
        flush=True,
    )
    return shards


def _model(num_classes: int):
    import torch.nn as nn

    def block(cin, cout):
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)
        )

    return nn.Sequential(
        block(3, 16), block(16, 32), block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes)
    )
