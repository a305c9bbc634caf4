"""The catalog's memory per sample at 10 M samples, over tars whose indexes are kept (issue 38).

Writes (or reuses) ``--samples`` samples as ``--per-tar`` samples per tar: sparse files of the
size such tars have (ImageNet-like: 20-200 KB images, their .cls members) and, beside each,
the index a server keeps (``formats/index.py``, written with its own ``serialize``), with
ImageNet-like keys ``n<class>/n<class>_<i>.JPEG`` and labels. No image byte is written or read:
a server over kept indexes reads only them (and stats the tars). Then starts a server on them
and one on a single small tar, ``--rounds`` times each, alternating, and reports the catalog's
RSS (the main process's VmRSS above the small server's) per sample, the launch to ``listening
on`` time, the main process's CPU by then and the lines it logged.

    python benchmarks/catalog_memory.py [--samples 10000000] [--per-tar 2500] [--rounds 2]
                                        [--dir ~/.cache/remoteloader-bench/catalog-memory]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

from remoteloader.server.catalog import KeyTable, Shard
from remoteloader.server.formats import index as shard_index
from remoteloader.server.storage import Entry, LocalStorage

CACHE = pathlib.Path.home() / ".cache" / "remoteloader-bench"


def write_sparse_shards(folder: pathlib.Path, samples: int, per_tar: int) -> None:
    """Sparse tars with kept indexes (reused when ``complete-<samples>-<per_tar>`` is there)."""
    marker = folder / f"complete-{samples}-{per_tar}"
    if marker.exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        old.unlink()
    storage = LocalStorage(folder)
    rng = np.random.default_rng(0)
    for first in range(0, samples, per_tar):
        count = min(per_tar, samples - first)
        classes = rng.integers(0, 1000, count)
        keys = [f"n{c:08d}/n{c:08d}_{first + i}.JPEG".encode() for i, c in enumerate(classes.tolist())]
        sizes = rng.integers(20_000, 200_000, count).astype(np.int64)
        spans = (sizes + 511) // 512 * 512 + 512 + 1024  # the image's header and data, its .cls member
        name = f"shard-{first // per_tar:05d}.tar"
        size = int(spans.sum()) + 1024
        with open(folder / name, "wb") as f:
            f.truncate(size)
        table = KeyTable()
        table.blob = np.frombuffer(b"".join(keys), np.uint8)
        table.ends = np.cumsum([len(k) for k in keys]).astype(np.int64)
        table.labels, table.offsets, table.sizes = classes.astype(np.int64), np.cumsum(spans) - spans + 512, sizes
        table.targets, table.target_ends = np.zeros(0, np.uint8), np.zeros(count, np.int64)
        entry = Entry(name, size)
        mtime = os.stat(folder / name).st_mtime_ns
        data = shard_index.serialize(
            Shard(name, table, [], ""), f"sparse-{first}", entry, shard_index.signature(storage, entry), mtime
        )
        (folder / (name + shard_index.INDEX_SUFFIX)).write_bytes(data)
    (folder / "classes.txt").write_text("".join(f"n{c:08d}\n" for c in range(1000)))
    marker.touch()


def write_small(folder: pathlib.Path) -> None:
    write_sparse_shards(folder, 4, 4)


def start(data: pathlib.Path) -> dict:
    """Launch to the ``listening on`` line: seconds, the main process's RSS and CPU, lines logged."""
    t0 = time.perf_counter()
    command = [sys.executable, "-m", "remoteloader.server.cli", "--data", str(data), "--port", "0"]
    server = subprocess.Popen([*command, "--workers", "1", "--log-level", "INFO"], stderr=subprocess.PIPE, text=True)
    assert server.stderr is not None
    lines = []
    for line in server.stderr:
        if "listening on" in line:
            break
        lines.append(line)
    else:
        raise SystemExit("the server did not start:\n" + "".join(lines[-20:]))
    ready = time.perf_counter() - t0
    with open(f"/proc/{server.pid}/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    with open(f"/proc/{server.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    server.send_signal(signal.SIGTERM)
    server.wait(60)
    return {"ready_s": ready, "rss": rss, "cpu_s": cpu, "lines": len(lines)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=lambda s: int(float(s)), default=10_000_000, help="samples (default 1e7)")
    p.add_argument("--per-tar", type=int, default=2500, help="samples per tar (default 2500: ~275 MB tars)")
    p.add_argument("--rounds", type=int, default=2, help="starts of each server (default 2)")
    p.add_argument("--dir", type=pathlib.Path, default=CACHE / "catalog-memory", help="where the shards are kept")
    args = p.parse_args(argv)
    big = args.dir / f"{args.samples}-{args.per_tar}"
    small = args.dir / "small"
    print(f"writing (or reusing) {args.samples:,} samples, {args.per_tar:,} per tar, in {big}", flush=True)
    write_sparse_shards(big, args.samples, args.per_tar)
    write_small(small)
    runs: dict[str, list[dict]] = {"big": [], "small": []}
    for _ in range(args.rounds):
        for kind, data in (("small", small), ("big", big)):
            runs[kind].append(start(data))
            r = runs[kind][-1]
            print(f"{kind:>5}: ready in {r['ready_s']:.2f}s, main process CPU {r['cpu_s']:.1f}s, "
                  f"RSS {r['rss'] / 2**20:.0f} MiB, {r['lines']} lines before 'listening on'", flush=True)
    rss = {kind: statistics.median(r["rss"] for r in rs) for kind, rs in runs.items()}
    per_sample = (rss["big"] - rss["small"]) / args.samples
    tars = -(-args.samples // args.per_tar)
    print(f"catalog: {(rss['big'] - rss['small']) / 2**20:.0f} MiB for {args.samples:,} samples in {tars:,} tars: "
          f"{per_sample:.1f} bytes/sample (median RSS over {args.rounds} starts, above a server on one small tar)")


if __name__ == "__main__":
    main()
