"""``remoteloader demo``: two local loader servers feed a small CNN through RemoteLoader.

It writes a labelled JPEG dataset (class = stripe texture), splits it into two shards,
starts one server per shard on 127.0.0.1, trains for a few epochs (on CUDA when there is
one) and prints per-epoch images/s, the share of time the loop waited for data and the
loss, then the accuracy on the eval pipeline. Servers are stopped on exit and on Ctrl-C.

``--task detection`` does the same for boxes: it writes two COCO-style datasets of coloured
shapes (``tools/shapes.py``: squares, discs, triangles, 1-3 per image), one per server,
trains a tiny one-stage detector (a grid of cells, each predicting "is a shape's centre
here", its box and its class) on the "detection-train" pipeline with the boxes and box
labels as targets, and evaluates it on "detection-eval" over a held-out fifth of the images:
the mean IoU of its boxes with the true ones, next to what one constant box gets.

``--video`` does it for clips (``tools/demo_video.py``): generated H.264 videos of moving
stripes, one video folder per server, a tiny 3D CNN on "video-train" clips, clips/s and loss.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import pathlib
import re
import sys
import tempfile
import time
from collections.abc import Callable

from remoteloader.server.config import ServerConfig
from remoteloader.tools import signals

CLASSES = ["diagonal", "horizontal", "slanted", "steep", "vertical", "wavy"]
DONE_MARKER = ".remoteloader-demo-complete"
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
TASKS = ("classification", "detection")
# Defaults that depend on --task, or --video (None in the parser, filled in by _check).
DEFAULTS = {
    "classification": {"classes": 4, "images_per_class": 160, "batch_size": 64, "image_size": 64},
    "detection": {"images": 1200, "batch_size": 32, "image_size": 64},
    "video": {"classes": 4, "videos_per_class": 16, "batch_size": 8, "image_size": 32},
}
HOLD_OUT = 5  # detection: every 5th sample id is held out of training, for the evaluation
STRIDE = 8  # detection: pixels per cell of the detector's output grid
FOUND_IOU = 0.5  # detection: a true box is found by a predicted box of its class with at least this IoU


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--task",
        choices=TASKS,
        default="classification",
        help="classification (stripe textures, accuracy) or detection (coloured shapes, boxes, mean IoU)",
    )
    parser.add_argument("--servers", type=int, default=2, help="loader servers, one shard each (default 2)")
    parser.add_argument("--epochs", type=int, default=4, help="training epochs (default 4)")
    parser.add_argument("--images-per-class", type=int, default=None, help="classification (default 160)")
    parser.add_argument("--classes", type=int, default=None, help=f"classification: 2..{len(CLASSES)} (default 4)")
    parser.add_argument(
        "--images",
        type=int,
        default=None,
        help=f"detection: images in all, split over the shards; one in {HOLD_OUT} is held out for the "
        f"evaluation (default {DEFAULTS['detection']['images']})",
    )
    parser.add_argument(
        "--video",
        action="store_true",
        help="video classification: generated H.264 clips of moving stripes (one motion per class), a tiny "
        "3D CNN, clips/s and loss (needs PyAV: the video extra)",
    )
    parser.add_argument(
        "--videos-per-class",
        type=int,
        default=None,
        help=f"--video: videos per class, split over the servers (default {DEFAULTS['video']['videos_per_class']})",
    )
    parser.add_argument("--batch-size", type=int, default=None, help="default 64; detection: 32; --video: 8")
    parser.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="side of the square images (frames) trained on (default 64; --video: 32)",
    )
    parser.add_argument("--workers", type=int, default=1, help="decode workers per server (default 1)")
    parser.add_argument("--device", default="auto", help="auto (cuda if there is one), cpu or cuda (default auto)")
    parser.add_argument(
        "--data",
        default=None,
        help="write the generated dataset here and keep it: a new or empty folder, or one "
        "an earlier demo wrote (default: a temp dir, removed at exit)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the data, the order and the model (default 0)")
    parser.add_argument(
        "--prepare",
        metavar="DIR",
        default=None,
        help="only write the dataset as DIR/shard-<i> (detection: DIR/detection-<i>; --video: DIR/video-<i>; one "
        "per server) and exit "
        "(needs no torch: the server image runs it)",
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
        # SIGTERM (docker stop, kill) cleans up as Ctrl-C does: servers and temp data. Installed
        # first: as a container's PID 1, a signal that comes while torch imports would be lost.
        with signals.StopSignals():
            return _run(args)
    except (KeyboardInterrupt, signals.Terminated):
        # The local servers were stopped by _run's ExitStack, on the way out; --connect stops none.
        print("interrupted" if args.connect else "interrupted; loader servers stopped", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    _check(args)
    if args.prepare:  # data only, without torch: compose's prepare services run on the server image
        _writer(args)(pathlib.Path(args.prepare), args)
        return 0
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            f"--device={args.device}: this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu or auto"
        )
    torch.manual_seed(args.seed)
    with contextlib.ExitStack() as stack:  # unwound on exit, Ctrl-C and SIGTERM alike
        addresses = args.connect or _start_servers(stack, args)
        print(f"loader servers: {addresses}; training on {device}")
        if args.task == "detection":
            _detection(stack, addresses, args, device)
            return 0
        if args.task == "video":
            from remoteloader.tools import demo_video

            demo_video.train_and_evaluate(stack, addresses, args, device)
            return 0
        train, evaluate = _loaders(stack, addresses, args, device)
        model = _model(len(train.class_names)).to(device).to(memory_format=torch.channels_last)
        print(f"{train.num_samples} images, {len(train)} batches of {args.batch_size} per epoch")
        if len(train) == 0:
            raise SystemExit(
                f"the servers hold {train.num_samples} images, fewer than --batch-size "
                f"{args.batch_size}: no whole batch to train on"
            )
        _train(model, train, args.epochs)
        print(_path(train))
        correct, total = _accuracy(model, evaluate)
        print(f"accuracy (eval pipeline, {total} images): {correct / total:.1%}")
    return 0


def _start_servers(stack: contextlib.ExitStack, args: argparse.Namespace) -> str:
    """Writes the dataset (into a temporary folder without ``--data``) and starts a server per
    shard, each stopped when ``stack`` unwinds; returns their addresses."""
    from remoteloader.tools.local import LocalServer

    root = pathlib.Path(args.data or stack.enter_context(tempfile.TemporaryDirectory()))
    servers = []
    for shard in _writer(args)(root, args):
        server = LocalServer(shard, args=["--workers", str(args.workers), "--log-level", "WARNING"])
        stack.callback(server.stop)
        servers.append(server.start())
    return ",".join(s.address for s in servers)


def _writer(args: argparse.Namespace):
    """What writes the dataset's shards for the task."""
    if args.task == "video":
        from remoteloader.tools import demo_video

        return demo_video.write_shards
    return _write_detection_shards if args.task == "detection" else _write_shards


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


