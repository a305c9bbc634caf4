"""Detection at 640 px with boxes: RemoteLoader vs. torch DataLoader running the same albumentations pipeline.

    python benchmarks/detection.py [--images N] [--epochs E] [--batch-size B] [--workers K]
                                   [--servers S] [--data DIR] [--decoder opencv|pil] [--json PATH]
    python benchmarks/detection.py --quick          # a check in under a minute

One run, on the same cores, measures loaders that produce the same thing: the server's
``detection-train`` preset at 640x640 (fit the image in 640x640, scale it by 0.5..1.5, pad
with grey, random 640x640 crop, horizontal flip; boxes clipped, those left outside dropped),
uint8 NHWC images plus per-image pascal_voc boxes and their labels:

  remote          RemoteLoader(pipeline="detection-train", fields=["bboxes", "bbox_labels"],
                  receiver="thread") fed by S local ``remoteloader-server``s (127.0.0.1) serving
                  the COCO file, K decode workers in all
  remote-process  the same with receiver="process": a child process receives into shared memory
  dataloader      torch DataLoader(num_workers=K): cv2.imread + cvtColor (or PIL), the COCO boxes
                  as pascal_voc, the very A.Compose the server runs (pipelines.build_compose),
                  and a collate_fn giving uint8 NHWC images and lists of box and label tensors

The dataset is generated once (tools.shapes.make_coco: about 480x640, up to 6 shapes each)
and cached. Epochs alternate (remote, remote-process, dataloader, remote, ...) after warm-up
epochs, so drift and neighbours' load hit all alike. The figure that matters besides
images/s is the training process's own CPU per image (time.process_time: all its threads,
none of its children): what feeding the model takes from the trainer. The issue's targets:
at least 1.2x the DataLoader's images/s, and at most a tenth of its training-host CPU per
image: the training process and its children (the DataLoader's workers; the receiver
process), what stays on the training host when the servers run elsewhere. See
benchmarks/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _common  # noqa: E402
import albumentations as A  # noqa: E402
import cv2  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from throughput import _raise_exit, _worker_init, shutdown_dataloader  # noqa: E402
from torch.utils.data import DataLoader, Dataset, default_collate  # noqa: E402

from remoteloader.client import cpu  # noqa: E402
from remoteloader.server.pipelines import PipelineSpec, build_compose  # noqa: E402
from remoteloader.tools.local import LocalServer  # noqa: E402
from remoteloader.tools.shapes import CATEGORIES, make_coco  # noqa: E402

LOADERS = ("remote", "remote-process", "dataloader")
TITLES = {
    "remote": "RemoteLoader (receiver=thread)",
    "remote-process": "RemoteLoader (receiver=process)",
    "dataloader": "DataLoader + albumentations",
}
RECEIVER = {"remote": "thread", "remote-process": "process"}
PIPELINE = "detection-train"
FIELDS = ("bboxes", "bbox_labels")
NUM_LABELS = len(CATEGORIES)  # labels 1..C (0 is the background), as the server numbers COCO categories
DEFAULT_DATA = _common.DEFAULT_DATA.with_name("coco-shapes")
TARGET_SPEEDUP = 1.2  # remote images/s over the DataLoader's, at least
TARGET_CPU_FACTOR = 10.0  # DataLoader's training-host CPU per image over remote's, at least

# ---- the dataset -----------------------------------------------------------------------------

# make_coco draws every image from one generator in sequence, so the dataset is made of parts
# of PART images, each its own make_coco call with a seed of its own: parts are generated in
# parallel, and a larger --images only adds parts. annotations-N.json joins the first N images.
PART = 250
GENERATOR = {
    "generator": "remoteloader.tools.shapes.make_coco",
    "version": 1,
    "seed": 0,
    "size": [480, 640],
    "jitter": 0.15,
    "max_shapes": 6,
    "quality": 90,
    "part": PART,
}


def _part_seed(seed: int, part: int) -> int:
    return int(np.random.SeedSequence([seed, part]).generate_state(1)[0])


def _make_part(job: tuple[str, int]) -> int:
    root, part = job
    final = pathlib.Path(root) / "parts" / f"part_{part:04d}"
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    make_coco(
        tmp,
        PART,
        size=tuple(GENERATOR["size"]),
        seed=_part_seed(GENERATOR["seed"], part),
        jitter=GENERATOR["jitter"],
        max_shapes=GENERATOR["max_shapes"],
        quality=GENERATOR["quality"],
    )
    os.replace(tmp, final)  # a part is there whole or not at all (Ctrl-C)
    return part


def ensure_coco(root: pathlib.Path, count: int, processes: int = 1) -> pathlib.Path:
    """Generates (or reuses) the parts holding images 0..count-1 under ``root`` and writes
    ``root/annotations-<count>.json``, a COCO instances file of exactly those images; returns its path.
    A non-empty directory without our manifest is refused, never modified."""
    root = pathlib.Path(root).expanduser()
    manifest_path = root / _common.MANIFEST
    manifest = _common.read_manifest(root)
    parts_dir = root / "parts"
    if manifest is not None and {k: manifest.get(k) for k in GENERATOR} != GENERATOR:
        shutil.rmtree(parts_dir, ignore_errors=True)  # made by another generator version
        for old in root.glob("annotations-*.json"):
            old.unlink()
    parts_dir.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps(GENERATOR))
    for leftover in parts_dir.glob(".part_*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)  # left by an interrupted run
    wanted = range((count + PART - 1) // PART)
    missing = [p for p in wanted if not (parts_dir / f"part_{p:04d}" / "annotations.json").exists()]
    if missing:
        print(
            f"generating {len(missing) * PART} COCO images in {parts_dir} ({processes} processes) ...",
            file=sys.stderr,
            flush=True,
        )
        started = time.perf_counter()
        ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        with ctx.Pool(max(1, min(processes, len(missing)))) as pool:
            for done, _ in enumerate(pool.imap_unordered(_make_part, [(str(root), p) for p in missing]), 1):
                print(
                    f"  {done * PART}/{len(missing) * PART} ({time.perf_counter() - started:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
    path = root / f"annotations-{count}.json"
    if not path.exists():
        images, annotations, categories = [], [], None
        for p in wanted:
            part = json.loads((parts_dir / f"part_{p:04d}" / "annotations.json").read_text())
            categories = part["categories"]
            new_id = {}
            for image in part["images"]:
                if len(images) == count:
                    break
                new_id[image["id"]] = len(images) + 1
                images.append({**image, "id": len(images) + 1, "file_name": f"parts/part_{p:04d}/{image['file_name']}"})
            for ann in part["annotations"]:
                if ann["image_id"] in new_id:
                    annotations.append({**ann, "id": len(annotations) + 1, "image_id": new_id[ann["image_id"]]})
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
        os.replace(tmp, path)
    return path


def read_coco(path: pathlib.Path) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(image path, pascal_voc boxes float32 [n, 4], labels int64 [n]) per image, in image-id order,
    as the server reads a COCO file (server/coco.py): categories sorted by id become labels
    1..C, crowd boxes and boxes of no width or height are left out."""
    document = json.loads(path.read_text())
    labels = {c["id"]: i + 1 for i, c in enumerate(sorted(document["categories"], key=lambda c: c["id"]))}
    by_image: dict[int, list[dict]] = {}
    for ann in document["annotations"]:
        by_image.setdefault(ann["image_id"], []).append(ann)
    samples = []
    for image in sorted(document["images"], key=lambda im: im["id"]):
        boxes, box_labels = [], []
        for ann in by_image.get(image["id"], []):
            x, y, w, h = ann["bbox"]
            if ann.get("iscrowd", 0) or w <= 0 or h <= 0:
                continue
            boxes.append((x, y, x + w, y + h))
            box_labels.append(labels[ann["category_id"]])
        samples.append(
            (
                str(path.parent / image["file_name"]),
                np.asarray(boxes, np.float32).reshape(-1, 4),
                np.asarray(box_labels, np.int64),
            )
        )
    return samples


