"""Epochs read from disk: a RemoteLoader's images/s when the data is not in the page cache, against
the same epoch cached, with the server's read-ahead on and off.

    python benchmarks/cold_epochs.py [--images N] [--rounds R] [--remote-data packed,folder] [--json PATH]

One run, one local server per (data, read-ahead) at a time, 2 workers, random-resized crop to 224
+ flip, batch 256. After two warm-up epochs (every file then decodes by region, as in a steady
state), each round plays a cached epoch, drops the data's pages from the page cache
(``posix_fadvise(DONTNEED)`` on every file, no root needed), and plays a cold one: the disk then
reads every byte again, as in every epoch of a dataset larger than the memory. Rounds of read-ahead
on and off alternate, so drift hits them alike. Reported: median images/s of each kind of epoch
and cold / cached. The data is the throughput benchmark's cached ImageFolder of photo-like JPEGs
(``packed``: the shards ``remoteloader pack`` wrote from it; ``folder``: its own files).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

from remoteloader.client import RemoteLoader  # noqa: E402
from remoteloader.tools.local import LocalServer  # noqa: E402


def epoch(loader: RemoteLoader, number: int) -> float:
    """Images/s of one epoch."""
    loader.set_epoch(number)
    started, images = time.perf_counter(), 0
    for _images, labels in loader:
        images += len(labels)
    return images / (time.perf_counter() - started)


def one_round(served: pathlib.Path, read_ahead: bool, log_dir: str) -> tuple[float, float]:
    """(cached, cold) images/s: one server, two warm-up epochs, a cached epoch, then a cold one."""
    server = LocalServer(
        served,
        args=["--workers", "2", "--grace", "2", f"--read-ahead={str(read_ahead).lower()}"],
        log_path=pathlib.Path(log_dir) / f"server-{served.name}-{read_ahead}.log",
    )
    server.start(timeout=300)
    try:
        with RemoteLoader(server.address, batch_size=256, image_size=224, drop_last=True, seed=0) as loader:
            epoch(loader, 0)
            epoch(loader, 1)
            cached = epoch(loader, 2)
            _common.evict([p for p in served.rglob("*") if p.is_file()])
            cold = epoch(loader, 3)
        return cached, cold
    finally:
        server.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=2000, help="images (default 2000, as throughput.py)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each (data, read-ahead) (default 3)")
    parser.add_argument("--remote-data", default="packed,folder", help="packed, folder or both (default)")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    root = _common.ensure_dataset(_common.DEFAULT_DATA, args.images, processes=_common.default_cores())
    print(
        f"data: {root} ({args.images} JPEGs); load average {os.getloadavg()[0]:.2f} on {_common.default_cores()} cores",
        flush=True,
    )
    log_dir = tempfile.mkdtemp(prefix="remoteloader-cold-")
    results = []
    for kind in args.remote_data.split(","):
        served = _common.served_data(root, kind, _common.default_cores())
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for read_ahead in (False, True):
                runs[read_ahead].append(one_round(served, read_ahead, log_dir))
        for read_ahead, pairs in runs.items():
            cached = statistics.median(c for c, _ in pairs)
            cold = statistics.median(c for _, c in pairs)
            results.append(
                {
                    "data": kind,
                    "read_ahead": read_ahead,
                    "cached_images_per_s": cached,
                    "cold_images_per_s": cold,
                    "cold_over_cached": cold / cached,
                    "rounds": [list(p) for p in pairs],
                }
            )
            print(
                f"{kind:7s} read-ahead {'on ' if read_ahead else 'off'}  cached {cached:6.0f} img/s  "
                f"cold {cold:6.0f} img/s  cold/cached {cold / cached:4.2f}",
                flush=True,
            )
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