def _path(loader) -> str:
    """How the batches came: from same-host servers' memory, or over gRPC (``stats()["servers"]``)."""
    servers = loader.stats()["servers"]
    shared = sorted(a for a, s in servers.items() if s["shared_memory"])
    if len(shared) == len(servers):
        return "batches read from the servers' shared memory (same host; RemoteLoader(shared_memory=False): gRPC)"
    if not shared:
        return "batches received over gRPC"
    return f"batches read from shared memory from {', '.join(shared)} (same host), over gRPC from the others"


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
    """Refuses bad arguments before anything is written or started; fills in the defaults that
    depend on --task."""
    task = getattr(args, "task", "classification")
    if getattr(args, "video", False):
        if task == "detection":
            raise SystemExit(f"--video trains a video classifier; it does not go with --task {task}")
        task = "video"
    args.task = task
    for other in DEFAULTS:
        for name in DEFAULTS[other]:
            if other != task and name not in DEFAULTS[task] and getattr(args, name, None) is not None:
                mode = {other: f"--task {other}" for other in TASKS} | {"video": "--video"}
                raise SystemExit(f"--{name.replace('_', '-')} is for {mode[other]}, not {mode[task]}")
    for name, value in DEFAULTS[task].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if task == "classification" and not 2 <= args.classes <= len(CLASSES):
        raise SystemExit(f"--classes={args.classes}: expected 2..{len(CLASSES)}")
    if task == "video" and not 2 <= args.classes <= 4:
        raise SystemExit(f"--classes={args.classes}: expected 2..4 with --video")
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
    if task == "detection":
        per_shard = args.images // args.servers
        if per_shard < 1:
            raise SystemExit(f"--images={args.images}: each of the {args.servers} shards needs at least one image")
        total = per_shard * args.servers
        held_out = len(range(HOLD_OUT - 1, total, HOLD_OUT))  # as _Split holds them out
        if args.prepare:
            return
        if held_out < 1:
            raise SystemExit(f"--images={args.images}: too few to hold one in {HOLD_OUT} out for the evaluation")
        if total - held_out < args.batch_size:
            raise SystemExit(
                f"{total} images in all, {total - held_out} to train on (one in {HOLD_OUT} is held out): "
                f"fewer than --batch-size {args.batch_size}; raise --images or lower --batch-size"
            )
        return
    if task == "video":
        per_shard = args.videos_per_class // args.servers
        if per_shard < 1:
            raise SystemExit(
                f"--videos-per-class={args.videos_per_class}: each of the {args.servers} servers needs at least one "
                f"video per class"
            )
        if not args.prepare and args.classes * per_shard * args.servers < args.batch_size:
            raise SystemExit(
                f"{args.classes * per_shard * args.servers} videos in all, fewer than --batch-size "
                f"{args.batch_size}: raise --videos-per-class or lower --batch-size"
            )
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
    """The dataset folder must be new, empty, or hold only shard-<i>, detection-<i> and video-<i> folders
    (the demo's)."""
    if root is None:
        return
    root = pathlib.Path(root)
    if root.exists() and not root.is_dir():
        raise SystemExit(f"{root} is not a folder")
    strangers = (
        [p.name for p in root.iterdir() if not re.fullmatch(r"(shard|detection|video)-\d+", p.name)]
        if root.exists()
        else []
    )
    if strangers:
        raise SystemExit(
            f"{root} holds {', '.join(sorted(strangers)[:3])}{' ...' if len(strangers) > 3 else ''}, "
            f"which the demo did not write; give it a new or empty folder"
        )