def dataset_stats(samples: list[tuple[str, np.ndarray, np.ndarray]]) -> dict:
    """File sizes (KB), image dimensions (from the headers) and boxes per image."""
    sizes = np.array([os.path.getsize(p) for p, _, _ in samples], dtype=np.float64) / 1000
    dims = []
    for p, _, _ in samples:
        with Image.open(p) as im:
            dims.append(im.size)  # (w, h)
    dims = np.array(dims)
    boxes = np.array([len(b) for _, b, _ in samples])
    return {
        "images": len(samples),
        "total_mb": float(sizes.sum() / 1000),
        "kb_mean": float(sizes.mean()),
        "kb_median": float(np.median(sizes)),
        "kb_p5": float(np.percentile(sizes, 5)),
        "kb_p95": float(np.percentile(sizes, 95)),
        "mean_width": float(dims[:, 0].mean()),
        "mean_height": float(dims[:, 1].mean()),
        "min_side": int(dims.min()),
        "max_side": int(dims.max()),
        "boxes_per_image": float(boxes.mean()),
        "boxes_max": int(boxes.max()),
        "bits_per_pixel": float((sizes * 8000).sum() / (dims[:, 0] * dims[:, 1]).sum()),
    }


# ---- the DataLoader baseline ---------------------------------------------------------------


