"""The wire alone: GB/s and CPU-seconds per GB, client and servers, with 1 and 3 servers.

Servers run in transport benchmark mode (``--synthetic N``): they hold N samples whose
pixels are generated once and never decoded, so the figures are gRPC + framing + the
client's copy into the batch, nothing else. Everything runs on 127.0.0.1.

    python benchmarks/wire.py [--servers 1 3] [--epochs 4] [--image-size 224] [--batch-size 256]
    python benchmarks/wire.py --servers 1 --chunk-bytes 1048576 2097152 4194304 8388608   # message size sweep
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

from remoteloader.client import RemoteLoader
from remoteloader.server.config import ServerConfig
from remoteloader.server.local import LocalServer

TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """CPU seconds of a process and its reaped children (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / TICKS


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(servers: int, chunk_bytes: int, receiver: str, args) -> dict:
    started = [LocalServer([], args=["--synthetic", str(args.samples), "--log-level", "WARNING",
                                     "--chunk-bytes", str(chunk_bytes)]).start() for _ in range(servers)]
    try:
        with RemoteLoader([s.address for s in started], batch_size=args.batch_size, image_size=args.image_size,
                          shuffle=False, prefetch=args.prefetch, receiver=receiver) as loader:
            child = loader._io.process.pid if receiver == "process" else None
            rows = []
            for epoch in range(args.epochs + 1):
                server_cpu = [process_cpu(s.process.pid) for s in started]
                receiver_cpu = process_cpu(child) if child else 0.0
                client_cpu, start, images = self_cpu(), time.perf_counter(), 0
                for batch, labels in loader:
                    images += len(labels)
                elapsed = time.perf_counter() - start
                gb = images * args.image_size ** 2 * 3 / 1e9
                if epoch:  # the first epoch warms up connections and caches
                    trainer = (self_cpu() - client_cpu) / gb
                    received = (process_cpu(child) - receiver_cpu) / gb if child else 0.0
                    rows.append({"gb_per_s": gb / elapsed,
                                 "client_cpu_s_per_gb": trainer + received,
                                 "trainer_cpu_s_per_gb": trainer,
                                 "trainer_core_s_per_1000_images": trainer * args.image_size ** 2 * 3 * 1000 / 1e9,
                                 "server_cpu_s_per_gb": sum(process_cpu(s.process.pid) - c
                                                            for s, c in zip(started, server_cpu)) / gb})
    finally:
        for s in started:
            s.stop()
    rows.sort(key=lambda r: r["gb_per_s"])
    median = rows[len(rows) // 2]
    return {"servers": servers, "chunk_bytes": chunk_bytes, "receiver": receiver, **median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=3072)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--chunk-bytes", type=int, nargs="+", default=[ServerConfig.chunk_bytes],
                        help="pixel bytes per message (default: the server's)")
    parser.add_argument("--receiver", nargs="+", default=["thread", "process"], choices=["thread", "process"],
                        help="where the client receives: an I/O thread of the training process, or a child process")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = [measure(n, c, r, args) for c in args.chunk_bytes for r in args.receiver for n in args.servers]
    print(f"wire alone, {args.image_size}x{args.image_size} RGB, batch {args.batch_size}, "
          f"median of {args.epochs} epochs, {os.cpu_count()} CPUs")
    print("client = the training process plus its receiver process, if any")
    print("| chunk KiB | receiver | servers | GB/s | client CPU-s/GB | training process CPU-s/GB "
          "| training process core-s per 1000 images | server CPU-s/GB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['chunk_bytes'] >> 10} | {r['receiver']} | {r['servers']} | {r['gb_per_s']:.2f} "
              f"| {r['client_cpu_s_per_gb']:.2f} | {r['trainer_cpu_s_per_gb']:.2f} "
              f"| {r['trainer_core_s_per_1000_images']:.3f} | {r['server_cpu_s_per_gb']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
