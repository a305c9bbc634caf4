"""Server throughput against worker count: does decode + augment scale with cores?

    python benchmarks/scaling.py [--workers 1 2 4 8 16] [--images 2000] [--epochs 3]

One server over the ImageNet-like dataset of throughput.py (by default its `remoteloader
pack`ed shards, as throughput.py serves them; --remote-data folder: the files), pipeline "train"; the client
asks for small outputs (64 px by default) so the wire and the client stay far from
their limits and the figure is the server's decode + augment rate. Efficiency is
rate(K) / (K x rate(1)). Worker counts above the CPUs of this machine are skipped.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def main() -> int:
    from _common import add_remote_data_argument, ensure_dataset, served_data

    from remoteloader.client import RemoteLoader
    from remoteloader.tools.local import LocalServer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--data", default="~/.cache/remoteloader-bench/imagenet-like")
    add_remote_data_argument(parser)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    root = served_data(ensure_dataset(pathlib.Path(args.data).expanduser(), args.images, processes=cores),
                       args.remote_data, cores)
    rows = []
    for workers in [w for w in args.workers if w <= cores]:
        with LocalServer(root, args=["--workers", str(workers), "--log-level", "WARNING"]) as server, \
                RemoteLoader(server.address, batch_size=args.batch_size, image_size=args.image_size,
                             prefetch=8, max_inflight=8) as loader:
            rates = []
            for epoch in range(args.epochs + 1):
                start, n = time.perf_counter(), 0
                for _images, labels in loader:
                    n += len(labels)
                if epoch:  # the first epoch warms the page cache and the workers
                    rates.append(n / (time.perf_counter() - start))
        rows.append((workers, sorted(rates)[len(rates) // 2]))
    base = rows[0][1] / rows[0][0]
    print(f"server throughput on {root}, pipeline train -> {args.image_size}px, {cores} CPUs, "
          f"median of {args.epochs} epochs")
    print("| workers | images/s | efficiency vs linear |")
    print("| --- | --- | --- |")
    for workers, rate in rows:
        print(f"| {workers} | {rate:.0f} | {rate / (base * workers):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