def detection_compose(size: int) -> A.Compose:
    """The exact albumentations pipeline the server runs for detection-train with boxes."""
    return build_compose(PipelineSpec(PIPELINE, size, size, fields=FIELDS), allow_custom=False)


class CocoDetectionSet(Dataset):
    """COCO images and boxes through ``detection_compose``: (HWC uint8, boxes [n, 4], labels [n])."""

    def __init__(self, samples: list[tuple[str, np.ndarray, np.ndarray]], size: int, decoder: str = "opencv"):
        self.samples = samples
        self.decoder = decoder
        self.transform = detection_compose(size)  # throughput._worker_init reseeds it per worker

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, boxes, labels = self.samples[index]
        if self.decoder == "opencv":
            img = cv2.imread(path, cv2.IMREAD_COLOR)
            if img is None:
                raise OSError(f"OpenCV cannot read {path}")
            img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        else:
            with open(path, "rb") as f:  # torchvision.datasets.folder.pil_loader
                img = np.asarray(Image.open(f).convert("RGB"))
        h, w = img.shape[:2]
        boxes = boxes.copy()  # clipped to the image, as the server does (targets.fit_boxes)
        np.clip(boxes[:, 0::2], 0, w, out=boxes[:, 0::2])
        np.clip(boxes[:, 1::2], 0, h, out=boxes[:, 1::2])
        out = self.transform(image=img, bboxes=boxes, bbox_labels=labels)
        return (
            out["image"],
            np.asarray(out["bboxes"], np.float32).reshape(-1, 4),
            np.asarray(out["bbox_labels"], np.int64).reshape(-1),
        )


def detection_collate(batch):
    """uint8 NHWC images (stacked into shared memory in the worker, as default_collate does) and
    per-image lists of box and label tensors: the dict a RemoteLoader yields."""
    return {
        "images": default_collate([torch.from_numpy(image) for image, _, _ in batch]),
        "bboxes": [torch.from_numpy(boxes) for _, boxes, _ in batch],
        "bbox_labels": [torch.from_numpy(labels) for _, _, labels in batch],
    }


def make_dataloader(dataset: Dataset, batch_size: int, workers: int) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        drop_last=True,
        persistent_workers=workers > 0,
        worker_init_fn=_worker_init,
        collate_fn=detection_collate,
    )


# ---- measuring -----------------------------------------------------------------------------

CPU_PARTS = ("client", "client_children", "server_main", "server_workers")


