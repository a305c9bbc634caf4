"""Feeding a GPU: a ResNet-50 (channels_last, bf16 autocast) trained from three sources.

    python benchmarks/gpu_feed.py [--images 4096] [--batch-size 256] [--steps 60] [--servers 2]

1. ceiling: one batch already on the GPU, reused every step (no input pipeline at all);
2. RemoteLoader(device="cuda", dtype=bfloat16, normalize=...) from local loader servers,
   receiving in its receiver process (the default on CUDA; "remote"), and in an I/O thread
   of the training process (``receiver="thread"``; "remote-thread");
3. torch DataLoader(num_workers=cores, pin_memory=True), OpenCV + albumentations, with the
   usual ``.cuda(non_blocking=True)`` and normalize on the GPU.

For each: images/s, step time against the ceiling, the share of step time the loop waited
for data, and the training process's own CPU per 1000 images (servers, DataLoader
workers and the receiver process excluded: that is the host CPU the input pipeline takes
from the trainer), also less the ceiling's (launching the model's kernels): "input CPU".
Needs an NVIDIA GPU; the servers get the machine's other cores.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Identity() if stride == 1 and cin == cout else
                     nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x):
        return torch.relu(self.body(x) + self.skip(x))


def resnet50(num_classes: int = 1000) -> nn.Module:
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(Bottleneck(cin, width, stride if b == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # this process only: the trainer's host CPU
    return r.ru_utime + r.ru_stime


def train(batches, steps: int, warmup: int, model, optimizer, normalize_on_gpu) -> dict:
    loss_fn = nn.CrossEntropyLoss()
    stream = torch.cuda.current_stream()
    waited = images_seen = 0
    it = iter(batches)
    for step in range(warmup + steps):
        if step == warmup:
            torch.cuda.synchronize()
            start, cpu0, waited, images_seen = time.perf_counter(), cpu_seconds(), 0.0, 0
        t0 = time.perf_counter()
        images, labels = next(it)
        waited += time.perf_counter() - t0
        images = normalize_on_gpu(images)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        images_seen += labels.shape[0]
    stream.synchronize()
    elapsed = time.perf_counter() - start
    return {"images_per_s": images_seen / elapsed, "step_ms": 1000 * elapsed / steps,
            "wait_share": waited / elapsed, "cpu_s_per_1000": 1000 * (cpu_seconds() - cpu0) / images_seen}


def forever(loader):
    epoch = 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--data", default="~/.cache/remoteloader-bench/imagenet-like")
    parser.add_argument("--sources", default="ceiling,remote,remote-thread,dataloader")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_feed.py needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from _common import ensure_dataset, list_samples
    from throughput import OpenCVTrainSet, make_dataloader

    from remoteloader.client import RemoteLoader
    from remoteloader.tools.local import LocalServer

    cores = len(os.sched_getaffinity(0))
    root = ensure_dataset(pathlib.Path(args.data).expanduser(), args.images, processes=cores)
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda")
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255

    def gpu_normalize(x):  # for sources that deliver uint8 NCHW
        return ((x.float() - mean) / std).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)

    results = {}
    for source in args.sources.split(","):
        torch.manual_seed(0)
        model = resnet50().to(device).to(memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if source == "ceiling":
            images = torch.randint(0, 256, (args.batch_size, 3, 224, 224), dtype=torch.uint8, device=device)
            labels = torch.randint(0, 1000, (args.batch_size,), device=device)
            ready = gpu_normalize(images)
            batches = iter(lambda ready=ready, labels=labels: (ready, labels), None)
            results[source] = train(batches, args.steps, args.warmup, model, optimizer, lambda x: x)
        elif source in ("remote", "remote-thread"):
            per = max(1, (cores - 2) // args.servers)
            servers = [LocalServer(root, args=["--workers", str(per), "--log-level", "WARNING"]).start()
                       for _ in range(args.servers)]
            try:
                with RemoteLoader([s.address for s in servers], batch_size=args.batch_size, image_size=224,
                                  device="cuda", dtype=torch.bfloat16, normalize=(MEAN, STD),
                                  receiver="thread" if source == "remote-thread" else "process") as loader:
                    results[source] = train(forever(loader), args.steps, args.warmup, model, optimizer, lambda x: x)
            finally:
                for s in servers:
                    s.stop()
        elif source == "dataloader":
            samples, _ = list_samples(root)
            loader = make_dataloader(OpenCVTrainSet(samples, 224), args.batch_size, max(1, cores - 2))
            loader.pin_memory = True

            def to_gpu(batches):
                for x, y in batches:
                    yield x.cuda(non_blocking=True), y.cuda(non_blocking=True)

            results[source] = train(to_gpu(forever(loader)), args.steps, args.warmup, model, optimizer,
                                    gpu_normalize)
    ceiling = results.get("ceiling", {}).get("step_ms")
    print(f"ResNet-50, batch {args.batch_size}, 224x224, bf16 autocast, channels_last; {torch.cuda.get_device_name()}"
          f", {cores} CPUs; {args.steps} timed steps")
    base_cpu = results.get("ceiling", {}).get("cpu_s_per_1000")
    print("| source | images/s | step ms | vs ceiling | data wait | trainer CPU-s / 1000 img "
          "| input CPU-s / 1000 img |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        versus = f"{r['step_ms'] / ceiling:.3f}x" if ceiling else ""
        extra = f"{r['cpu_s_per_1000'] - base_cpu:.3f}" if base_cpu is not None else ""
        print(f"| {name} | {r['images_per_s']:.0f} | {r['step_ms']:.1f} | {versus} | {r['wait_share']:.1%} | "
              f"{r['cpu_s_per_1000']:.3f} | {extra} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
