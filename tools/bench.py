"""``remoteloader bench ADDRESS``: is the training job input-bound, and what would fix it?

Run from the training host against the loader servers it trains with. It reads batches from
1, 2, 4, ... of the servers, then all of them, as fast as they come, and prints a table:
images/s and MB/s per server and together, and what held each back (its decode CPUs, its
link, or this host's receiving: ``remoteloader.client.bottleneck``'s rule, the one
``stats()`` uses each epoch). Given the training step (``--step-time`` seconds per batch, or
``--model module:function`` to time one), it says whether the job is input-bound, by how
much, and how many more servers of this kind would close the gap; and what a local
DataLoader would need of this host for the same images/s. ``--plot`` draws images/s against
servers and against link bandwidth (a PNG, with matplotlib: ``pip install remoteloader[bench]``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from remoteloader.client import RemoteLoader, bottleneck, cpu
from remoteloader.client.batches import LoaderError
from remoteloader.client.discovery import discover
from remoteloader.protos import wire

MB = 1e6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="the servers, as RemoteLoader takes them (a list, or a DNS name for many)")
    parser.add_argument("--batch-size", type=int, default=256, help="default 256")
    parser.add_argument("--image-size", type=int, default=224, help="default 224")
    parser.add_argument("--pipeline", default="train", help="a preset the servers offer (default train)")
    parser.add_argument(
        "--clip-frames",
        type=int,
        default=0,
        help="read clips of this many frames from video servers (docs/video.md); each clip counts as one image",
    )
    parser.add_argument("--frame-stride", type=int, default=1, help="with --clip-frames: frames between a clip's")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured per configuration (default 10)")
    parser.add_argument(
        "--warmup",
        type=float,
        default=6.0,
        help="read first, not measured (default 6: the servers' busy share covers their last 5 s)",
    )
    parser.add_argument("--receiver", choices=("thread", "process"), default=None, help="RemoteLoader's receiver")
    parser.add_argument("--wire", choices=wire.WIRES, default=wire.RAW, help="RemoteLoader's wire (jpeg95 is lossy)")
    parser.add_argument("--connect-timeout", type=float, default=10.0, help="seconds a server may take to answer")
    parser.add_argument("--token-file", help="a file holding the servers' token")
    parser.add_argument(
        "--job", help="read as this job (RemoteLoader(job=...)): its share by the servers' --job-weights"
    )
    parser.add_argument(
        "--share",
        action="store_true",
        help="join decodes other loaders of the same plan started (off: measure the fleet's own decode)",
    )
    parser.add_argument(
        "--tls",
        metavar="CA_PEM",
        help="connect with TLS, trusting this CA (server certificates must name the addresses a DNS name resolves to)",
    )
    step = parser.add_mutually_exclusive_group()
    step.add_argument("--step-time", type=float, help="seconds one training step takes on a batch")
    step.add_argument(
        "--model",
        metavar="MODULE:FUNCTION",
        help="a function returning a torch.nn.Module: its forward and backward on a batch are timed",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where --model is timed")
    parser.add_argument("--plot", metavar="PNG", help="write a plot of images/s against servers and link bandwidth")
    parser.add_argument("--json", metavar="FILE", help="write every figure as JSON")


@dataclass
class Run:
    """One configuration's figures: ``count`` servers read together for ``seconds``."""

    servers: list[str]
    seconds: float
    images: int
    images_per_s: float
    mb_per_s: float
    host_cpu_ms: float  # this host's CPU (this process and its children) per image
    receiver_busy: float  # the receiver's CPU seconds per second
    limit: str
    per_server: dict[str, dict] = field(default_factory=dict)
    images_shared: int = 0  # of ``images``, those whose decode a server shared with another loader


def host_cpu() -> float:
    """CPU seconds of this process and its children (a receiver process, DataLoader workers)."""
    return cpu.tree_cpu(os.getpid())


def _not_waiting(record: logging.LogRecord) -> bool:
    """Leaves out the loader's warning that the loop waits for data: here it waits by design."""
    return not hasattr(record, "remoteloader_waited")