def cpu_split(me: int, servers: list[int]) -> dict[str, float]:
    """CPU seconds so far of: this process, its descendants other than the servers (DataLoader
    workers, the receiver process), the servers' main processes and their descendants."""
    table = cpu.processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)

    def below(root: int, skip: set[int]) -> float:
        total, stack = 0.0, list(children.get(root, ()))
        while stack:
            pid = stack.pop()
            if pid in skip or pid not in table:
                continue
            total += table[pid][1]
            stack.extend(children.get(pid, ()))
        return total

    return {
        "client": table.get(me, (0, 0.0))[1],
        "client_children": below(me, set(servers)),
        "server_main": sum(table.get(s, (0, 0.0))[1] for s in servers),
        "server_workers": sum(below(s, set()) for s in servers),
    }


def run_epoch(name: str, loader, epoch: int, servers: list[int], batch: int, size: int, expect_images: int) -> dict:
    """Iterates one whole epoch; the loop only touches each batch (image count, box count)."""
    if name != "dataloader":
        loader.set_epoch(epoch)
    me = os.getpid()
    cpu0 = cpu_split(me, servers)
    own0 = time.process_time()
    t0 = time.perf_counter()
    first = sample = None
    images = batches = boxes = 0
    iterator = iter(loader)
    try:
        for b in iterator:
            if first is None:
                first = time.perf_counter() - t0
                sample = b  # checked after the clock stops
            images += b["images"].shape[0]
            boxes += sum(len(x) for x in b["bbox_labels"])
            batches += 1
    finally:
        close = getattr(iterator, "close", None)  # a generator left early cancels its epoch
        if close is not None:
            close()
    wall = time.perf_counter() - t0
    own = time.process_time() - own0
    cpu1 = cpu_split(me, servers)
    cpu = {k: cpu1[k] - cpu0[k] for k in CPU_PARTS}
    if sample is None:
        raise RuntimeError(f"{name}: epoch {epoch} delivered no batch")
    _check_batch(name, sample, batch, size)
    del sample
    if images != expect_images:
        raise RuntimeError(f"{name}: epoch {epoch} delivered {images} images, expected {expect_images}")
    return {
        "loader": name,
        "epoch": epoch,
        "images": images,
        "batches": batches,
        "boxes": boxes,
        "wall_s": wall,
        "images_per_s": images / wall if wall > 0 else 0.0,
        "first_batch_s": first or 0.0,
        "training_cpu_s": own,
        "cpu_s": sum(cpu.values()),
        "cpu_parts_s": cpu,
        "server_cpu_s": cpu["server_main"] + cpu["server_workers"],
    }


def _check_batch(name: str, b: dict, batch: int, size: int) -> None:
    images, boxes, labels = b["images"], b["bboxes"], b["bbox_labels"]
    if tuple(images.shape) != (batch, size, size, 3) or images.dtype != torch.uint8:
        raise RuntimeError(
            f"{name}: got images of {tuple(images.shape)} {images.dtype}, expected {(batch, size, size, 3)} uint8"
        )
    if len(boxes) != batch or len(labels) != batch:
        raise RuntimeError(f"{name}: {len(boxes)} box tensors and {len(labels)} label tensors for {batch} images")
    for i, (bx, lb) in enumerate(zip(boxes, labels)):
        if bx.dtype != torch.float32 or bx.shape != (len(lb), 4) or lb.dtype != torch.int64:
            raise RuntimeError(
                f"{name}: image {i} has boxes {tuple(bx.shape)} {bx.dtype} and labels {tuple(lb.shape)} {lb.dtype}"
            )
        if len(lb) and (int(lb.min()) < 1 or int(lb.max()) > NUM_LABELS):
            raise RuntimeError(f"{name}: image {i} has labels {lb.tolist()}, expected 1..{NUM_LABELS}")
        if len(bx) and (
            float(bx.min()) < 0
            or float(bx.max()) > size
            or bool((bx[:, 2] <= bx[:, 0]).any() | (bx[:, 3] <= bx[:, 1]).any())
        ):
            raise RuntimeError(f"{name}: image {i} has boxes outside the {size}x{size} image or empty: {bx.tolist()}")
    if float(images[:4].float().std()) < 1.0:
        raise RuntimeError(f"{name}: the first images of the batch are flat (all zeros?)")