def remake(shard: pathlib.Path, recipe: str, own: list[str], write: Callable[[], object]) -> None:
    """Writes ``shard`` with ``write()`` unless it was written whole with this ``recipe`` before.

    Its marker (DONE_MARKER, holding the recipe) is written last: a shard whose writing was cut
    short (Ctrl-C, a killed container), or made with other arguments, is written again, never
    served half-made. Its folder may be a mounted volume, so it is emptied of the demo's own
    files (``own``: glob patterns) and of the folders that leaves empty, not renamed."""
    done = shard / DONE_MARKER
    if done.exists() and done.read_text() == recipe:
        return
    done.unlink(missing_ok=True)
    emptied = set()
    for pattern in own:
        for old in shard.glob(pattern):
            old.unlink()
            emptied.add(old.parent)
    for folder in emptied - {shard}:
        if not any(folder.iterdir()):
            folder.rmdir()
    write()
    done.write_text(recipe)


def _write_shards(root: pathlib.Path, args: argparse.Namespace) -> list[pathlib.Path]:
    from remoteloader.tools.textures import make_imagefolder

    classes = CLASSES[: args.classes]
    shards = []
    t0 = time.perf_counter()
    per = args.images_per_class // args.servers
    for i in range(args.servers):
        shard = root / f"shard-{i}"
        recipe = f"classes={len(classes)} images_per_class={args.images_per_class} seed={args.seed}\n"
        seed = args.seed * 1000 + i
        remake(
            shard,
            recipe,
            [f"{name}/*.jpg" for name in CLASSES],
            functools.partial(make_imagefolder, shard, classes, per, size=(96, 128), seed=seed, jitter=0.2),
        )
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


# ---- --task detection ---------------------------------------------------------------------


def _write_detection_shards(root: pathlib.Path, args: argparse.Namespace) -> list[pathlib.Path]:
    """Writes (or reuses) ``root/detection-<i>``, a COCO-style shapes dataset per server, each
    with its own seed; returns their annotation files."""
    from remoteloader.tools.shapes import CATEGORIES, make_coco

    per = args.images // args.servers
    files = []
    t0 = time.perf_counter()
    for i in range(args.servers):
        shard = root / f"detection-{i}"
        recipe = f"detection images={per} seed={args.seed}\n"
        seed = args.seed * 1000 + i
        remake(
            shard,
            recipe,
            ["annotations.json", "images/*.jpg"],
            functools.partial(make_coco, shard, per, size=(96, 128), seed=seed),
        )
        files.append(shard / "annotations.json")
    print(
        f"dataset: {args.servers} shard(s) under {root}, {per * args.servers} images of "
        f"{len(CATEGORIES)} shape classes ({time.perf_counter() - t0:.1f}s)",
        flush=True,
    )
    return files


