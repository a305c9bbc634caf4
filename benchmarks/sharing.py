"""Several jobs on one server: what sharing a decode saves, and weighted shares between jobs.

One loader server on this machine's cores serves, in one run, side by side:

  1. alone:  one job (a loader in a process of its own), ``--epochs`` epochs;
  2. same:   ``--jobs`` identical jobs at once (the same plan: seed, pipeline, size, batch),
             as a sweep that differs only in the model would run. Each should get at least
             0.9x the images/s of the job alone, and the server's CPU (main process and
             decode workers) should stay at most 1.25x what it spent on the job alone,
             where without sharing it would be about ``--jobs`` x;
  3. weights: two different jobs (different seeds, so nothing to share), named "heavy" and
             "light", with the server's ``--job-weights heavy=3,light=1``, both reading as
             fast as they can for ``--seconds``: their images over the time both ran should
             be 3:1 (within 10%).

Each phase uses its own seed, so nothing one phase rendered is joined by the next. Jobs
are separate processes (as training jobs are); they start together at an agreed time, after
their loaders have opened. images/s of a job = images of its epochs after the first, over
their time; the first epoch of each job is a warm-up.

    python benchmarks/sharing.py [--images 2000] [--jobs 4] [--epochs 4] [--seconds 12]
                                 [--batch-size 256] [--image-size 224] [--workers N] [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import time

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

from remoteloader.tools.local import LocalServer  # noqa: E402

WEIGHTS = {"heavy": 3.0, "light": 1.0}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2000, help="dataset size (default 2000)")
    p.add_argument("--jobs", type=int, default=4, help="identical jobs at once (default 4)")
    p.add_argument("--epochs", type=int, default=4, help="epochs per job, the first a warm-up (default 4)")
    p.add_argument("--seconds", type=float, default=12.0, help="how long the weighted jobs run (default 12)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--workers", type=int, default=_common.default_cores(), help="decode workers (default: all cores)")
    p.add_argument(
        "--data",
        type=pathlib.Path,
        default=_common.DEFAULT_DATA,
        help=f"cached ImageFolder (default {_common.DEFAULT_DATA})",
    )
    # One job (run by the benchmark itself, in a process of its own).
    p.add_argument("--run-job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--until", type=float, default=0.0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_job(args: argparse.Namespace) -> None:
    """One job: opens its loader, waits for the agreed start, plays ``--epochs`` epochs (or
    until ``--until``), and prints what it got as one JSON line."""
    from remoteloader.client import RemoteLoader

    with RemoteLoader(
        args.address,
        batch_size=args.batch_size,
        image_size=args.image_size,
        seed=args.seed,
        job=args.job,
        connect_timeout=60,
    ) as loader:
        time.sleep(max(0.0, args.start_at - time.time()))
        cpu0 = time.process_time()
        epochs, marks = [], []  # marks: (time.time(), images so far), one per batch
        images = 0
        epoch = 0
        while (args.until and time.time() < args.until) or (not args.until and epoch < args.epochs):
            loader.set_epoch(epoch)
            started, first = time.perf_counter(), images
            for batch in loader:
                images += batch[0].shape[0]
                marks.append((time.time(), images))
                if args.until and time.time() >= args.until:
                    break
            epochs.append({"images": images - first, "seconds": time.perf_counter() - started})
            epoch += 1
        stats = loader.stats()
        cpu = time.process_time() - cpu0
    print(
        json.dumps({"epochs": epochs, "marks": marks, "images_shared": stats["images_shared"], "cpu_s": cpu}),
        flush=True,
    )


def start_jobs(args, address: str, specs: list[tuple[int, str | None]], until: float = 0.0) -> list[dict]:
    """Runs one process per (seed, job) spec, started together; their reports, in order."""
    start_at = time.time() + 8.0  # their loaders open first (imports, Describe, streams)
    commands = [
        [
            sys.executable,
            __file__,
            "--run-job",
            "--address",
            address,
            "--seed",
            str(seed),
            "--batch-size",
            str(args.batch_size),
            "--image-size",
            str(args.image_size),
            "--epochs",
            str(args.epochs),
            "--start-at",
            str(start_at),
            "--until",
            str(until + start_at if until else 0.0),
        ]
        + (["--job", job] if job else [])
        for seed, job in specs
    ]
    processes = [subprocess.Popen(c, stdout=subprocess.PIPE, text=True) for c in commands]
    reports = []
    for process in processes:
        out, _ = process.communicate(timeout=600)
        if process.returncode:
            raise SystemExit(f"a job failed (exit {process.returncode})")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def rate(report: dict) -> float:
    """images/s over the epochs after the first."""
    timed = report["epochs"][1:]
    return sum(e["images"] for e in timed) / sum(e["seconds"] for e in timed)


def server_cpu(server: LocalServer) -> float:
    split = _common.cpu_split(os.getpid(), server.process.pid)
    return split["server_main"] + split["server_workers"]


def images_between(report: dict, start: float, end: float) -> int:
    """The job's images delivered in [start, end] (by its per-batch marks)."""
    before = [n for t, n in report["marks"] if t <= start]
    upto = [n for t, n in report["marks"] if t <= end]
    return (upto[-1] if upto else 0) - (before[-1] if before else 0)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.run_job:
        run_job(args)
        return 0
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    root = _common.ensure_dataset(args.data, args.images, processes=_common.default_cores())
    weights = ",".join(f"{name}={weight:g}" for name, weight in WEIGHTS.items())
    server = LocalServer(
        str(root), args=["--workers", str(args.workers), "--log-level", "WARNING", "--job-weights", weights]
    )
    server.start(timeout=120)
    print(
        f"data: {args.images} images in {root}; batch {args.batch_size}, {args.image_size}px, "
        f"{args.workers} decode workers; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
        file=sys.stderr,
        flush=True,
    )
    try:
        cpu0 = server_cpu(server)
        (alone,) = start_jobs(args, server.address, [(1, None)])
        cpu_alone = server_cpu(server) - cpu0
        cpu0 = server_cpu(server)
        same = start_jobs(args, server.address, [(2, None)] * args.jobs)
        cpu_same = server_cpu(server) - cpu0
        heavy, light = start_jobs(args, server.address, [(3, "heavy"), (4, "light")], until=args.seconds)
    finally:
        server.stop(timeout=20)
        server.kill()

    base = rate(alone)
    rates = [rate(r) for r in same]
    epoch_images = alone["epochs"][0]["images"]
    print(f"\n{command}\n")
    print(
        f"alone: {base:.0f} img/s; server CPU {cpu_alone:.1f} s for {args.epochs} epochs of {epoch_images} images; "
        f"the job's own process {alone['cpu_s']:.1f} s"
    )
    print(f"{args.jobs} identical jobs at once: " + ", ".join(f"{r:.0f}" for r in rates) + " img/s")
    print(
        f"  each job vs alone: min {min(rates) / base:.2f}x, median {statistics.median(rates) / base:.2f}x "
        f"(target >= 0.90x)"
    )
    print(
        f"  server CPU vs one job alone: {cpu_same / cpu_alone:.2f}x (target <= 1.25x; "
        f"without sharing about {args.jobs}x); the jobs' own processes {sum(r['cpu_s'] for r in same):.1f} s "
        f"on the same cores"
    )
    shared = [r["images_shared"] for r in same]
    total = sum(sum(e["images"] for e in r["epochs"]) for r in same)
    print(
        f"  images from a shared decode: {sum(shared)} of {total} ({sum(shared) / total:.0%}; "
        f"a perfect share is {(args.jobs - 1) / args.jobs:.0%})"
    )
    start = max(heavy["marks"][0][0], light["marks"][0][0]) + 2.0  # past the first batches
    end = min(heavy["marks"][-1][0], light["marks"][-1][0])
    got = {name: images_between(r, start, end) for name, r in (("heavy", heavy), ("light", light))}
    ratio = got["heavy"] / max(1, got["light"])
    print(
        f"weights heavy=3, light=1 over the {end - start:.1f} s both ran: heavy {got['heavy']} images, "
        f"light {got['light']}: {ratio:.2f}:1 (target 3:1 within 10%: 2.7-3.3)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
