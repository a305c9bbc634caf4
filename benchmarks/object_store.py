"""Shards from an object store against the same shards on local disk, side by side in one run.

The store (SeaweedFS, ``tools/local_s3.py``) runs in a network namespace of its own behind a
shaped link (``tc tbf`` at ``--rate`` Mbit/s towards the server, plus ``--delay-ms`` of netem
delay where the kernel has netem), as a store in another rack would be; the loader server and
the training loop share this namespace. The ImageNet-like dataset of ``benchmarks/_common.py``
is packed once (``remoteloader pack``) and uploaded to the store; then:

* the server on the local shards, ``--epochs`` epochs: the first with the shards evicted from
  the page cache (``posix_fadvise(DONTNEED)``), so that it reads the disk as the bucket's first
  epoch reads the store, later ones from the page cache;
* a server on ``s3://bench/shards``: the first epoch cold (an empty ``--cache-dir``), the
  rest warm (the shards fit ``--disk-cache-bytes``).

For every epoch it prints images/s, the bytes fetched from the store and the ranged GETs that
fetched them (the server's ``remoteloader_store_fetched_bytes_total`` and
``remoteloader_store_requests_total``), the server main process's CPU per image, its RSS and
the bytes its cache holds; then the ratios the issue asks for: the median warm epoch from
the bucket over the median local one (target 0.95), the cold epoch over it and over the local
first epoch (target 0.8; `pack`ed shards are region-decoded from their first epoch, as
later), and the cold epoch's bytes fetched over the shards' size (ideally 1; with drop_last an
epoch leaves out a remainder, fetched by a later epoch). It also prints the link's ceiling: the
images/s that ``--rate`` can carry at the shards' bytes per image; a cold epoch cannot beat it,
whatever the server does (at 1 Gbit/s, about 1,060 ImageNet-sized images/s: fewer than two
cores decode).

    python benchmarks/object_store.py                     # 2000 images, 10 epochs each
    python benchmarks/object_store.py --images 600 --epochs 3     # quick
    python benchmarks/object_store.py --no-link           # the store on 127.0.0.1, no shaping
    python benchmarks/object_store.py --store-cpus 1      # the store on CPU 1, all else on the rest

``--store-cpus`` gives the store cores of its own (``taskset``), as a store on another machine
has, and pins the server, its workers and the training loop to the other cores, for both
sides: otherwise the store's CPU per request (SeaweedFS: about 0.5-1 ms for a sample-sized
GET) is taken from the cores that decode.

Needs unshare, ip and tc (Debian's iproute2) and user namespaces, as benchmarks/shaped_links.py.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from _common import DEFAULT_DATA, default_cores, ensure_dataset, ensure_packed  # noqa: E402

from remoteloader.client import cpu  # noqa: E402
from remoteloader.tools import shaped_links  # noqa: E402
from remoteloader.tools.local import LocalServer  # noqa: E402
from remoteloader.tools.local_s3 import LocalS3  # noqa: E402
from remoteloader.tools.page_cache import evict  # noqa: E402

INSIDE = "REMOTELOADER_BENCH_INSIDE"


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def epochs(server: LocalServer, args: argparse.Namespace, metrics_port: int, remote: bool, store: int) -> list[dict]:
    """Each epoch's figures; ``store``: the store's pid (its CPU shares these cores: it is reported)."""
    from remoteloader.client import RemoteLoader

    out = []
    with RemoteLoader(server.address, batch_size=args.batch_size, image_size=args.image_size,
                      connect_timeout=60, shared_memory=True) as loader:
        for epoch in range(args.epochs):
            fetched = metric(metrics_port, "remoteloader_store_fetched_bytes_total") if remote else 0.0
            requests = metric(metrics_port, "remoteloader_store_requests_total") if remote else 0.0
            main_cpu = cpu.process_cpu(server.process.pid)
            store_cpu = cpu.tree_cpu(store)
            started, images = time.perf_counter(), 0
            for batch, _labels in loader:
                images += len(batch)
            seconds = time.perf_counter() - started
            row = {
                "epoch": epoch,
                "images_per_s": images / seconds,
                "main_cpu_ms_per_image": 1000 * (cpu.process_cpu(server.process.pid) - main_cpu) / images,
                "store_cpu_ms_per_image": 1000 * (cpu.tree_cpu(store) - store_cpu) / images,
                "server_rss_mb": rss_mb(server.process.pid),
            }
            if remote:
                row["fetched_mb"] = (metric(metrics_port, "remoteloader_store_fetched_bytes_total") - fetched) / 1e6
                row["requests"] = metric(metrics_port, "remoteloader_store_requests_total") - requests
                row["cache_mb"] = metric(metrics_port, "remoteloader_disk_cache_bytes") / 1e6
            out.append(row)
            print(("bucket " if remote else "local  ") + json.dumps({k: round(v, 3) for k, v in row.items()}),
                  flush=True)
    return out


def run(args: argparse.Namespace) -> dict:
    store_wrap: list[str] = []
    if args.store_cpus:
        store_cpus = {int(c) for c in args.store_cpus.split(",")}
        rest = os.sched_getaffinity(0) - store_cpus
        if not rest or not store_cpus <= os.sched_getaffinity(0):
            raise SystemExit(f"--store-cpus {args.store_cpus}: give it some of CPUs {sorted(os.sched_getaffinity(0))}")
        os.sched_setaffinity(0, rest)  # the server, its workers and the loader inherit it
        store_wrap = ["taskset", "-c", args.store_cpus]
    args.workers = args.workers or default_cores()
    data = ensure_dataset(pathlib.Path(args.data).expanduser(), args.images)
    packed = ensure_packed(data, args.workers)
    shard_bytes = sum(p.stat().st_size for p in packed.glob("*.tar"))
    work = pathlib.Path(tempfile.mkdtemp(prefix="object-store-bench-"))
    link = "none (127.0.0.1)"
    if args.no_link:
        store = LocalS3(work / "s3", buckets=("bench",), wrap=store_wrap)
    else:
        subprocess.run(["mount", "-t", "tmpfs", "none", "/run"], check=True)  # for `ip netns` (our own mounts)
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        host = shaped_links.make_link(0, args.rate)
        link = f"tbf {args.rate} Mbit/s"
        if args.delay_ms:  # netem shapes the rate too: it replaces the link's tbf where the kernel has it
            netem = subprocess.run(["ip", "netns", "exec", "rl0", "tc", "qdisc", "replace", "dev", "rl0b", "root",
                                    "netem", "delay", f"{args.delay_ms}ms", "rate", f"{args.rate}mbit"],
                                   capture_output=True, text=True)
            if netem.returncode == 0:
                link = f"netem {args.rate} Mbit/s, {args.delay_ms} ms"
            print(f"the store's link: {link} {netem.stderr.strip()}", file=sys.stderr)
        store = LocalS3(work / "s3", buckets=("bench",), host=host, wrap=["ip", "netns", "exec", "rl0", *store_wrap])
    with store:
        env = store.env()
        print(f"uploading {shard_bytes / 1e6:.0f} MB of shards ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-c", "import obstore, pathlib, sys\n"
                        "from obstore.store import from_url\n"
                        "s = from_url('s3://bench')\n"
                        "for f in sorted(pathlib.Path(sys.argv[1]).iterdir()):\n"
                        "    obstore.put(s, 'shards/' + f.name, f) if f.is_file() and not f.name.startswith('.') "
                        "else None\n", str(packed)], check=True, env={**os.environ, **env})
        results = {}
        for name, path, remote in (("local", str(packed), False), ("bucket", "s3://bench/shards", True)):
            if not remote:
                evict(sorted(packed.iterdir()))
            cache = pathlib.Path(args.cache_dir or work) / f"cache-{name}-{os.getpid()}"
            # (-1: it binds a free port and logs which, at INFO)
            server = LocalServer(path, args=["--workers", str(args.workers), "--metrics-port", "-1",
                                             "--cache-dir", str(cache)],
                                 env=env)
            server.launch()
            server.wait_ready(120)
            try:
                assert server.metrics_port is not None
                results[name] = epochs(server, args, server.metrics_port, remote, store.pid)
            finally:
                server.stop(30)
    local = statistics.median(r["images_per_s"] for r in results["local"][1:] or results["local"])
    warm = statistics.median(r["images_per_s"] for r in results["bucket"][1:] or results["bucket"])
    cold = results["bucket"][0]
    images_per_byte = args.images / shard_bytes
    summary = {
        "link": link,
        "store_cpus": args.store_cpus or "shared with the server",
        "workers": args.workers,
        # What the link can carry: the cold epoch's ceiling, whatever the server does.
        "link_ceiling_images_per_s": None if args.no_link else args.rate * 1e6 / 8 * images_per_byte,
        "cold_images_per_s": cold["images_per_s"],
        "images": args.images,
        "shards_mb": shard_bytes / 1e6,
        "warm_over_local": warm / local,
        "cold_over_local": cold["images_per_s"] / local,
        # Both first epochs read bytes not in memory (the local one from disk) and decode every
        # image whole (a crop's region only once it has decoded cleanly).
        "cold_over_local_first": cold["images_per_s"] / results["local"][0]["images_per_s"],
        "cold_fetched_over_shards": cold["fetched_mb"] * 1e6 / shard_bytes,
        "cold_requests": cold["requests"],
        "warm_fetched_mb": sum(r["fetched_mb"] for r in results["bucket"][1:]),
        "main_cpu_ms_per_image": {
            "local": statistics.median(r["main_cpu_ms_per_image"] for r in results["local"]),
            "bucket_warm": statistics.median(r["main_cpu_ms_per_image"] for r in results["bucket"][1:] or [cold]),
            "bucket_cold": cold["main_cpu_ms_per_image"],
        },
        "server_rss_mb": {
            "first": results["bucket"][0]["server_rss_mb"],
            "last": results["bucket"][-1]["server_rss_mb"],
        },
        "cache_mb_last": results["bucket"][-1]["cache_mb"],
    }
    print(json.dumps(summary, indent=2))
    return {"summary": summary, "epochs": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--workers", type=int, help="decode workers (default: a core each)")
    parser.add_argument("--rate", type=float, default=1000.0, help="the store's link, Mbit/s")
    parser.add_argument("--delay-ms", type=float, default=1.0, help="netem delay on it, where the kernel has netem")
    parser.add_argument("--no-link", action="store_true", help="the store on 127.0.0.1, unshaped")
    parser.add_argument("--store-cpus", help="CPUs of the store's own, e.g. 1 (the rest: server and loader)")
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--json", help="write the epochs and the summary here")
    parser.add_argument("--cache-dir", help="the servers' --cache-dir (default: a temporary folder on disk)")
    args = parser.parse_args()
    if not args.no_link and not os.environ.get(INSIDE):
        why = shaped_links.available()
        if why:
            raise SystemExit(f"cannot shape a link here ({why}); run with --no-link")
        os.execvpe(shaped_links.NAMESPACE[0], [*shaped_links.NAMESPACE, sys.executable, *sys.argv],
                   {**os.environ, INSIDE: "1"})
    report = run(args)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
