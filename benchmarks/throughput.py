"""Images/s delivered to a training loop: RemoteLoader vs. torch DataLoader (PIL and OpenCV).

    python benchmarks/throughput.py [--images N] [--epochs E] [--batch-size B] [--workers K]
                                    [--data DIR] [--output uint8|float] [--json PATH]

One run, on the same cores, measures three loaders that produce the same thing (random
resized crop to 224x224, scale 0.08-1, ratio 3/4-4/3, horizontal flip, uint8 RGB; or with
``--output float``, float32 NCHW normalized with ImageNet's mean/std, as ToTensor +
Normalize give it):

  remote  RemoteLoader fed by one local ``remoteloader-server`` (--workers K, 127.0.0.1), reading
          by default the tar shards ``remoteloader pack`` writes once from the same ImageFolder
          (JPEGs rewritten losslessly: the same pixels; --remote-data folder: the files themselves),
          its batches through the same-host path (the server's memory, docs/operator-guide.md, "Same host")
  grpc    (only when asked: --loaders remote,grpc,pil,opencv) the same over gRPC, shared_memory=False
  pil     torch DataLoader(num_workers=K): PIL open/convert, torchvision's RandomResizedCrop
          algorithm re-implemented on PIL, flip, pil_to_tensor, default collate
  opencv  torch DataLoader(num_workers=K): cv2.imread + cvtColor, albumentations
          RandomResizedCrop + HorizontalFlip + ToTensorV2, default collate
  dali    (only when asked, and where nvidia-dali is installed: it is in no extra of this
          project) NVIDIA DALI's CPU pipeline with K threads: readers.file, the ROI decode
          decoders.image_random_crop (libjpeg-turbo decodes only the crop), resize, flip
          (crop_mirror_normalize with --output float), uint8 NHWC like the RemoteLoader's

Epochs alternate (remote, pil, opencv, remote, ...) after one warm-up epoch per loader, so
drift and neighbours' load hit all three alike. Every epoch is read to the end, so no
loader has work in flight while another is timed; the CPU time the server's processes use
during the other loaders' epochs is reported to show it.
See benchmarks/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import json
import math
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
from albumentations.pytorch import ToTensorV2  # noqa: E402
from PIL import Image  # noqa: E402
from torch.utils.data import DataLoader, Dataset, get_worker_info  # noqa: E402

from remoteloader.tools.local import LocalServer  # noqa: E402

LOADERS = ("remote", "grpc", "pil", "opencv", "dali")
DEFAULT_LOADERS = ("remote", "pil", "opencv")
REMOTE = {"remote", "grpc"}  # RemoteLoaders of the one server: its same-host path, and over gRPC
TITLES = {"remote": "RemoteLoader (1 local server)", "grpc": "RemoteLoader, shared_memory=False",
          "pil": "DataLoader + PIL",
          "opencv": "DataLoader + OpenCV/albumentations", "dali": "DALI, CPU pipeline"}
NHWC = REMOTE | {"dali"}  # loaders whose uint8 batches are NHWC
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, as in torchvision's example
OUTPUTS = ("uint8", "float")


# ---- baseline datasets ---------------------------------------------------------------------

def torchvision_rrc_params(width: int, height: int, scale=SCALE, ratio=RATIO) -> tuple[int, int, int, int]:
    """torchvision.transforms.RandomResizedCrop.get_params, verbatim in behaviour: (top, left, h, w)."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,)).item()
            j = torch.randint(0, width - w + 1, size=(1,)).item()
            return i, j, h, w
    in_ratio = float(width) / float(height)  # fallback: central crop
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def pil_to_tensor(pic: Image.Image) -> torch.Tensor:
    """torchvision.transforms.functional.pil_to_tensor for RGB: HWC uint8 viewed as CHW."""
    img = torch.as_tensor(np.array(pic, copy=True))
    return img.view(pic.size[1], pic.size[0], 3).permute((2, 0, 1))