class _Split:
    """The detection demo's sampler: the held-out sample ids (every ``HOLD_OUT``-th), in order,
    or the others, shuffled every epoch. The ids exist once the loaders have connected and
    know how many samples the servers hold (``bind``); until then it is empty (RemoteLoader
    only reads a sampler when it plans an epoch)."""

    def __init__(self, held_out: bool, seed: int = 0):
        import numpy as np

        self.held_out, self.seed, self.epoch = held_out, seed, 0
        self.ids = np.empty(0, np.int64)

    def bind(self, num_samples: int) -> None:
        import numpy as np

        ids = np.arange(num_samples, dtype=np.int64)
        self.ids = ids[(ids % HOLD_OUT == HOLD_OUT - 1) == self.held_out]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self):
        import numpy as np

        if self.held_out:
            return iter(self.ids.tolist())
        return iter(np.random.default_rng((self.seed, self.epoch)).permutation(self.ids).tolist())


def _detection(stack: contextlib.ExitStack, addresses: str, args: argparse.Namespace, device: str) -> None:
    """Trains the detector on "detection-train" and evaluates it on "detection-eval" over the
    held-out images."""
    import warnings

    import torch

    from remoteloader.client import RemoteLoader

    fields = ["bboxes", "bbox_labels"]
    train_ids, eval_ids = _Split(held_out=False, seed=args.seed), _Split(held_out=True)
    try:
        with warnings.catch_warnings():  # servers without boxes: said below, in one line
            warnings.filterwarnings("ignore", message="RemoteLoader: none of the servers' shards carry")
            train = stack.enter_context(
                RemoteLoader(
                    addresses,
                    batch_size=args.batch_size,
                    image_size=args.image_size,
                    pipeline="detection-train",
                    seed=args.seed,
                    sampler=train_ids,
                    normalize=(MEAN, STD),
                    device=device,
                    fields=fields,
                )
            )
            evaluate = stack.enter_context(
                RemoteLoader(
                    addresses,
                    batch_size=args.batch_size,
                    image_size=args.image_size,
                    pipeline="detection-eval",
                    sampler=eval_ids,
                    drop_last=False,
                    normalize=(MEAN, STD),
                    device=device,
                    fields=fields,
                )
            )
    except (OSError, ValueError) as exc:  # as in _loaders
        if not args.connect:
            raise
        raise SystemExit(f"--connect={args.connect}: {exc}") from None
    if "bboxes" not in train.sample_space.fields:
        raise SystemExit(
            f"--connect={args.connect}: the servers' data carries no boxes (it carries "
            f"{', '.join(train.sample_space.fields) or 'no targets'}); serve tar shards with boxes or a "
            f"COCO annotation file, e.g. DIR/detection-0/annotations.json from "
            f"`remoteloader demo --task detection --prepare DIR`"
        )
    train_ids.bind(train.num_samples)
    eval_ids.bind(evaluate.num_samples)
    print(
        f"{train.num_samples} images: {len(train_ids)} to train on, {len(eval_ids)} held out; "
        f"{len(train)} batches of {args.batch_size} per epoch"
    )
    if len(train) == 0:
        raise SystemExit(
            f"the servers hold {train.num_samples} images, {len(train_ids)} to train on (one in {HOLD_OUT} "
            f"is held out): fewer than --batch-size {args.batch_size}, no whole batch to train on"
        )
    if len(eval_ids) == 0:
        raise SystemExit(
            f"the servers hold {train.num_samples} images: too few to hold one in {HOLD_OUT} out for the evaluation"
        )
    model = _detector(len(train.class_names)).to(device).to(memory_format=torch.channels_last)
    _train_detector(model, train, args.epochs)
    _evaluate_detector(model, evaluate)


def _detector(num_classes: int):
    """A one-stage detector small enough for a CPU: three stride-2 convolutions down to a grid
    of cells ``STRIDE`` pixels wide, two more for context (each cell sees a 47-pixel square),
    then per cell: a logit for "a box's centre is in this cell", the centre's offset in the
    cell (2, through a sigmoid), the box's log width and height in cells (2), class logits."""
    import torch
    import torch.nn as nn

    def conv(cin, cout, stride):
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
        )

    head = nn.Conv2d(64, 5 + num_classes, 1)
    assert head.bias is not None
    with torch.no_grad():
        head.bias[0] = -4.0  # few cells hold a centre: start by saying none does (as RetinaNet's prior)
    return nn.Sequential(conv(3, 16, 2), conv(16, 32, 2), conv(32, 64, 2), conv(64, 64, 1), conv(64, 64, 1), head)


