"""Epochs read from disk: a RemoteLoader's images/s when the data is not in the page cache, against
the same epoch cached, with the server's read-ahead on and off.

    python benchmarks/cold_epochs.py [--images N] [--rounds R] [--remote-data packed,folder] [--json PATH]
    python benchmarks/cold_epochs.py --read-mbps 150        # a slower disk: reads capped at 150 MB/s

One run, one local server per (data, read-ahead) at a time, 2 workers, random-resized crop to 224
+ flip, batch 256. After two warm-up epochs (every file then decodes by region, as in a steady
state), each round plays a cached epoch, drops the data's pages from the page cache
(``posix_fadvise(DONTNEED)`` on every file, no root needed), and plays a cold one: the disk then
reads every byte again, as in every epoch of a dataset larger than the memory. Rounds of read-ahead
on and off alternate, so drift hits them alike. Reported: median images/s of each kind of epoch
and cold / cached. The data is the throughput benchmark's cached ImageFolder of photo-like JPEGs
(``packed``: the shards ``remoteloader pack`` wrote from it; ``folder``: its own files).

``--read-mbps`` makes the disk slower: the benchmark moves itself (and so the servers it starts,
their workers and read-ahead threads) into a cgroup whose reads from the data's block device are
capped at that many MB/s (cgroup v2 ``io.max``, or v1 ``blkio.throttle.read_bps_device``; needs
root). It then also prints the disk's ceiling, the images/s the cap can carry at the data's mean
bytes per image: a cold epoch cannot beat it.
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
from remoteloader.tools.page_cache import evict  # noqa: E402


def epoch(loader: RemoteLoader, number: int) -> float:
    """Images/s of one epoch."""
    loader.set_epoch(number)
    started, images = time.perf_counter(), 0
    for _images, labels in loader:
        images += len(labels)
    return images / (time.perf_counter() - started)


class ReadCap:
    """This process (and what it starts from now on) in a cgroup whose reads from ``device`` are
    capped at ``rate`` bytes/s; ``close`` moves it back and removes the cgroup."""

    def __init__(self, device: int, rate: int):
        v2 = pathlib.Path("/sys/fs/cgroup/cgroup.controllers")
        if v2.exists() and "io" in v2.read_text().split():
            self.root = pathlib.Path("/sys/fs/cgroup")
            limit = ("io.max", f"{os.major(device)}:{os.minor(device)} rbps={rate}")
        elif pathlib.Path("/sys/fs/cgroup/blkio/blkio.throttle.read_bps_device").exists():
            self.root = pathlib.Path("/sys/fs/cgroup/blkio")
            limit = ("blkio.throttle.read_bps_device", f"{os.major(device)}:{os.minor(device)} {rate}")
        else:
            raise SystemExit("--read-mbps: this kernel has neither cgroup v2's io controller nor v1's blkio throttle")
        self.group = self.root / f"remoteloader-cold-{os.getpid()}"
        try:
            self.group.mkdir()
            (self.group / limit[0]).write_text(limit[1])
            (self.group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as exc:
            if self.group.exists():
                self.group.rmdir()
            raise SystemExit(f"--read-mbps: cannot cap reads with a cgroup ({exc}); it needs root") from None

    def close(self) -> None:
        (self.root / "cgroup.procs").write_text(str(os.getpid()))
        try:
            self.group.rmdir()
        except OSError as exc:  # a process it started still in it: say so, keep the results
            print(f"could not remove the cgroup {self.group} ({exc}); rmdir it once its processes are gone",
                  file=sys.stderr)


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
            evict([p for p in served.rglob("*") if p.is_file()])
            cold = epoch(loader, 3)
        return cached, cold
    finally:
        server.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=2000, help="images (default 2000, as throughput.py)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each (data, read-ahead) (default 3)")
    parser.add_argument("--remote-data", default="packed,folder", help="packed, folder or both (default)")
    parser.add_argument("--read-mbps", type=float, help="cap the disk's reads at this many MB/s (needs root)")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    root = _common.ensure_dataset(_common.DEFAULT_DATA, args.images, processes=_common.default_cores())
    print(
        f"data: {root} ({args.images} JPEGs); load average {os.getloadavg()[0]:.2f} on {_common.default_cores()} cores",
        flush=True,
    )
    cap = None
    if args.read_mbps:
        cap = ReadCap(root.stat().st_dev, int(args.read_mbps * 1e6))
    try:
        return _run(args, root)
    finally:
        if cap is not None:
            cap.close()


def _run(args: argparse.Namespace, root: pathlib.Path) -> int:
    log_dir = tempfile.mkdtemp(prefix="remoteloader-cold-")
    results = []
    for kind in args.remote_data.split(","):
        served = _common.served_data(root, kind, _common.default_cores())
        ceiling = None
        if args.read_mbps:
            files = [p for p in served.rglob("*") if p.is_file()]
            per_image = sum(p.stat().st_size for p in files) / args.images
            ceiling = args.read_mbps * 1e6 / per_image
            print(f"{kind}: {per_image / 1e3:.0f} KB per image; the disk's ceiling at {args.read_mbps:g} MB/s: "
                  f"{ceiling:.0f} images/s", flush=True)
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
                    "disk_ceiling_images_per_s": ceiling,
                    "rounds": [list(p) for p in pairs],
                }
            )
            print(
                f"{kind:7s} read-ahead {'on ' if read_ahead else 'off'}  cached {cached:6.0f} img/s  "
                f"cold {cold:6.0f} img/s  cold/cached {cold / cached:4.2f}"
                + (f"  cold/ceiling {cold / ceiling:4.2f}" if ceiling else ""),
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