def to_tensor_normalize(img: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """torchvision's ToTensor() then Normalize(mean, std) on a CHW uint8 view, step for step."""
    x = img.contiguous().to(dtype=torch.float32).div(255)  # ToTensor: permute(...).contiguous(), float, /255
    return x.clone().sub_(mean).div_(std)  # F.normalize(inplace=False): clone, sub_, div_


class PILTrainSet(Dataset):
    """ImageFolder + RandomResizedCrop(size) + RandomHorizontalFlip() + PILToTensor(), torchvision-style.

    ``output="float"``: ToTensor() + Normalize(MEAN, STD) in place of PILToTensor(), the
    pipeline of torchvision's ImageNet example.
    """

    def __init__(self, samples: list[tuple[str, int]], size: int, output: str = "uint8"):
        self.samples = samples
        self.size = size
        self.output = output
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        with open(path, "rb") as f:  # torchvision.datasets.folder.pil_loader
            img = Image.open(f)
            img = img.convert("RGB")
        top, left, h, w = torchvision_rrc_params(*img.size)
        # F.resized_crop on PIL: crop, then resize (BILINEAR; PIL always antialiases).
        img = img.crop((left, top, left + w, top + h)).resize((self.size, self.size), Image.BILINEAR)
        if torch.rand(1) < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        tensor = pil_to_tensor(img)
        if self.output == "float":
            tensor = to_tensor_normalize(tensor, self.mean, self.std)
        return tensor, label


def albumentations_train(size: int, output: str = "uint8") -> A.Compose:
    normalize = [A.Normalize(mean=MEAN, std=STD)] if output == "float" else []  # float32, x/255 first
    return A.Compose([
        A.RandomResizedCrop(size=(size, size), scale=SCALE, ratio=RATIO, interpolation=cv2.INTER_LINEAR),
        A.HorizontalFlip(p=0.5),
        *normalize,
        ToTensorV2(),
    ])


class OpenCVTrainSet(Dataset):
    """ImageFolder read with cv2.imread + cvtColor, augmented by albumentations."""

    def __init__(self, samples: list[tuple[str, int]], size: int, output: str = "uint8"):
        self.samples = samples
        self.transform = albumentations_train(size, output)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        img = cv2.imread(path, cv2.IMREAD_COLOR)
        if img is None:
            raise OSError(f"OpenCV cannot read {path}")
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        return self.transform(image=img)["image"], label


class DaliLoader:
    """NVIDIA DALI's CPU pipeline (``device_id=None``: no GPU), as its ImageNet example builds it
    (resize without antialiasing, as cv2's INTER_LINEAR: the cheaper choice), iterated an epoch at
    a time: (images, labels) torch tensors, the last partial batch dropped.

    Its executor runs synchronously (``exec_pipelined=False, exec_async=False``): each batch's
    operators still run on ``threads`` threads, but nothing runs between batches. DALI's default
    pipelined executor computes the next batches while the current ones are consumed, so as an
    epoch ends it is already decoding the next epoch's first batches, in this process, during the
    other loaders' epochs: measured here, 1.1 s of CPU after each 1,792-image epoch, which slowed
    the loader timed next and went uncounted in DALI's own epoch (1.85 ms/img inside its epochs,
    2.5 with the overrun). The synchronous executor used the same 2.5-2.7 ms/img, all of it inside
    its epochs, at the same images/s as the pipelined one with its overrun counted.
    """

    def __init__(self, samples: list[tuple[str, int]], size: int, batch_size: int, threads: int, output: str):
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=None, seed=0, exec_pipelined=False,
                      exec_async=False)
        def train():
            jpegs, labels = fn.readers.file(files=[p for p, _ in samples], labels=[c for _, c in samples],
                                            random_shuffle=True, name="reader")
            images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                                   random_area=list(SCALE), random_aspect_ratio=list(RATIO))
            images = fn.resize(images, resize_x=size, resize_y=size, interp_type=types.INTERP_LINEAR,
                               antialias=False)
            flip = fn.random.coin_flip(probability=0.5)
            if output == "float":
                images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mirror=flip,
                                                  mean=[255 * m for m in MEAN], std=[255 * s for s in STD])
            else:
                images = fn.flip(images, horizontal=flip)
            return images, labels

        pipe = train()
        pipe.build()
        self._iterator = DALIGenericIterator(pipe, ["images", "labels"], reader_name="reader",
                                             last_batch_policy=LastBatchPolicy.DROP, auto_reset=True)

    def __iter__(self):
        for (batch,) in self._iterator:
            yield batch["images"], batch["labels"].view(-1).long()