def training_host_ms(summary: dict) -> float:
    """CPU ms per image that stays on the training host when the servers run elsewhere: the
    training process and its children (the DataLoader's workers, the receiver process)."""
    parts = summary["median_cpu_ms_per_image_by_part"]
    return parts["client"] + parts["client_children"]


def summarize(records: list[dict], cores: int) -> dict:
    rates = [r["images_per_s"] for r in records]

    def med(values):
        values = list(values)
        return statistics.median(values) if values else 0.0

    return {
        "epochs": len(records),
        "images_per_epoch": records[0]["images"] if records else 0,
        "median_images_per_s": med(rates),
        "min_images_per_s": min(rates, default=0.0),
        "max_images_per_s": max(rates, default=0.0),
        "median_training_cpu_ms_per_image": med(1000 * r["training_cpu_s"] / r["images"] for r in records),
        "median_cpu_ms_per_image": med(1000 * r["cpu_s"] / r["images"] for r in records),
        "cpu_bound_images_per_s": cores * 1000 / med(1000 * r["cpu_s"] / r["images"] for r in records)
        if records
        else 0.0,
        "median_cpu_utilization": med(r["cpu_s"] / r["wall_s"] / cores for r in records if r["wall_s"] > 0),
        "median_first_batch_s": med(r["first_batch_s"] for r in records),
        "boxes_per_image": sum(r["boxes"] for r in records) / max(1, sum(r["images"] for r in records)),
        "server_cpu_s": sum(r["server_cpu_s"] for r in records),
        "median_cpu_ms_per_image_by_part": {
            k: med(1000 * r["cpu_parts_s"][k] / r["images"] for r in records) for k in CPU_PARTS
        },
    }