def _grid_targets(bboxes, labels, grid: tuple[int, int]):
    """Each true box as its centre's cell sees it: (centre [B, H, W], label [B, H, W],
    box [B, H, W, 4] = centre offset in the cell, log width and height in cells)."""
    import torch

    rows, cols = grid
    boxes = torch.cat(list(bboxes)).float().reshape(-1, 4)
    device = boxes.device
    counts = torch.tensor([len(b) for b in bboxes], device=device)
    image = torch.repeat_interleave(torch.arange(len(bboxes), device=device), counts)
    centre = (boxes[:, :2] + boxes[:, 2:]) / (2 * STRIDE)
    size = (boxes[:, 2:] - boxes[:, :2]).clamp(min=1.0) / STRIDE
    x = centre[:, 0].long().clamp(0, cols - 1)
    y = centre[:, 1].long().clamp(0, rows - 1)
    here = torch.zeros(len(bboxes), rows, cols, device=device)
    label = torch.zeros(len(bboxes), rows, cols, dtype=torch.long, device=device)
    box = torch.zeros(len(bboxes), rows, cols, 4, device=device)
    here[image, y, x] = 1.0  # (two centres in one cell, rare with these shapes: one of them wins)
    label[image, y, x] = torch.cat(list(labels)).to(device)
    box[image, y, x] = torch.cat([centre - torch.stack([x, y], 1), size.log()], 1)
    return here, label, box


def _detection_loss(out, bboxes, labels):
    """Centre-or-not (binary cross-entropy, every cell), class (cross-entropy) and box (L1 on
    the offset and log size), at the cells holding a centre; per true box."""
    import torch.nn.functional as F

    out = out.permute(0, 2, 3, 1).float()  # [B, H, W, 5 + C]
    here, label, box = _grid_targets(bboxes, labels, out.shape[1:3])
    centres = here > 0
    count = centres.sum().clamp(min=1)
    cells = out[centres]
    loss = F.binary_cross_entropy_with_logits(out[..., 0], here, reduction="sum")
    loss = loss + F.cross_entropy(cells[:, 5:], label[centres], reduction="sum")
    loss = loss + F.l1_loss(cells[:, 1:3].sigmoid(), box[centres][:, :2], reduction="sum")
    loss = loss + F.l1_loss(cells[:, 3:5], box[centres][:, 2:], reduction="sum")
    return loss / count


