"""Uneven replicas: delivered images/s against the sum of the servers' capacities.

Two loader servers hold the same data (replicas of one shard). One is capped at twice the
rate of the other with ``--max-rate`` (default 600 and 300 images/s), so each server's
capacity is known exactly. A scheduler that sends work to whichever replica has room
should deliver close to the sum of the capacities (target: within 10%); one that splits
work evenly is held to twice the slow server's rate.

    python benchmarks/failover.py [--images 1500] [--fast-rate 600] [--slow-rate 300] [--epochs 3]
                                  [--batch-size 64] [--image-size 64] [--synthetic] [--data DIR]

Steps:
  1. Data: ``--images`` JPEGs of 120x160 (remoteloader.tools.textures.make_imagefolder) in
     a temporary directory (or ``--data``), or with ``--synthetic`` no files at all (the
     servers then serve generated samples without decoding).
  2. Headroom check: the same two servers *uncapped*, one warm-up epoch and one timed
     epoch. The caps only define the capacities if the machine can go faster than their
     sum; a warning is printed when it cannot (lower the caps then).
  3. Capped: ``--epochs`` timed epochs after one warm-up, for ordered=True (the default)
     and ordered=False, each with the fast server listed first and with the slow one listed
     first (a fair scheduler does not care). img/s = images delivered / wall time from
     iter() to the last batch; the slow server's share counts the samples it rendered.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import shlex
import statistics
import sys
import tempfile
import time

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

from remoteloader.client import RemoteLoader  # noqa: E402
from remoteloader.tools.local import LocalServer  # noqa: E402
from remoteloader.tools.textures import make_imagefolder  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=1500, help="dataset size (default 1500)")
    p.add_argument("--fast-rate", type=float, default=600.0, help="--max-rate of the fast replica (img/s)")
    p.add_argument("--slow-rate", type=float, default=300.0, help="--max-rate of the slow replica (img/s)")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per configuration (default 3)")
    p.add_argument("--prefetch", type=int, default=8,
                   help="RemoteLoader prefetch, in batches (default 8, as RemoteLoader)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=1, help="decode workers per server (default 1)")
    p.add_argument("--synthetic", action="store_true", help="serve generated samples, no JPEG decode")
    p.add_argument("--data", type=pathlib.Path, default=None, help="ImageFolder to serve (default: generated)")
    return p.parse_args(argv)


def start_servers(data: list[str], rates: list[float | None], args) -> list[LocalServer]:
    servers = []
    try:
        for rate in rates:
            extra = ["--workers", str(args.workers), "--log-level", "WARNING"]
            if args.synthetic:
                extra += ["--synthetic", str(args.images)]
            if rate:
                extra += ["--max-rate", f"{rate:g}"]
            servers.append(LocalServer(data, args=extra))
        for s in servers:  # start them all, then wait: the imports overlap
            s.start(timeout=120)
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: list[LocalServer]) -> None:
    for s in servers:
        s.stop(timeout=20)
        s.kill()  # whatever is left of its process group (decode workers, forkserver)


def run_epochs(servers: list[LocalServer], epochs: int, args, ordered: bool = True) -> dict:
    """Shares are reported per server in the order of ``servers`` (the order they are listed in)."""
    addresses = [s.address for s in servers]
    with RemoteLoader(addresses, batch_size=args.batch_size, image_size=args.image_size, seed=0, drop_last=False,
                      ordered=ordered, connect_timeout=60, prefetch=args.prefetch) as loader:
        for _ in loader:  # warm-up: streams open, workers and page cache warm
            pass
        before = {a: s["samples"] for a, s in loader.stats()["servers"].items()}
        rates, waits = [], []
        for _ in range(epochs):
            wait0 = loader.stats()["wait_s"]
            images = 0
            started = time.perf_counter()
            for batch in loader:
                images += batch[0].shape[0]
            elapsed = time.perf_counter() - started
            rates.append(images / elapsed)
            waits.append((loader.stats()["wait_s"] - wait0) / elapsed)
        after = loader.stats()["servers"]
        samples = {a: after[a]["samples"] - before[a] for a in addresses}
    total = sum(samples.values())
    return {"rates": rates, "median": statistics.median(rates), "wait": statistics.median(waits),
            "share": [samples[a] / total for a in addresses]}


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    capacity = args.fast_rate + args.slow_rate
    cleanup = None
    if args.synthetic:
        data: list[str] = []
        what = f"{args.images} synthetic samples (no decode)"
    elif args.data is not None:
        data = [str(args.data)]
        what = f"ImageFolder {args.data}"
    else:
        cleanup = tempfile.TemporaryDirectory(prefix="remoteloader-failover-bench-")
        started = time.perf_counter()
        per_class = -(-args.images // 10)
        root = make_imagefolder(pathlib.Path(cleanup.name) / "data", [f"class{c}" for c in range(10)], per_class,
                                size=(120, 160), seed=0)
        data = [str(root)]
        what = f"{per_class * 10} JPEGs of 120x160 (generated in {time.perf_counter() - started:.1f}s)"
    print(f"data: {what}; batch {args.batch_size}, image_size {args.image_size}, {args.workers} worker(s) per "
          f"server; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)

    try:
        servers = start_servers(data, [None, None], args)
        try:
            uncapped = run_epochs(servers, 1, args)
        finally:
            stop_servers(servers)
        print(f"uncapped: {uncapped['median']:.0f} img/s", file=sys.stderr, flush=True)
        if uncapped["median"] < 1.1 * capacity:
            print(f"WARNING: uncapped the two servers deliver {uncapped['median']:.0f} img/s, not clearly above "
                  f"the sum of the caps ({capacity:g}); the caps do not define the capacity here: lower "
                  f"--fast-rate/--slow-rate", file=sys.stderr, flush=True)

        fast, slow = servers = start_servers(data, [args.fast_rate, args.slow_rate], args)
        try:
            results = {}
            for ordered in (True, False):
                for listing in ("fast first", "slow first"):
                    r = run_epochs([fast, slow] if listing == "fast first" else [slow, fast], args.epochs, args,
                                   ordered)
                    r["slow_share"] = r["share"][1] if listing == "fast first" else r["share"][0]
                    results[(ordered, listing)] = r
                    print(f"ordered={ordered}, {listing}: {r['median']:.0f} img/s", file=sys.stderr, flush=True)
        finally:
            stop_servers(servers)
    finally:
        if cleanup is not None:
            cleanup.cleanup()

    ideal_slow = args.slow_rate / capacity
    print()
    print(f"Two replicas, capped at {args.fast_rate:g} and {args.slow_rate:g} img/s (capacity {capacity:g} img/s); "
          f"{what}; {args.epochs} timed epochs each; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs")
    print()
    print("| configuration | servers listed | capacity img/s | delivered img/s (median) | min-max | % of capacity "
          "| slow server's share (ideal) | loop waiting |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    print(f"| uncapped (headroom check) | - | - | {uncapped['median']:.0f} | - | - | - | {uncapped['wait']:.0%} |")
    for (ordered, listing), r in results.items():
        name = "ordered=True (default)" if ordered else "ordered=False"
        print(f"| {name} | {listing} | {capacity:g} | {r['median']:.0f} | {min(r['rates']):.0f}-{max(r['rates']):.0f} "
              f"| {r['median'] / capacity:.0%} | {r['slow_share']:.0%} ({ideal_slow:.0%}) | {r['wait']:.0%} |")
    print()
    print(f"Target: within 10% of capacity (>= {0.9 * capacity:.0f} img/s).")
    print(f"Command: `{command}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