def markdown_table(summary: dict[str, dict], order: list[str]) -> str:
    lines = [
        "| loader | timed epochs x images | median img/s | min-max img/s | training process CPU ms/img | "
        "all processes CPU ms/img | img/s at full CPU | CPU use | first batch s | boxes/img | server CPU s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in order:
        s = summary[name]
        lines.append(
            f"| {TITLES[name]} | {s['epochs']} x {s['images_per_epoch']} | {s['median_images_per_s']:.1f} | "
            f"{s['min_images_per_s']:.1f}-{s['max_images_per_s']:.1f} | "
            f"{s['median_training_cpu_ms_per_image']:.3f} | {s['median_cpu_ms_per_image']:.2f} | "
            f"{s['cpu_bound_images_per_s']:.0f} | "
            f"{100 * s['median_cpu_utilization']:.0f}% | {s['median_first_batch_s']:.2f} | "
            f"{s['boxes_per_image']:.2f} | {s['server_cpu_s']:.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    cores = _common.default_cores()
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="a check in under a minute: --images 256 --epochs 2 (unless given)"
    )
    parser.add_argument("--images", type=int, help="images in the dataset (default 2000; --quick: 256)")
    parser.add_argument("--epochs", type=int, help="timed epochs per loader (default 3; --quick: 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed epochs per loader first (default 1)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    parser.add_argument("--image-size", type=int, default=640, help="output side (default 640)")
    parser.add_argument(
        "--workers",
        type=int,
        default=cores,
        help=f"decode workers of all servers together, and the DataLoader's num_workers "
        f"(default: the {cores} usable cores)",
    )
    parser.add_argument("--servers", type=int, default=1, help="local servers sharing --workers (default 1)")
    parser.add_argument(
        "--decoder",
        choices=("opencv", "pil"),
        default="opencv",
        help="how the DataLoader decodes: cv2.imread + cvtColor (default) or PIL convert('RGB')",
    )
    parser.add_argument(
        "--data", type=pathlib.Path, default=DEFAULT_DATA, help=f"cached COCO dataset (default {DEFAULT_DATA})"
    )
    parser.add_argument(
        "--loaders", default=",".join(LOADERS), help=f"comma-separated subset of {','.join(LOADERS)} (default: all)"
    )
    parser.add_argument("--json", type=pathlib.Path, help="also write every measurement to this JSON file")
    parser.add_argument(
        "--server-args",
        action="append",
        default=[],
        metavar="FLAG",
        help="a further remoteloader-server flag, =-joined, once per flag: e.g. --server-args=--chunk-bytes=4194304",
    )
    args = parser.parse_args(argv)
    if args.images is None:
        args.images = 256 if args.quick else 2000
    if args.epochs is None:
        args.epochs = 2 if args.quick else 3
    args.loaders = [x.strip() for x in args.loaders.split(",") if x.strip()]
    bad = [x for x in args.loaders if x not in LOADERS]
    if bad or not args.loaders:
        parser.error(f"--loaders: unknown {bad}; choose from {', '.join(LOADERS)}")
    for name in ("images", "epochs", "batch_size", "image_size", "workers", "servers"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.servers > args.workers:
        parser.error(f"--servers {args.servers} > --workers {args.workers}: every server needs a worker")
    if args.images < args.batch_size:
        parser.error(
            f"--images {args.images} < --batch-size {args.batch_size}: with drop_last an epoch would have no batch"
        )
    return args


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def main(argv=None) -> int:
    args = parse_args(argv)
    cores = _common.default_cores()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)  # run the cleanup below on kill/hang-up too

    annotations = ensure_coco(args.data, args.images, processes=cores)
    samples = read_coco(annotations)
    if len(samples) != args.images:
        raise SystemExit(f"{annotations} holds {len(samples)} images, expected {args.images}")
    stats = dataset_stats(samples)
    load = os.getloadavg()
    print("# remoteloader detection benchmark\n")
    print(
        f"data: {annotations}: {stats['images']} JPEGs, {stats['total_mb']:.0f} MB; file size mean "
        f"{stats['kb_mean']:.0f} KB, median {stats['kb_median']:.0f}, p5-p95 {stats['kb_p5']:.0f}-"
        f"{stats['kb_p95']:.0f}; mean {stats['mean_width']:.0f}x{stats['mean_height']:.0f} px (sides "
        f"{stats['min_side']}-{stats['max_side']}), {stats['bits_per_pixel']:.2f} bits/px; "
        f"{stats['boxes_per_image']:.2f} boxes per image (max {stats['boxes_max']}), {NUM_LABELS} classes"
    )
    print(
        f"host: {cores} usable cores ({os.cpu_count()} online), load average {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f}; python {platform.python_version()}, torch {torch.__version__}, "
        f"Pillow {Image.__version__}, OpenCV {cv2.__version__}, albumentations {A.__version__}"
    )
    print(
        f"config: pipeline {PIPELINE} {args.image_size}x{args.image_size} with {', '.join(FIELDS)}, batch "
        f"{args.batch_size}, {args.workers} workers per loader ({args.servers} server(s)), DataLoader decoder "
        f"{args.decoder}, {args.warmup} warm-up + {args.epochs} timed epochs per loader, "
        f"loaders {', '.join(args.loaders)}"
    )
    if load[0] > 0.5 * cores:
        print(
            f"warning: load average {load[0]:.1f} on {cores} cores: other processes compete; "
            f"images/s will be noisy (CPU ms/img much less so)"
        )
    sys.stdout.flush()

    servers: list[LocalServer] = []
    remotes: dict[str, object] = {}
    dataloader = None
    log_dir = tempfile.mkdtemp(prefix="remoteloader-bench-")
    records: list[dict] = []
    ok = False
    try:
        if any(name in RECEIVER for name in args.loaders):
            started = time.perf_counter()
            share = [args.workers // args.servers + (k < args.workers % args.servers) for k in range(args.servers)]
            for k, workers in enumerate(share):
                servers.append(
                    LocalServer(
                        annotations,
                        args=["--workers", str(workers), "--grace", "2", "--log-level", "INFO", *args.server_args],
                        env={"NO_ALBUMENTATIONS_UPDATE": "1"},
                        log_path=pathlib.Path(log_dir) / f"server{k}.log",
                    )
                )
            for server in servers:
                server.launch()
            for server in servers:
                server.wait_ready(timeout=120)
            listing = ", ".join(f"{s.address} (pid {s.process.pid}, {w} workers)" for s, w in zip(servers, share))
            print(
                f"servers: {listing}, reading {annotations}, ready in {time.perf_counter() - started:.1f}s; "
                f"logs in {log_dir}",
                flush=True,
            )
        server_pids = [s.process.pid for s in servers]
        per_epoch = len(samples) // args.batch_size * args.batch_size  # drop_last everywhere
        run = {"batch": args.batch_size, "size": args.image_size, "expect_images": per_epoch}
        epoch_no = {name: 0 for name in args.loaders}
        loaders: dict[str, object] = {}
        # Warm-up. The DataLoader forks its (persistent) workers here, before the RemoteLoaders
        # start gRPC threads in this process: forking after that is unsafe.
        if "dataloader" in args.loaders:
            dataloader = make_dataloader(
                CocoDetectionSet(samples, args.image_size, args.decoder), args.batch_size, args.workers
            )
            loaders["dataloader"] = dataloader
            for _ in range(args.warmup):
                r = run_epoch("dataloader", dataloader, epoch_no["dataloader"], server_pids, **run)
                epoch_no["dataloader"] += 1
                print(f"warm-up dataloader: {r['images_per_s']:.1f} img/s", flush=True)
        if servers:
            from remoteloader.client.loader import RemoteLoader

            for name in (n for n in LOADERS if n in RECEIVER and n in args.loaders):
                remote = RemoteLoader(
                    [s.address for s in servers],
                    batch_size=args.batch_size,
                    image_size=args.image_size,
                    pipeline=PIPELINE,
                    fields=list(FIELDS),
                    shuffle=True,
                    seed=0,
                    drop_last=True,
                    reconnect_timeout=5.0,
                    receiver=RECEIVER[name],
                )
                remotes[name] = loaders[name] = remote
                if remote.num_samples != len(samples):
                    raise RuntimeError(f"the servers serve {remote.num_samples} samples, expected {len(samples)}")
                for _ in range(args.warmup):
                    r = run_epoch(name, remote, epoch_no[name], server_pids, **run)
                    epoch_no[name] += 1
                    print(f"warm-up {name}: {r['images_per_s']:.1f} img/s", flush=True)
        order = [n for n in LOADERS if n in loaders]
        for round_no in range(args.epochs):
            for name in order:
                for server in servers:
                    if server.process.poll() is not None:
                        raise RuntimeError(
                            f"a server exited (code {server.process.returncode}):\n{server.process.log_tail()}"
                        )
                r = run_epoch(name, loaders[name], epoch_no[name], server_pids, **run)
                epoch_no[name] += 1
                r["round"] = round_no
                records.append(r)
                print(
                    f"round {round_no + 1}/{args.epochs} {name:>14}: {r['images_per_s']:6.1f} img/s  "
                    f"{r['wall_s']:6.2f}s  training process CPU {1000 * r['training_cpu_s'] / r['images']:.3f} "
                    f"ms/img  all CPU {1000 * r['cpu_s'] / r['images']:.2f} ms/img  "
                    f"server CPU {r['server_cpu_s']:.2f}s",
                    flush=True,
                )
        for server in servers:
            if server.process.poll() is not None:
                raise RuntimeError(f"a server exited (code {server.process.returncode}):\n{server.process.log_tail()}")
        ok = True
    except KeyboardInterrupt:
        print("\ninterrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        # A second Ctrl-C must not cut the cleanup short (it is bounded: about 30 s at worst).
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for remote in remotes.values():
                remote.close()
            if dataloader is not None:
                shutdown_dataloader(dataloader)
            for server in servers:
                server.stop()
        finally:
            signal.signal(signal.SIGINT, previous)
        if ok:
            shutil.rmtree(log_dir, ignore_errors=True)
        elif servers:
            print(f"server logs kept: {log_dir}", file=sys.stderr)

    summary = {name: summarize([r for r in records if r["loader"] == name], cores) for name in order}
    print(
        f"\n## Detection ({args.batch_size}x{args.image_size}x{args.image_size} uint8 + boxes, "
        f"{args.workers} workers per loader, {cores} cores; median of {args.epochs} epochs)\n"
    )
    print(markdown_table(summary, order))
    print("\nCPU ms per image, by process (median over epochs; the training process from /proc here):\n")
    print(
        "| loader | training process | its children (DataLoader workers, receiver process) | "
        "server main process | server decode workers |"
    )
    print("|---|---:|---:|---:|---:|")
    for name in order:
        p = summary[name]["median_cpu_ms_per_image_by_part"]
        print(
            f"| {TITLES[name]} | {p['client']:.2f} | {p['client_children']:.2f} | {p['server_main']:.2f} | "
            f"{p['server_workers']:.2f} |"
        )
    ratios: dict[str, dict] = {}
    if "dataloader" in summary and any(n in RECEIVER for n in summary):
        base = summary["dataloader"]
        print(
            f"\nTargets: >= {TARGET_SPEEDUP:g}x the DataLoader's images/s on the same cores, and <= "
            f"1/{TARGET_CPU_FACTOR:g} of its training-host CPU per image (the training process and its "
            f"children: what stays on the training host when the servers run on other machines)."
        )
        for name in (n for n in order if n in RECEIVER):
            s = summary[name]
            speed = s["median_images_per_s"] / max(base["median_images_per_s"], 1e-9)
            factor = base["median_training_cpu_ms_per_image"] / max(s["median_training_cpu_ms_per_image"], 1e-9)
            host_ms, base_host_ms = (training_host_ms(x) for x in (s, base))
            host_factor = base_host_ms / max(host_ms, 1e-9)
            full = s["cpu_bound_images_per_s"] / max(base["cpu_bound_images_per_s"], 1e-9)
            ratios[name] = {
                "images_per_s": speed,
                "full_cpu_images_per_s": full,
                "training_cpu_factor": factor,
                "training_host_cpu_factor": host_factor,
                "speed_met": speed >= TARGET_SPEEDUP,
                "cpu_met": host_factor >= TARGET_CPU_FACTOR,
            }
            print(
                f"\n{TITLES[name]} / {TITLES['dataloader']}: **{speed:.2f}x** images/s "
                f"(target {TARGET_SPEEDUP:g}x: {verdict(speed >= TARGET_SPEEDUP)}; at full CPU {full:.2f}x); "
                f"the DataLoader's training-host CPU per image over this one's: **{host_factor:.1f}x** "
                f"({base_host_ms:.2f} vs {host_ms:.2f} ms; target {TARGET_CPU_FACTOR:g}x: "
                f"{verdict(host_factor >= TARGET_CPU_FACTOR)}); its training process's alone: {factor:.1f}x "
                f"({base['median_training_cpu_ms_per_image']:.3f} vs {s['median_training_cpu_ms_per_image']:.3f} ms)"
            )
    idle = {n: s["server_cpu_s"] for n, s in summary.items() if n not in RECEIVER}
    if idle and servers:
        print(
            "\nserver CPU while the DataLoader ran: "
            + ", ".join(f"{n} {v:.2f}s" for n, v in idle.items())
            + " (should be ~0: nothing leaks across epochs)"
        )

    if args.json:
        document = {
            "config": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
            "host": {
                "cores": cores,
                "cpu_count": os.cpu_count(),
                "load_average_start": load,
                "python": platform.python_version(),
                "torch": torch.__version__,
                "pillow": Image.__version__,
                "opencv": cv2.__version__,
                "albumentations": A.__version__,
                "platform": platform.platform(),
            },
            "dataset": stats,
            "epochs": records,
            "summary": summary,
            "ratios": ratios,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # outside the measured part (dataset generation)
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