def measure(servers: list[str], args: argparse.Namespace, loader_args: dict) -> Run:
    """Reads batches from ``servers`` for ``args.warmup`` then ``args.seconds`` seconds."""
    with RemoteLoader(servers, **loader_args) as loader:
        start = time.perf_counter()
        measuring = None  # (time, images, stats, host cpu) when the measured span began
        images = 0
        epoch = 0
        while True:
            loader.set_epoch(epoch)
            if not len(loader):
                raise SystemExit(f"{', '.join(servers)}: no batch of {args.batch_size} to read")
            for batch in loader:
                images += len(batch["label"] if isinstance(batch, dict) else batch[1])  # (clips: dict batches)
                now = time.perf_counter()
                if measuring is None and now - start >= args.warmup:
                    measuring = (now, images, loader.stats(), host_cpu())
                elif measuring is not None and now - measuring[0] >= args.seconds:
                    break
            else:
                epoch += 1
                continue
            break
        end, after, used = time.perf_counter(), loader.stats(), host_cpu()
    began, images_before, before, cpu_before = measuring
    seconds, images = end - began, images - images_before
    spans = bottleneck.spans(before["servers"], after["servers"])
    receiver_busy = (after["receiver_cpu_s"] - before["receiver_cpu_s"]) / seconds
    per_server = {}
    for address, span in spans.items():
        workers = int(after["servers"][address].get("workers", 0))
        rate = span.images / seconds
        per_server[address] = {
            "images_per_s": rate,
            "mb_per_s": span.bytes / seconds / MB,
            "workers": workers,
            "workers_busy": span.workers_busy,
            # its decode workers' busy time per image (their CPU, and their waits for a CPU)
            "busy_ms": 1000 * workers * span.workers_busy / rate if rate else 0.0,
            "limit": bottleneck.server_limit(span.workers_busy, receiver_busy, span.shared),
        }
    return Run(
        servers=servers,
        seconds=seconds,
        images=images,
        images_per_s=images / seconds,
        mb_per_s=sum(s.bytes for s in spans.values()) / seconds / MB,
        host_cpu_ms=1000 * (used - cpu_before) / images if images else 0.0,
        receiver_busy=receiver_busy,
        limit=bottleneck.likely_limit(spans, receiver_busy),
        per_server=per_server,
        images_shared=after["images_shared"] - before["images_shared"],
    )


def counts(n: int) -> list[int]:
    """The server counts measured: 1, 2, 4, ... and n."""
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return out + [n]