def _worker_init(_worker_id: int) -> None:
    # One OpenCV thread per worker, as in the server's workers; and a distinct albumentations
    # stream per worker (a Compose seeded in the parent would repeat itself in every fork).
    cv2.setNumThreads(1)
    info = get_worker_info()
    transform = getattr(info.dataset, "transform", None)
    if transform is not None:
        transform.set_random_seed(torch.initial_seed() % 2**32)


def make_dataloader(dataset: Dataset, batch_size: int, workers: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers, drop_last=True,
                      persistent_workers=workers > 0, worker_init_fn=_worker_init)


def shutdown_dataloader(loader: DataLoader) -> None:
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        try:
            iterator._shutdown_workers()
        except Exception:
            pass
    loader._iterator = None


# ---- measuring -----------------------------------------------------------------------------

CPU_PARTS = ("client", "client_children", "server_main", "server_workers")


def run_epoch(name: str, loader, epoch: int, server_pid: int | None, expect_batch: int, size: int,
              expect_images: int, output: str = "uint8") -> dict:
    """Iterates one whole epoch; the loop only touches each batch (shape, label sum)."""
    if name in REMOTE:
        loader.set_epoch(epoch)
    me = os.getpid()
    cpu0 = _common.cpu_split(me, server_pid)
    t0 = time.perf_counter()
    first = sample = None
    images = batches = label_sum = 0
    iterator = iter(loader)
    try:
        for batch_images, labels in iterator:
            if first is None:
                first = time.perf_counter() - t0
                sample = (batch_images, labels)  # checked after the clock stops
            images += batch_images.shape[0]
            label_sum += int(labels.sum())
            batches += 1
    finally:
        close = getattr(iterator, "close", None)  # a generator left early cancels its epoch
        if close is not None:
            close()
    wall = time.perf_counter() - t0
    cpu1 = _common.cpu_split(me, server_pid)
    cpu = {k: cpu1[k] - cpu0[k] for k in CPU_PARTS}
    if sample is None:
        raise RuntimeError(f"{name}: epoch {epoch} delivered no batch")
    _check_batch(name, *sample, expect_batch, size, output)
    del sample
    if images != expect_images:
        raise RuntimeError(f"{name}: epoch {epoch} delivered {images} images, expected {expect_images}")
    return {"loader": name, "epoch": epoch, "images": images, "batches": batches, "wall_s": wall,
            "images_per_s": images / wall if wall > 0 else 0.0, "first_batch_s": first or 0.0,
            "cpu_s": sum(cpu.values()), "cpu_parts_s": cpu,
            "server_cpu_s": cpu["server_main"] + cpu["server_workers"], "label_sum": label_sum}


def _check_batch(name: str, images: torch.Tensor, labels: torch.Tensor, batch: int, size: int,
                 output: str = "uint8") -> None:
    # RemoteLoader: uint8 NHWC, or normalized NCHW (channels_last memory); DataLoaders: NCHW.
    shape = (batch, size, size, 3) if name in NHWC and output == "uint8" else (batch, 3, size, size)
    dtype = torch.uint8 if output == "uint8" else torch.float32
    if tuple(images.shape) != shape or images.dtype != dtype:
        raise RuntimeError(f"{name}: got a batch of {tuple(images.shape)} {images.dtype}, expected {shape} {dtype}")
    if labels.shape != (batch,) or int(labels.min()) < 0 or int(labels.max()) >= _common.NUM_CLASSES:
        raise RuntimeError(f"{name}: bad labels {labels[:8].tolist()}...")
    if output == "float" and not -3.0 < float(images[:4].mean()) < 3.0:
        raise RuntimeError(f"{name}: normalized images average {float(images[:4].mean()):.2f}: not normalized?")
    if float(images[:4].float().std()) < (1.0 if output == "uint8" else 1.0 / 64):
        raise RuntimeError(f"{name}: the first images of the batch are flat (all zeros?)")