def _train_detector(model, train, epochs: int) -> None:
    """As _train: a row per epoch with images/s, the share of the time spent waiting for data,
    and the mean loss (one-cycle learning rate)."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    steps = epochs * len(train)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.2)
    step = 0
    print(f"{'epoch':>5} {'images/s':>9} {'data wait':>9} {'loss':>7}")
    for epoch in range(epochs):
        signals.raise_if_stopped()
        train.set_epoch(epoch)
        model.train()
        seen, total_loss, waited = 0, 0.0, 0.0
        start = time.perf_counter()
        fetch = time.perf_counter()
        for batch in train:
            waited += time.perf_counter() - fetch
            images = batch["images"]
            loss = _detection_loss(model(images), batch["bboxes"], batch["bbox_labels"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step < steps:  # (a batch whose samples all failed is left out: fewer steps, never more)
                schedule.step()
            seen += len(images)
            total_loss += loss.item() * len(images)
            fetch = time.perf_counter()
            signals.raise_if_stopped()
        elapsed = time.perf_counter() - start
        print(f"{epoch:>5} {seen / elapsed:>9.0f} {waited / elapsed:>8.0%} {total_loss / seen:>7.3f}", flush=True)


def _box_iou(a, b):
    """IoU of every box in ``a`` [N, 4] with every box in ``b`` [M, 4] (pascal_voc): [N, M]."""
    import torch

    top_left = torch.max(a[:, None, :2], b[None, :, :2])
    bottom_right = torch.min(a[:, None, 2:], b[None, :, 2:])
    inter = (bottom_right - top_left).clamp(min=0).prod(-1)
    area_a = (a[:, 2:] - a[:, :2]).clamp(min=0).prod(-1)
    area_b = (b[:, 2:] - b[:, :2]).clamp(min=0).prod(-1)
    return inter / (area_a[:, None] + area_b[None, :] - inter).clamp(min=1e-6)


def _predict(out, width: int, height: int, threshold: float = 0.5, overlap: float = 0.4):
    """Per image: (boxes [k, 4] in pixels of the input, labels [k]) on the CPU, from the cells
    whose centre score is over ``threshold``, best first; a box overlapping a better one by more
    than ``overlap`` IoU is dropped (non-maximum suppression; the shapes never overlap)."""
    import torch

    out = out.permute(0, 2, 3, 1).float().cpu()
    rows, cols = out.shape[1:3]
    y, x = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    centre = (torch.stack([x, y], -1) + out[..., 1:3].sigmoid()) * STRIDE
    half = out[..., 3:5].clamp(max=8.0).exp() * (STRIDE / 2)
    limit = torch.tensor([width, height, width, height], dtype=out.dtype)
    boxes = torch.min(torch.cat([centre - half, centre + half], -1).clamp(min=0), limit)
    scores, labels = out[..., 0].sigmoid(), out[..., 5:].argmax(-1)
    results = []
    for image in range(len(out)):
        keep = scores[image] > threshold
        order = scores[image][keep].argsort(descending=True)
        found, found_labels = boxes[image][keep][order], labels[image][keep][order]
        ious = _box_iou(found, found)
        kept: list[int] = []
        for i in range(len(found)):
            if not kept or ious[i, kept].max() <= overlap:
                kept.append(i)
        results.append((found[kept], found_labels[kept]))
    return results


def _match(ious):
    """One-to-one matching of true boxes (rows) to predicted ones (columns), best IoU first:
    (the IoU each true box got [N], 0 without a match; the predicted box it got [N], -1)."""
    import torch

    ious = ious.clone()
    best = torch.zeros(ious.shape[0])
    match = torch.full((ious.shape[0],), -1, dtype=torch.long)
    for _ in range(min(ious.shape)):
        value, flat = ious.flatten().max(0)
        if value <= 0:
            break
        row, col = divmod(int(flat), ious.shape[1])
        best[row], match[row] = value, col
        ious[row, :] = -1
        ious[:, col] = -1
    return best, match


def _evaluate_detector(model, evaluate) -> None:
    """One pass of the held-out images: the mean IoU of the true boxes with the predicted boxes
    matched to them one to one (0 for a box nothing was matched to), next to the IoU that one
    constant box, the mean of all true boxes, gets with every true box; then the share of true
    boxes found (IoU >= FOUND_IOU, right class) and the share of predicted boxes that found one."""
    import torch

    model.eval()
    ious, truths = [], []
    images = found = predicted = 0
    with torch.no_grad():
        for batch in evaluate:
            signals.raise_if_stopped()
            height, width = batch["images"].shape[-2:]
            predictions = _predict(model(batch["images"]), width, height)
            for (boxes, labels), true_boxes, true_labels in zip(predictions, batch["bboxes"], batch["bbox_labels"]):
                true_boxes, true_labels = true_boxes.float().cpu().reshape(-1, 4), true_labels.cpu()
                best, match = _match(_box_iou(true_boxes, boxes))
                hit = (match >= 0) & (best >= FOUND_IOU)
                hit[hit.clone()] = labels[match[hit]] == true_labels[hit]
                found += int(hit.sum())
                predicted += len(boxes)
                ious.append(best)
                truths.append(true_boxes)
            images += len(batch["images"])
    all_ious, all_truths = torch.cat(ious), torch.cat(truths)
    if not len(all_truths):
        print(f"eval (detection-eval, {images} held-out images): they hold no boxes")
        return
    constant = _box_iou(all_truths, all_truths.mean(0, keepdim=True)).mean()
    print(
        f"mean IoU (detection-eval, {images} held-out images, {len(all_truths)} boxes): "
        f"{all_ious.mean():.3f}; one constant box (the mean true box) gets {constant:.3f}"
    )
    print(
        f"boxes found (IoU >= {FOUND_IOU}, right class): {found / len(all_truths):.1%}; "
        f"predicted boxes that found one: {found / max(predicted, 1):.1%} of {predicted}"
    )