def step_images_per_s(args: argparse.Namespace) -> tuple[float, str] | None:
    """Images/s the training step consumes, and how it was found; None when not asked."""
    if args.step_time is not None:
        return args.batch_size / args.step_time, f"--step-time {args.step_time:g} s per batch of {args.batch_size}"
    if args.model is None:
        return None
    import torch

    module_name, _, function_name = args.model.partition(":")
    sys.path.insert(0, os.getcwd())
    try:
        model = getattr(importlib.import_module(module_name), function_name)()
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"--model={args.model!r}: {exc}") from None
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch sees no CUDA device")
    else:
        device = torch.device(args.device)
    model = model.to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    clip = (args.clip_frames,) if args.clip_frames else ()  # a video model's input: [B, C, T, H, W]
    batch = torch.randn(args.batch_size, 3, *clip, args.image_size, args.image_size, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        output = model(batch)
        (output if isinstance(output, torch.Tensor) else output[0]).float().mean().backward()
        optimizer.step()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        step()
    sync()
    began, steps = time.perf_counter(), 0
    while steps < 5 or time.perf_counter() - began < 2.0:
        step()
        steps += 1
        if steps % 5 == 0:
            sync()
    sync()
    seconds = (time.perf_counter() - began) / steps
    return args.batch_size / seconds, f"{args.model} on {device}: {seconds:.3f} s per batch of {args.batch_size}"


def verdict(runs: list[Run], consumed: float | None) -> list[str]:
    """What the figures mean: the job's limit and what would lift it."""
    every = runs[-1]
    n = len(every.servers)
    per_server = every.images_per_s / n
    lines = [
        f"{n} server(s) deliver {every.images_per_s:.0f} images/s ({every.mb_per_s:.0f} MB/s) to this host; "
        f"likely limit: {every.limit}."
    ]
    if every.limit == bottleneck.RECEIVING:
        lines.append(
            f"This host's receiver was busy {every.receiver_busy:.0%} of the time: more servers would not help. "
            + bottleneck.REMEDY[bottleneck.RECEIVING]
            + "."
        )
    if every.limit == bottleneck.READING:
        lines.append(bottleneck.REMEDY[bottleneck.READING] + ".")
    if consumed is None:
        lines.append("Give --step-time or --model to compare with what the training step consumes.")
        return lines
    if every.images_per_s >= consumed:
        lines.append(
            f"The training step consumes {consumed:.0f} images/s: not input-bound "
            f"({every.images_per_s / consumed - 1:.0%} to spare)."
        )
        needed = math.ceil(consumed / per_server) if per_server else n
        if needed < n:
            lines.append(f"About {needed} such server(s) would keep up.")
        return lines
    lines.append(
        f"The training step consumes {consumed:.0f} images/s: input-bound; the loop would wait for data "
        f"{1 - every.images_per_s / consumed:.0%} of the time."
    )
    first = runs[0]
    added = n - len(first.servers)
    # What one more server gave, measured: the last runs' gain per added server, where there is one.
    gain = (every.images_per_s - first.images_per_s) / added if added > 0 else per_server
    alone = first.images_per_s / len(first.servers)
    if every.limit != bottleneck.RECEIVING and added > 0 and gain < 0.1 * alone:
        lines.append(
            f"More servers did not add throughput here ({len(first.servers)} gave {first.images_per_s:.0f} images/s, "
            f"{n} gave {every.images_per_s:.0f}): they share what limits them (one machine's cores, its link or "
            f"its disk), so more of them there would not close the gap; servers on other machines might."
        )
    elif every.limit != bottleneck.RECEIVING and gain > 0:
        more = math.ceil((consumed - every.images_per_s) / gain)
        behind = " behind links of their own" if every.limit == bottleneck.LINKS else ""
        how = "as the servers added gave" if added > 0 else f"as {n} gave"
        lines.append(
            f"About {more} more server(s) of this kind{behind} would close the gap ({gain:.0f} images/s each, {how})."
        )
    if every.limit == bottleneck.LINKS:
        lines.append(
            "Or fewer bytes per image on the same links: --wire zstd (lossless) or --wire jpeg95 (lossy) measures "
            'them (docs/operator-guide.md, "Wire choices"). "links" means the servers\' workers had time to spare '
            "and this host's receiver was not busy: their links, or anything between (the servers' sending, too "
            "little in flight)."
        )
    return lines


def dataloader_line(every: Run, wanted: float) -> str | None:
    """What a local DataLoader would need of this host for ``wanted`` images/s."""
    costs = [(s["busy_ms"], s["images_per_s"]) for s in every.per_server.values() if s["busy_ms"] > 0]
    if not costs:
        return None
    cost_ms = sum(c * r for c, r in costs) / sum(r for _, r in costs)
    cores = os.cpu_count() or 1
    return (
        f"A local DataLoader doing the same work would need about {wanted * cost_ms / 1000:.1f} of this host's "
        f"{cores} cores for {wanted:.0f} images/s (the servers' workers are busy {cost_ms:.1f} ms per image, at "
        f"their cores' speed and load); through the servers this host spends {every.host_cpu_ms:.2f} ms of CPU "
        f"per image."
    )


def table(runs: list[Run]) -> str:
    rows = [f"{'servers':>7} {'images/s':>9} {'MB/s':>7} {'host ms/img':>11}  limit"]
    for run in runs:
        rows.append(
            f"{len(run.servers):>7} {run.images_per_s:9.0f} {run.mb_per_s:7.0f} {run.host_cpu_ms:11.2f}  {run.limit}"
        )
    rows.append("")
    rows.append(f"each of the {len(runs[-1].servers)} server(s), read together:")
    rows.append(f"{'server':<24} {'images/s':>9} {'MB/s':>7} {'workers':>7} {'busy':>5} {'busy ms/img':>11}  limit")
    for address, s in runs[-1].per_server.items():
        rows.append(
            f"{address:<24} {s['images_per_s']:9.0f} {s['mb_per_s']:7.0f} {s['workers']:7d} {s['workers_busy']:5.0%} "
            f"{s['busy_ms']:11.1f}  {s['limit']}"
        )
    return "\n".join(rows)


def _pyplot() -> Any:
    """matplotlib's pyplot, drawing to files; SystemExit saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'remoteloader[bench]'") from None
    return plt


def plot(path: str, runs: list[Run], consumed: float | None) -> None:
    """images/s against servers (measured, and each server's share extended) and against
    link bandwidth (projected from the bytes per image and the measured capacities)."""
    plt = _pyplot()
    every = runs[-1]
    n = len(every.servers)
    per_server = every.images_per_s / n
    receive_ceiling = every.images_per_s / every.receiver_busy if every.receiver_busy > 0.05 else None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [len(r.servers) for r in runs]
    most = max(n * 2, math.ceil(consumed / per_server) + 1 if consumed and per_server else 0)
    left.plot(xs, [r.images_per_s for r in runs], "o-", label="measured")
    left.plot(
        [0, most], [0, most * per_server], "--", color="grey", label=f"{per_server:.0f} images/s per server (all {n})"
    )
    if consumed:
        left.axhline(consumed, color="tab:green", label=f"training step consumes {consumed:.0f}")
    top = 1.3 * max([r.images_per_s for r in runs] + [consumed or 0.0, most * per_server])
    if receive_ceiling and receive_ceiling < top:
        left.axhline(
            receive_ceiling, color="tab:red", linestyle=":", label=f"this host's receiving ~{receive_ceiling:.0f}"
        )
    elif receive_ceiling:  # (off the chart: said in the title)
        left.set_title(f"receiving here tops out near {receive_ceiling:.0f} (off the chart)", fontsize=8, loc="right")
    left.set(xlabel="servers", ylabel="images/s", xlim=(0, most), ylim=(0, top))
    left.set_title("images/s against servers", loc="left")
    left.xaxis.get_major_locator().set_params(integer=True)
    left.legend(fontsize=8)
    bytes_per_image = every.mb_per_s * MB / every.images_per_s
    capacity = sum(
        s["images_per_s"] / s["workers_busy"] if s["workers_busy"] > 0.2 else s["images_per_s"]
        for s in every.per_server.values()
    )
    ceilings = [capacity] + ([receive_ceiling] if receive_ceiling else [])
    gbits = [0.1 * 1.1**i for i in range(int(math.log(1000) / math.log(1.1)) + 1)]
    projected = [min([g * 1e9 / 8 / bytes_per_image] + ceilings) for g in gbits]
    right.plot(gbits, projected, label=f"projected ({bytes_per_image / 1e3:.0f} kB per image)")
    right.plot(
        [every.mb_per_s * 8 / 1e3], [every.images_per_s], "o", label="measured: the rate it ran at, not a link's speed"
    )
    if consumed:
        right.axhline(consumed, color="tab:green", label=f"training step consumes {consumed:.0f}")
    right.set_xscale("log")
    right.set(
        xlabel="bandwidth into this host, Gbit/s (all servers' links together)",
        ylabel="images/s",
        title=f"images/s against bandwidth, {n} server(s) (projected)",
    )
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def check(args: argparse.Namespace) -> None:
    """SystemExit naming the first bad flag, before anything is connected or measured."""
    for name in ("seconds", "warmup", "connect_timeout"):
        if not getattr(args, name) > 0:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)}: expected seconds, > 0")
    if args.step_time is not None and not args.step_time > 0:
        raise SystemExit(f"--step-time={args.step_time}: expected seconds per step, > 0")
    if args.model is not None and not all(args.model.partition(":")[::2]):
        raise SystemExit(f"--model={args.model!r}: expected MODULE:FUNCTION, e.g. mymodels:resnet50")
    if args.plot:
        _pyplot()  # before minutes of measuring


def run(args: argparse.Namespace) -> int:
    check(args)
    token = None
    if args.token_file:
        with open(args.token_file) as f:
            token = f.read().strip()
    loader_args = dict(
        batch_size=args.batch_size,
        image_size=args.image_size,
        pipeline=args.pipeline,
        drop_last=False,
        receiver=args.receiver,
        wire=args.wire,
        token=token,
        tls=args.tls,
        connect_timeout=args.connect_timeout,
        job=args.job,
        share=args.share,
        **({"clip_frames": args.clip_frames, "frame_stride": args.frame_stride} if args.clip_frames else {}),
    )
    try:
        servers = discover(args.address)
        with RemoteLoader(servers, **loader_args):  # every server can serve this, before any is measured
            pass
    except (ConnectionError, PermissionError, ValueError, LoaderError) as exc:
        raise SystemExit(str(exc)) from None
    if not servers:
        raise SystemExit(f"{args.address!r}: no server address")
    consumed = step_images_per_s(args)
    logging.getLogger("remoteloader.client").addFilter(_not_waiting)
    runs = []
    for count in counts(len(servers)):
        print(f"reading from {count} server(s) for {args.warmup + args.seconds:g} s ...", file=sys.stderr, flush=True)
        runs.append(measure(servers[:count], args, loader_args))
    print(table(runs))
    print()
    if consumed is not None:
        print(f"training step: {consumed[0]:.0f} images/s ({consumed[1]})")
    if args.share:
        last = runs[-1]
        print(
            f"shared decodes: {last.images_shared} of the {last.images} images read from all servers came from a "
            f"decode another loader of the same plan started ({last.images_shared / max(1, last.images):.0%})"
        )
    lines = verdict(runs, consumed[0] if consumed else None)
    local = dataloader_line(runs[-1], consumed[0] if consumed else runs[-1].images_per_s)
    for line in lines + ([local] if local else []):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            report = {"runs": [asdict(r) for r in runs], "step_images_per_s": consumed[0] if consumed else None}
            json.dump(report | {"verdict": lines + ([local] if local else [])}, f, indent=2)
    if args.plot:
        plot(args.plot, runs, consumed[0] if consumed else None)
        print(f"plot: {args.plot}")
    return 0