def summarize(records: list[dict], cores: int) -> dict:
    rates = [r["images_per_s"] for r in records]
    parts = {k: statistics.median(1000 * r["cpu_parts_s"][k] / r["images"] for r in records) if records else 0.0
             for k in CPU_PARTS}
    cpu_ms = [1000 * r["cpu_s"] / r["images"] for r in records if r["images"]]
    util = [r["cpu_s"] / r["wall_s"] / cores for r in records if r["wall_s"] > 0]
    return {"epochs": len(records), "images_per_epoch": records[0]["images"] if records else 0,
            "median_images_per_s": statistics.median(rates) if rates else 0.0,
            "min_images_per_s": min(rates, default=0.0), "max_images_per_s": max(rates, default=0.0),
            "median_cpu_ms_per_image": statistics.median(cpu_ms) if cpu_ms else 0.0,
            "cpu_bound_images_per_s": cores * 1000 / statistics.median(cpu_ms) if cpu_ms else 0.0,
            "median_cpu_utilization": statistics.median(util) if util else 0.0,
            "median_first_batch_s": statistics.median(r["first_batch_s"] for r in records) if records else 0.0,
            "server_cpu_s": sum(r["server_cpu_s"] for r in records), "median_cpu_ms_per_image_by_part": parts}


def markdown_table(summary: dict[str, dict], order: list[str]) -> str:
    lines = ["| loader | timed epochs x images | median img/s | min-max img/s | CPU ms/img | img/s at full CPU | "
             "CPU use | first batch s | server CPU s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in order:
        s = summary[name]
        lines.append(f"| {TITLES[name]} | {s['epochs']} x {s['images_per_epoch']} | {s['median_images_per_s']:.0f} | "
                     f"{s['min_images_per_s']:.0f}-{s['max_images_per_s']:.0f} | {s['median_cpu_ms_per_image']:.2f} | "
                     f"{s['cpu_bound_images_per_s']:.0f} | "
                     f"{100 * s['median_cpu_utilization']:.0f}% | {s['median_first_batch_s']:.2f} | "
                     f"{s['server_cpu_s']:.2f} |")
    return "\n".join(lines)


def plot_title(images: int, args: argparse.Namespace, cores: int) -> str:
    read = ("the server on packed shards, the other loaders on the original files" if args.remote_data == "packed"
            else "every loader on the original files")
    return f"{images} JPEGs, RRC {args.image_size} + flip, {args.workers} workers each, {cores} cores;\n{read}"


def plot(path: pathlib.Path, records: list[dict], order: list[str], title: str, first_is_cold: bool) -> None:
    """A bar chart of images/s by loader: the first epoch (when nothing was warmed up) beside the
    median of the later ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steady, first = [], []
    for name in order:
        rates = [r["images_per_s"] for r in records if r["loader"] == name]
        first.append(rates[0])
        steady.append(statistics.median(rates[1:] if first_is_cold and len(rates) > 1 else rates))
    fig, ax = plt.subplots(figsize=(8, 4))
    ys = range(len(order))
    if first_is_cold:
        ax.barh([y + 0.2 for y in ys], first, 0.4, label="first epoch", color="#9ecae1")
    ax.barh([y - 0.2 * first_is_cold for y in ys], steady, 0.4, label="steady state (median of later epochs)",
            color="#3182bd")
    for y, value in zip(ys, steady):
        ax.text(value, y - 0.2 * first_is_cold, f" {value:,.0f}", va="center", fontsize=8)
    ax.set_xlim(0, 1.12 * max(steady + first))  # room for the labels
    ax.set_yticks(list(ys), [TITLES[n] for n in order], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("images/s delivered to the training loop")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    cores = _common.default_cores()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000, help="images in the dataset (default 2000)")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per loader (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed epochs per loader first (default 1)")
    parser.add_argument("--batch-size", type=int, default=256, help="batch size (default 256)")
    parser.add_argument("--image-size", type=int, default=224, help="output side (default 224)")
    parser.add_argument("--workers", type=int, default=cores,
                        help=f"server workers and DataLoader num_workers (default: the {cores} usable cores)")
    parser.add_argument("--data", type=pathlib.Path, default=_common.DEFAULT_DATA,
                        help=f"cached ImageFolder (default {_common.DEFAULT_DATA})")
    _common.add_remote_data_argument(parser)
    parser.add_argument("--loaders", default=",".join(DEFAULT_LOADERS),
                        help=f"comma-separated subset of {','.join(LOADERS)} (default: {','.join(DEFAULT_LOADERS)})")
    parser.add_argument("--output", choices=OUTPUTS, default="uint8",
                        help="what every loader delivers: uint8 images (default), or float32 NCHW normalized "
                             "with ImageNet's mean/std (ToTensor + Normalize, the usual torchvision pipeline; "
                             "RemoteLoader(normalize=...) does it in the training process)")
    parser.add_argument("--json", type=pathlib.Path, help="also write every measurement to this JSON file")
    parser.add_argument("--plot", type=pathlib.Path,
                        help="also draw images/s by loader to this PNG (with --warmup 0: the first epoch beside "
                             "the steady state)")
    parser.add_argument("--server-args", action="append", default=[], metavar="FLAG",
                        help="a further remoteloader-server flag, =-joined, once per flag: e.g. "
                             "--server-args=--region-decode=false --server-args=--chunk-bytes=4194304")
    args = parser.parse_args(argv)
    args.loaders = [x.strip() for x in args.loaders.split(",") if x.strip()]
    bad = [x for x in args.loaders if x not in LOADERS]
    if bad or not args.loaders:
        parser.error(f"--loaders: unknown {bad}; choose from {', '.join(LOADERS)}")
    for name in ("images", "epochs", "batch_size", "image_size", "workers"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.images < args.batch_size:
        parser.error(f"--images {args.images} < --batch-size {args.batch_size}: with drop_last an epoch "
                     f"would have no batch")
    return args


_MAIN_PID = os.getpid()


def _raise_exit(signum, _frame):
    if os.getpid() != _MAIN_PID:  # a forked dataset generator being stopped: just die
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    print(f"\n{signal.Signals(signum).name}: cleaning up", file=sys.stderr)
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    args = parse_args(argv)
    cores = _common.default_cores()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)  # run the cleanup below on kill/hang-up too

    root = _common.ensure_dataset(args.data, args.images, processes=cores)
    samples, classes = _common.list_samples(root)
    if len(samples) != args.images:
        raise SystemExit(f"{root} holds {len(samples)} images, expected {args.images}")
    stats = _common.dataset_stats(samples)
    load = os.getloadavg()
    print("# remoteloader throughput benchmark\n")
    print(f"data: {root}: {stats['images']} JPEGs in {len(classes)} classes, {stats['total_mb']:.0f} MB; "
          f"file size mean {stats['kb_mean']:.0f} KB, median {stats['kb_median']:.0f}, p5-p95 "
          f"{stats['kb_p5']:.0f}-{stats['kb_p95']:.0f}, min-max {stats['kb_min']:.0f}-{stats['kb_max']:.0f}; "
          f"mean {stats['mean_width']:.0f}x{stats['mean_height']:.0f} px ({stats['portrait']} portrait), "
          f"{stats['bits_per_pixel']:.2f} bits/px")
    print(f"host: {cores} usable cores ({os.cpu_count()} online), load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}; python {platform.python_version()}, torch {torch.__version__}, "
          f"Pillow {Image.__version__}, OpenCV {cv2.__version__}, albumentations {A.__version__}")
    print(f"config: batch {args.batch_size}, {args.image_size}x{args.image_size}, {args.workers} workers per loader, "
          f"{args.output} output, {args.warmup} warm-up + {args.epochs} timed epochs per loader, "
          f"loaders {', '.join(args.loaders)}")
    if load[0] > 0.5 * cores:
        print(f"warning: load average {load[0]:.1f} on {cores} cores: other processes compete; "
              f"images/s will be noisy (CPU ms/img much less so)")
    sys.stdout.flush()

    server = remote = None
    dataloaders: dict[str, DataLoader] = {}
    log_dir = tempfile.mkdtemp(prefix="remoteloader-bench-")
    records: list[dict] = []
    ok = False
    try:
        if REMOTE & set(args.loaders):
            served = _common.served_data(root, args.remote_data, cores)
            started = time.perf_counter()
            server = LocalServer(served, args=["--workers", str(args.workers), "--grace", "2", "--log-level", "INFO",
                                             *args.server_args],
                                 env={"NO_ALBUMENTATIONS_UPDATE": "1"}, log_path=pathlib.Path(log_dir) / "server.log")
            server.start(timeout=120)
            print(f"server: {server.address} (pid {server.process.pid}, {args.workers} workers, "
                  f"reading {served}), ready in "
                  f"{time.perf_counter() - started:.1f}s; log {server.log_path}", flush=True)
        server_pid = server.process.pid if server else None
        expect = args.batch_size
        per_epoch = len(samples) // args.batch_size * args.batch_size  # drop_last everywhere
        if "pil" in args.loaders:
            dataloaders["pil"] = make_dataloader(PILTrainSet(samples, args.image_size, args.output), args.batch_size,
                                                 args.workers)
        if "opencv" in args.loaders:
            dataloaders["opencv"] = make_dataloader(OpenCVTrainSet(samples, args.image_size, args.output),
                                                    args.batch_size,
                                                    args.workers)
        loaders: dict[str, object] = dict(dataloaders)
        # Warm-up. The DataLoaders fork their (persistent) workers here, before the
        # RemoteLoader starts gRPC threads in this process: forking after that is unsafe.
        epoch_no = {name: 0 for name in args.loaders}
        played_first: set[str] = set()  # DataLoaders whose first timed epoch ran here
        for name in ("pil", "opencv"):
            for _ in range(args.warmup if name in loaders else 0):
                r = run_epoch(name, loaders[name], epoch_no[name], server_pid, expect, args.image_size, per_epoch,
                              args.output)
                epoch_no[name] += 1
                print(f"warm-up {name}: {r['images_per_s']:.0f} img/s", flush=True)
            if not args.warmup and name in loaders:  # no warm-up: their first timed epoch forks them, here
                r = run_epoch(name, loaders[name], epoch_no[name], server_pid, expect, args.image_size, per_epoch,
                              args.output)
                epoch_no[name] += 1
                r["round"] = 0
                records.append(r)
                played_first.add(name)
                print(f"round 1/{args.epochs} {name:>6}: {r['images_per_s']:7.0f} img/s (its first epoch, played "
                      f"before the RemoteLoaders start)", flush=True)
        if "dali" in args.loaders:  # after the forks above: its threads start with the pipeline
            loaders["dali"] = DaliLoader(samples, args.image_size, args.batch_size, args.workers, args.output)
            for _ in range(args.warmup):
                r = run_epoch("dali", loaders["dali"], epoch_no["dali"], server_pid, expect, args.image_size,
                              per_epoch, args.output)
                epoch_no["dali"] += 1
                print(f"warm-up dali: {r['images_per_s']:.0f} img/s", flush=True)
        if server is not None:
            from remoteloader.client.loader import RemoteLoader

            for name in (n for n in LOADERS if n in REMOTE and n in args.loaders):
                remote = RemoteLoader(server.address, batch_size=args.batch_size, image_size=args.image_size,
                                      pipeline="train", shuffle=True, seed=0, drop_last=True, reconnect_timeout=5.0,
                                      normalize=(MEAN, STD) if args.output == "float" else None,
                                      shared_memory=name == "remote")
                if remote.num_samples != len(samples):
                    raise RuntimeError(f"the server serves {remote.num_samples} samples, expected {len(samples)}")
                loaders[name] = remote
                for _ in range(args.warmup):
                    r = run_epoch(name, remote, epoch_no[name], server_pid, expect, args.image_size, per_epoch,
                                  args.output)
                    epoch_no[name] += 1
                    print(f"warm-up {name}: {r['images_per_s']:.0f} img/s", flush=True)
                path = "same-host" if remote.stats()["servers"][server.address]["shared_memory"] else "gRPC"
                print(f"{name}: the {path} path", flush=True)
        order = [n for n in LOADERS if n in loaders]
        for round_no in range(args.epochs):
            for name in order:
                if round_no == 0 and name in played_first:
                    continue
                if server is not None and server.process.poll() is not None:
                    raise RuntimeError(f"the server exited (code {server.process.returncode}):\n{server.log_tail()}")
                r = run_epoch(name, loaders[name], epoch_no[name], server_pid, expect, args.image_size, per_epoch,
                              args.output)
                epoch_no[name] += 1
                r["round"] = round_no
                records.append(r)
                print(f"round {round_no + 1}/{args.epochs} {name:>6}: {r['images_per_s']:7.0f} img/s  "
                      f"{r['wall_s']:6.2f}s  CPU {1000 * r['cpu_s'] / r['images']:.2f} ms/img  "
                      f"server CPU {r['server_cpu_s']:.2f}s", flush=True)
        if server is not None and server.process.poll() is not None:
            raise RuntimeError(f"the server exited (code {server.process.returncode}):\n{server.log_tail()}")
        ok = True
    except KeyboardInterrupt:
        print("\ninterrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        # A second Ctrl-C must not cut the cleanup short (it is bounded: about 30 s at worst).
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for name in REMOTE & set(loaders):
                loaders[name].close()
            for dl in dataloaders.values():
                shutdown_dataloader(dl)
            if server is not None:
                server.stop()
        finally:
            signal.signal(signal.SIGINT, previous)
        if ok:
            shutil.rmtree(log_dir, ignore_errors=True)
        elif server is not None:
            print(f"server log kept: {server.log_path}", file=sys.stderr)

    summary = {name: summarize([r for r in records if r["loader"] == name], cores) for name in order}
    print(f"\n## Throughput ({args.batch_size}x{args.image_size}x{args.image_size} {args.output}, "
          f"{args.workers} workers "
          f"per loader, {cores} cores; median of {args.epochs} epochs)\n")
    print(markdown_table(summary, order))
    print("\nCPU ms per image, by process (median over epochs):\n")
    print("| loader | training process | its DataLoader workers | server main process | server decode workers |")
    print("|---|---:|---:|---:|---:|")
    for name in order:
        p = summary[name]["median_cpu_ms_per_image_by_part"]
        print(f"| {TITLES[name]} | {p['client']:.2f} | {p['client_children']:.2f} | {p['server_main']:.2f} | "
              f"{p['server_workers']:.2f} |")
    ratios = {}
    for mine in (n for n in LOADERS if n in REMOTE and n in summary):
        for other in ("pil", "opencv", "dali"):
            if other in summary and summary[other]["median_images_per_s"] > 0:
                ours, theirs = summary[mine], summary[other]
                ratios[f"{mine}/{other}"] = ours["median_images_per_s"] / theirs["median_images_per_s"]
                cpu = ours["median_cpu_ms_per_image"] / max(theirs["median_cpu_ms_per_image"], 1e-9)
                ratios[f"cpu {mine}/{other}"] = cpu
                ratios[f"full-cpu {mine}/{other}"] = 1 / cpu
                print(f"\n{TITLES[mine]} / {TITLES[other]}: **{ratios[f'{mine}/{other}']:.2f}x** images/s "
                      f"(at full CPU: {1 / cpu:.2f}x; CPU per image {cpu:.2f}x)", end="")
        print()
    idle = {n: s["server_cpu_s"] for n, s in summary.items() if n not in REMOTE}
    if idle:
        print("\nserver CPU while the other loaders ran: "
              + ", ".join(f"{n} {v:.2f}s" for n, v in idle.items())
              + " (should be ~0: nothing leaks across epochs)")


    if args.plot:
        plot(args.plot, records, order, plot_title(stats["images"], args, cores), args.warmup == 0)
        print(f"\nwrote {args.plot}")
    if args.json:
        document = {"config": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
                    "host": {"cores": cores, "cpu_count": os.cpu_count(), "load_average_start": load,
                             "python": platform.python_version(), "torch": torch.__version__,
                             "pillow": Image.__version__, "opencv": cv2.__version__,
                             "albumentations": A.__version__, "platform": platform.platform()},
                    "dataset": stats, "epochs": records, "summary": summary, "ratios": ratios}
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
