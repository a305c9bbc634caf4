"""Server memory: RSS with a 1,000,000-sample catalog, and across 20 epochs of serving.

1. Writes (or reuses) WebDataset tar shards holding N samples whose images are empty
   members (only the index matters here), starts a server on them and one on a
   three-image dataset, and reports the main process's RSS above the empty server's.
2. Serves a small real JPEG dataset for 20 epochs and reports the RSS of the server and
   its workers after each epoch (flat means no leak).

    python benchmarks/memory.py [--samples 1000000] [--epochs 20] [--dir ~/.cache/remoteloader-bench]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time

from remoteloader.client import RemoteLoader
from remoteloader.tools.local import LocalServer
from remoteloader.tools.textures import make_imagefolder

PER_TAR = 100_000


def tar_header(name: str, size: int) -> bytes:
    """A ustar header block (what tarfile writes, built directly: 2M members in seconds)."""
    fields = [name.encode().ljust(100, b"\0"), b"0000644\0", b"0000000\0", b"0000000\0",
              f"{size:011o}\0".encode(), b"00000000000\0", b" " * 8, b"0", b"\0" * 100,
              b"ustar\x0000", b"\0" * 32, b"\0" * 32, b"0000000\0", b"0000000\0", b"\0" * 155]
    block = b"".join(fields).ljust(512, b"\0")
    checksum = f"{sum(block):06o}\0 ".encode()
    return block[:148] + checksum + block[156:]


def write_index_shards(folder: pathlib.Path, samples: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / f"complete-{samples}"
    if marker.exists():
        return
    for old in folder.glob("*.tar"):
        old.unlink()
    for t in range(0, samples, PER_TAR):
        with open(folder / f"shard-{t // PER_TAR:05d}.tar", "wb") as f:
            for i in range(t, min(t + PER_TAR, samples)):
                key = f"n{i % 1000:05d}/{i:08d}"
                label = str(i % 1000).encode()
                f.write(tar_header(key + ".jpg", 0))
                f.write(tar_header(key + ".cls", len(label)))
                f.write(label.ljust(512, b"\0"))
            f.write(b"\0" * 1024)
    (folder / "classes.txt").write_text("".join(f"n{c:05d}\n" for c in range(1000)))
    marker.touch()


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A /proc/PID/status memory field in MB: VmRSS (all resident), RssAnon (private heap)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def tree_rss_mb(pid: int, field: str = "VmRSS") -> float:
    """RSS of a process and its descendants (the decode workers, the forkserver).

    VmRSS counts the shared chunk slots (and cache) once per process that touched them, so
    it rises while workers first touch slots; RssAnon is private memory, where a leak shows.
    """
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += rss_mb(p, field)
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo.extend(int(c) for c in f.read().split())
        except FileNotFoundError:
            continue
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--dir", default=os.path.expanduser("~/.cache/remoteloader-bench"))
    args = parser.parse_args()
    root = pathlib.Path(args.dir)
    index = root / f"index-{args.samples}"
    started = time.perf_counter()
    write_index_shards(index, args.samples)
    print(f"tar index of {args.samples} samples in {index} ({time.perf_counter() - started:.0f}s)")

    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_imagefolder(pathlib.Path(tmp) / "tiny", ["a"], 3, size=(32, 32))
        common = ["--workers", "1", "--log-level", "WARNING"]
        with LocalServer(tiny, args=common) as empty:
            time.sleep(1)
            base = rss_mb(empty.process.pid)
        started = time.perf_counter()
        with LocalServer(index, args=common).start(timeout=600) as big:
            indexed = time.perf_counter() - started
            time.sleep(1)
            full = rss_mb(big.process.pid)
        print("\n| server | main process RSS | start-up |")
        print("| --- | --- | --- |")
        print(f"| 3 samples | {base:.0f} MB | |")
        print(f"| {args.samples:,} samples | {full:.0f} MB (+{full - base:.0f} MB, "
              f"{(full - base) * 2**20 / args.samples:.0f} B/sample) | {indexed:.1f}s |")

        data = make_imagefolder(pathlib.Path(tmp) / "small", ["a", "b", "c"], 100, size=(120, 160), jitter=0.2)
        with LocalServer(data, args=["--workers", "2", "--log-level", "WARNING"]) as server, \
                RemoteLoader(server.address, batch_size=50, image_size=96) as loader:
            readings = []
            for _epoch in range(args.epochs):
                for _images, _labels in loader:
                    pass
                readings.append((rss_mb(server.process.pid), tree_rss_mb(server.process.pid),
                                 tree_rss_mb(server.process.pid, "RssAnon")))
        print(f"\nserver RSS across {args.epochs} epochs of {loader.num_samples} images (MB): main process "
              f"first {readings[0][0]:.0f}, last {readings[-1][0]:.0f}, max {max(r[0] for r in readings):.0f}; "
              f"with workers first {readings[0][1]:.0f}, last {readings[-1][1]:.0f}, "
              f"max {max(r[1] for r in readings):.0f}; private (RssAnon) with workers first {readings[0][2]:.0f}, "
              f"last {readings[-1][2]:.0f}, max {max(r[2] for r in readings):.0f}")


if __name__ == "__main__":
    main()
