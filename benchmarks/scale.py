"""Data at real scale: images/s and CPU per image by shard count, the plan at a billion samples,
server start-up by shard count (issue 38).

    python benchmarks/scale.py [--only shards,tiny,plan,startup] [--json PATH] [--plot PNG]
                               [--profile DIR]

Sections (all by default, about 10-15 minutes on 2 cores once the data is cached):

  shards   The same photos (``_common.ensure_dataset``, 5,000 by default) packed by the real
           ``remoteloader pack`` at the ``--shard-size`` that gives 1, 20, 207 and 1,000 tar shards
           (cached, not timed). One local server per packing, all started before timing, one
           RemoteLoader each; epochs alternate between them (A B C D, D C B A, ...) after one
           warm-up epoch each. Per epoch: images/s, training-side CPU per image (this process
           and its children, servers excluded) and server CPU per image (its main process and
           its decode workers). Ratios against 1 shard are medians over rounds.
  tiny     The same with 100,000 tiny JPEGs (32x32, ``tools/textures.make_image``) packed as 1
           and 20,000 shards, 32x32 output.
  plan     In a fresh subprocess each: ``make_plan`` of 1 M, 100 M and 1 B samples (rank 0 of
           8) and its first batch: time, tracemalloc peak and the process's peak RSS growth. Also
           a RemoteLoader on a ``--synthetic N`` server: construction to first
           batch, and the training process's peak RSS growth (the server's RSS beside it).
  startup  Servers on 1, 1,000 and 20,000 tiny tars: launch to the ``listening on`` line, the
           server's RSS (main process; its workers beside it) and the lines it logged by then;
           first on a fresh copy of the tars without their indexes (the server indexes them and
           keeps the indexes beside them), then again on the same copy (kept indexes).

``--profile DIR`` (shards section) runs py-spy (``pip install py-spy``) on this process and on
each server's main process over one more epoch at ``--profile-shards`` (1 and 207 by default)
and writes flame graphs (SVG), collapsed stacks and a per-function table (ms per image).
See benchmarks/README.md ("scale.py").
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import pathlib
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _common  # noqa: E402
import numpy as np  # noqa: E402

SECTIONS = ("shards", "tiny", "plan", "startup")
CACHE = _common.DEFAULT_DATA.parent  # ~/.cache/remoteloader-bench
PACK_VERSION = 1  # of the cached packings made here
TINY_VERSION = 1
MB = 1 << 20
# What the server logs of its start (server/formats, server/app.py): indexing, then all of it.
INDEXED = re.compile(r"indexed [\d,]+ shards?, [\d,]+ samples, in ([\d.]+)s")
STARTED = re.compile(r"indexed and started in ([\d.]+)s")


# ---- processes ------------------------------------------------------------------------------

def _status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM... of a process, in bytes (empty when it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Vm"):
                    key, value = line.split(":", 1)
                    parts = value.split()
                    out[key] = int(parts[0]) * 1024 if parts else 0
    except OSError:
        pass
    return out


def rss(pid: int) -> int:
    return _status(pid).get("VmRSS", 0)


def descendants(pid: int, table: dict[int, tuple[int, float]]) -> list[int]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for child, (parent, _) in table.items():
        children[parent].append(child)
    out, stack = [], list(children.get(pid, ()))
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(children.get(p, ()))
    return out


def cpu_reading(me: int, servers: list[int]) -> dict:
    """CPU seconds so far: this process and its descendants that are no server's (the training
    side: the loader's threads, a receiver process if any); each server's main process and its
    descendants (forkserver, decode workers)."""
    from remoteloader.client import cpu

    table = cpu.processes()
    skip: set[int] = set()
    out = {"servers": {}}
    for pid in servers:
        below = descendants(pid, table)
        skip.update([pid, *below])
        out["servers"][pid] = {"main": table.get(pid, (0, 0.0))[1],
                               "workers": sum(table[p][1] for p in below if p in table)}
    out["training"] = table.get(me, (0, 0.0))[1] + sum(table[p][1] for p in descendants(me, table)
                                                       if p not in skip and p in table)
    return out


def server_rss(pid: int) -> tuple[int, int]:
    """RSS of a server's main process and the sum over its descendants (bytes)."""
    from remoteloader.client import cpu

    return rss(pid), sum(rss(p) for p in descendants(pid, cpu.processes()))


# ---- data -----------------------------------------------------------------------------------

def _tiny_one(job: tuple[str, int, int, int, int]) -> int:
    from remoteloader.tools.textures import encode_jpeg, make_image

    root, label, count, size, classes = job
    rng = np.random.default_rng([TINY_VERSION, label])
    folder = pathlib.Path(root) / f"class_{label:02d}"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        h, w = (int(size * (1 + rng.uniform(-0.2, 0.2))) for _ in range(2))
        (folder / f"tiny_{i:06d}.jpg").write_bytes(encode_jpeg(make_image(label, classes, rng, h, w), 90))
    return count


def ensure_tiny(root: pathlib.Path, count: int, size: int, processes: int) -> pathlib.Path:
    """An ImageFolder of ``count`` small stripe-texture JPEGs (10 classes, sides ``size`` +-20%), cached."""
    wanted = {"tiny": TINY_VERSION, "count": count, "size": size, "complete": True}
    marker = root / _common.MANIFEST
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return root
    if root.exists():
        if not marker.exists():
            raise SystemExit(f"{root} exists and was not made by this benchmark (no {_common.MANIFEST}); move it away")
        shutil.rmtree(root)
    print(f"generating {count} tiny JPEGs in {root} ...", file=sys.stderr, flush=True)
    tmp = root.with_name(f".{root.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    classes = 10
    jobs = [(str(tmp), c, count // classes + (c < count % classes), size, classes) for c in range(classes)]
    import multiprocessing as mp

    with mp.get_context("fork").Pool(max(1, processes)) as pool:
        pool.map(_tiny_one, jobs)
    (tmp / _common.MANIFEST).write_text(json.dumps(wanted))
    os.replace(tmp, root)
    return root


def _pack(src: pathlib.Path, dst: pathlib.Path, shard_size: int, workers: int, source: dict) -> pathlib.Path:
    """``remoteloader pack SRC DST --shard-size S`` into a cached folder (re-made when its source changed)."""
    made_from = {**source, "shard_size": shard_size, "scale_pack": PACK_VERSION}
    return _common.pack_cached(src, dst, made_from, workers, "--shard-size", str(shard_size))


def tars(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(folder.glob("*.tar"))


def _sample_weights(tar: pathlib.Path) -> list[int]:
    """What ``pack`` counts against --shard-size for each sample of a one-shard pack, in order:
    its image + 1024 and each other member + 512 (tools/pack.py, _write_shards)."""
    weights: list[int] = []
    with tarfile.open(tar) as t:
        for m in t:
            if m.name.endswith(".cls"):  # written after its image
                weights[-1] += m.size + 512
            else:
                weights.append(m.size + 1024)
    return weights


def _count(weights: np.ndarray, shard_size: int) -> int:
    shards, written = 0, shard_size
    for w in weights.tolist():
        if written >= shard_size:
            shards, written = shards + 1, 0
        written += w
    return shards


def shard_size_for(weights: list[int], count: int) -> int:
    """The --shard-size that makes ``pack`` write ``count`` shards of these samples (or the nearest count)."""
    w = np.asarray(weights)
    lo, hi = 1, int(w.sum()) + 1  # count(lo) >= count >= count(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _count(w, mid) > count:
            lo = mid
        else:
            hi = mid
    return hi


def ensure_packs(src: pathlib.Path, name: str, counts: list[int], workers: int) -> dict[int, pathlib.Path]:
    """Packings of ``src`` with 1 shard and with each of ``counts`` (the shard size that gives it,
    found from the one-shard packing's sample sizes), cached under CACHE as ``<name>-<N>shards``."""
    source = json.loads((src / _common.MANIFEST).read_text())
    from remoteloader.server.packing import can_transcode

    source = {**source, "src": str(src), "rewritten": can_transcode()}
    one = _pack(src, CACHE / f"{name}-1shards", 1 << 40, workers, source)
    out = {1: one}
    weights = None
    for count in counts:
        if count == 1:
            continue
        if weights is None:
            weights = _sample_weights(tars(one)[0])
        size = shard_size_for(weights, count)
        out[count] = _pack(src, CACHE / f"{name}-{count}shards", size, workers, source)
        got = len(tars(out[count]))
        if got != count:
            print(f"  note: --shard-size {size} gave {got} shards (asked {count})", file=sys.stderr)
    return out


# ---- epochs ---------------------------------------------------------------------------------

def start_server(data: pathlib.Path | list, workers: int, log_dir: pathlib.Path, name: str, extra=()):
    from remoteloader.tools.local import LocalServer

    server = LocalServer(data, args=["--workers", str(workers), "--grace", "2", "--log-level", "INFO", *extra],
                         env={"NO_ALBUMENTATIONS_UPDATE": "1"}, log_path=log_dir / f"{name}.log")
    t0 = time.perf_counter()
    server.start(timeout=600)
    ready = time.perf_counter() - t0
    main, workers_rss = server_rss(server.process.pid)
    log = server.process.stderr()
    indexed = INDEXED.search(log)
    started = STARTED.search(log)
    return server, {"ready_s": ready, "rss_main_mb": main / MB, "rss_workers_mb": workers_rss / MB,
                    "log_lines": len(log.splitlines()), "index_s": float(indexed.group(1)) if indexed else float("nan"),
                    "server_says_started_s": float(started.group(1)) if started else None}


def run_epoch(loader, epoch: int, me: int, servers: list[int], server: int, expect: int) -> dict:
    loader.set_epoch(epoch)
    c0 = cpu_reading(me, servers)
    t0 = time.perf_counter()
    first = None
    images = 0
    for batch, _labels in loader:
        if first is None:
            first = time.perf_counter() - t0
        images += batch.shape[0]
    wall = time.perf_counter() - t0
    c1 = cpu_reading(me, servers)
    if images != expect:
        raise RuntimeError(f"epoch {epoch} delivered {images} images, expected {expect}")
    s0, s1 = c0["servers"][server], c1["servers"][server]
    training = c1["training"] - c0["training"]
    main, workers = s1["main"] - s0["main"], s1["workers"] - s0["workers"]
    return {"epoch": epoch, "images": images, "wall_s": wall, "images_per_s": images / wall, "first_batch_s": first,
            "training_cpu_ms": 1000 * training / images, "server_main_cpu_ms": 1000 * main / images,
            "server_workers_cpu_ms": 1000 * workers / images, "server_cpu_ms": 1000 * (main + workers) / images}


@contextlib.contextmanager
def profiling(pid: int, out: pathlib.Path, rate: int = 100, native: bool = False):
    """py-spy record of ``pid`` while the block runs: collapsed stacks (``out``.txt) and an SVG;
    ``native``: with C frames (py-spy then pauses the process for each sample)."""
    procs = []
    mode = ["--native"] if native else ["--nonblocking"]
    for fmt, suffix in (("raw", ".txt"), ("flamegraph", ".svg")):
        procs.append(subprocess.Popen(["py-spy", "record", "--pid", str(pid), *mode, "--nolineno",
                                       "--rate", str(rate), "--format", fmt, "-o", str(out) + suffix],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    time.sleep(1.0)  # attached
    try:
        yield
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def function_table(raw: pathlib.Path, images: int, rate: int = 100) -> dict[str, dict[str, float]]:
    """ms per image by function from py-spy's collapsed stacks: self (the leaf) and total (anywhere in the stack)."""
    own: collections.Counter = collections.Counter()
    total: collections.Counter = collections.Counter()
    samples = 0
    if not raw.exists():
        return {}
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        count = int(n)
        frames = [f for f in stack.split(";")[1:]]  # the first is the process or thread
        if not frames:
            continue
        samples += count
        own[frames[-1]] += count
        for f in set(frames):
            total[f] += count
    ms = 1000 / rate / images
    return {"samples": samples, "ms_per_image": samples * ms,
            "self": {f: c * ms for f, c in own.most_common(400)},
            "total": {f: c * ms for f, c in total.most_common(400)}}


def growth(a: dict, b: dict, top: int = 15) -> list[tuple[str, float, float, float, float]]:
    """Functions whose ms/img grew most from profile ``a`` to ``b``: (function, self a, total a, self b, total b)."""
    if not a or not b:
        return []
    names = set(a["total"]) | set(b["total"])
    rows = [(f, a["self"].get(f, 0.0), a["total"].get(f, 0.0), b["self"].get(f, 0.0), b["total"].get(f, 0.0))
            for f in names]
    # By the growth of the time spent in the function itself, then of the time below it.
    rows.sort(key=lambda r: (-(r[3] - r[1]), -(r[4] - r[2])))
    return rows[:top]


def shard_rounds(title: str, packs: dict[int, pathlib.Path], args, image_size: int, log_dir: pathlib.Path,
                 profile: set[int] | None = None) -> dict:
    """Servers on every packing, a RemoteLoader each, epochs alternating between them."""
    from remoteloader.client.loader import RemoteLoader

    me = os.getpid()
    counts = sorted(packs)
    servers, loaders, start, records, setup = {}, {}, {}, collections.defaultdict(list), {}
    try:
        for k in counts:
            servers[k], start[k] = start_server(packs[k], args.workers, log_dir, f"{title}-{k}")
            print(f"{title}: server on {len(tars(packs[k]))} shards ready in {start[k]['ready_s']:.2f}s, "
                  f"RSS {start[k]['rss_main_mb']:.0f} MB (+ workers {start[k]['rss_workers_mb']:.0f} MB)", flush=True)
        pids = [servers[k].process.pid for k in counts]
        for k in counts:
            t0 = time.perf_counter()
            before = rss(me)
            loaders[k] = RemoteLoader(servers[k].address, batch_size=args.batch_size, image_size=image_size,
                                      pipeline="train", shuffle=True, seed=0, drop_last=True, reconnect_timeout=5.0,
                                      shared_memory=args.transport == "same-host")
            setup[k] = {"construct_s": time.perf_counter() - t0, "rss_growth_mb": (rss(me) - before) / MB,
                        "samples": loaders[k].num_samples, "shards": len(tars(packs[k]))}
        n = loaders[counts[0]].num_samples
        expect = n // args.batch_size * args.batch_size
        for k in counts:
            for epoch in range(args.warmup):
                r = run_epoch(loaders[k], epoch, me, pids, servers[k].process.pid, expect)
                print(f"{title}: warm-up {k:>6} shards: {r['images_per_s']:7.0f} img/s", flush=True)
        for rnd in range(args.epochs):
            order = counts if rnd % 2 == 0 else counts[::-1]
            for k in order:
                r = run_epoch(loaders[k], args.warmup + rnd, me, pids, servers[k].process.pid, expect)
                r["round"] = rnd
                records[k].append(r)
                print(f"{title}: round {rnd + 1}/{args.epochs} {k:>6} shards: {r['images_per_s']:7.0f} img/s  "
                      f"training CPU {r['training_cpu_ms']:.3f} ms/img  server CPU {r['server_cpu_ms']:.2f} ms/img "
                      f"(main {r['server_main_cpu_ms']:.2f})  load {os.getloadavg()[0]:.1f}", flush=True)
        profiles = {}
        for k in sorted(profile or ()):
            if k not in loaders:
                continue
            base = args.profile / f"{title}-{k}shards"
            args.profile.mkdir(parents=True, exist_ok=True)
            with profiling(me, pathlib.Path(str(base) + "-training"), native=args.profile_native), \
                    profiling(servers[k].process.pid, pathlib.Path(str(base) + "-server"), native=args.profile_native):
                r = run_epoch(loaders[k], args.warmup + args.epochs, me, pids, servers[k].process.pid, expect)
            profiles[k] = {"epoch": r,
                           "training": function_table(pathlib.Path(str(base) + "-training.txt"), r["images"]),
                           "server": function_table(pathlib.Path(str(base) + "-server.txt"), r["images"])}
            print(f"{title}: profiled {k} shards ({r['images_per_s']:.0f} img/s under py-spy): {base}-*.svg",
                  flush=True)
        for k in counts:
            main, workers = server_rss(servers[k].process.pid)
            start[k]["rss_main_after_mb"], start[k]["rss_workers_after_mb"] = main / MB, workers / MB
            if servers[k].process.poll() is not None:
                raise RuntimeError(f"the server on {k} shards exited:\n{servers[k].log_tail()}")
    finally:
        for loader in loaders.values():
            loader.close()
        for server in servers.values():
            server.stop()
    summary = {}
    base = records[counts[0]]
    for k in counts:
        rs = records[k]
        med = {key: statistics.median(r[key] for r in rs) for key in
               ("images_per_s", "training_cpu_ms", "server_cpu_ms", "server_main_cpu_ms", "server_workers_cpu_ms",
                "first_batch_s")}
        # Ratios per round (same round, neighbouring epochs), then the median.
        med["ratio_images_per_s"] = statistics.median(a["images_per_s"] / b["images_per_s"] for a, b in zip(rs, base))
        med["ratio_training_cpu"] = statistics.median(a["training_cpu_ms"] / b["training_cpu_ms"]
                                                      for a, b in zip(rs, base))
        med["ratio_server_cpu"] = statistics.median(a["server_cpu_ms"] / b["server_cpu_ms"] for a, b in zip(rs, base))
        summary[k] = {**med, "shards": len(tars(packs[k])), "min_images_per_s": min(r["images_per_s"] for r in rs),
                      "max_images_per_s": max(r["images_per_s"] for r in rs), "start": start[k], "loader": setup[k]}
    return {"images": n, "image_size": image_size, "epochs": {k: v for k, v in records.items()}, "summary": summary,
            "profiles": profiles}


# ---- plan -------------------------------------------------------------------------------------

def plan_child(n: int, batch_size: int, world_size: int) -> dict:
    """In a fresh process: make_plan + its first and last batch; time and memory."""
    import tracemalloc

    from remoteloader.client.plan import make_plan

    base = rss(os.getpid())
    tracemalloc.start()
    t0 = time.perf_counter()
    plan = make_plan(n, batch_size, shuffle=True, seed=0, epoch=0, rank=0, world_size=world_size)
    first = plan.batches[0]
    t1 = time.perf_counter()
    last = plan.batches[len(plan.batches) - 1]
    t2 = time.perf_counter()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    warm = []  # later epochs' plans, the same process
    for epoch in range(1, 6):
        t = time.perf_counter()
        make_plan(n, batch_size, shuffle=True, seed=0, epoch=epoch, rank=0, world_size=world_size).batches[0]
        warm.append(time.perf_counter() - t)
    hwm = _status(os.getpid()).get("VmHWM", 0)
    assert len(first) == batch_size and len(last) == batch_size and 0 <= int(first.min()) and int(first.max()) < n
    return {"samples": n, "batches": len(plan.batches), "first_batch_s": t1 - t0, "last_batch_s": t2 - t1,
            "next_epochs_first_batch_s": statistics.median(warm),
            "tracemalloc_peak_mb": peak / MB, "rss_growth_mb": (hwm - base) / MB, "peak_rss_mb": hwm / MB,
            "base_rss_mb": base / MB}


def loader_child(address: str, batch_size: int, image_size: int) -> dict:
    """In a fresh process: a RemoteLoader on a synthetic server, construction to first batch."""
    import torch  # noqa: F401  (imported before the baseline reading: its memory is not the plan's)

    from remoteloader.client.loader import RemoteLoader

    base = rss(os.getpid())
    t0 = time.perf_counter()
    loader = RemoteLoader(address, batch_size=batch_size, image_size=image_size, shuffle=True, seed=0)
    t1 = time.perf_counter()
    it = iter(loader)
    images, _ = next(it)
    t2 = time.perf_counter()
    hwm = _status(os.getpid()).get("VmHWM", 0)
    n = loader.num_samples
    loader.close()
    return {"samples": n, "construct_s": t1 - t0, "first_batch_s": t2 - t0, "rss_growth_mb": (hwm - base) / MB,
            "peak_rss_mb": hwm / MB, "base_rss_mb": base / MB, "batch": list(images.shape)}


def _child(argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plan_section(args, log_dir: pathlib.Path) -> dict:
    plans, loaders = {}, {}
    for n in args.plan_samples:
        plans[n] = _child(["--_plan-child", str(n), "--batch-size", str(args.batch_size),
                           "--plan-world-size", str(args.plan_world_size)])
        p = plans[n]
        print(f"plan: {n:>13,} samples (rank 0 of {args.plan_world_size}): first batch in "
              f"{1000 * p['first_batch_s']:.2f} ms, tracemalloc peak {p['tracemalloc_peak_mb']:.2f} MB, "
              f"peak RSS growth {p['rss_growth_mb']:.1f} MB", flush=True)
    for n in args.loader_samples:
        server, start = start_server([], 1, log_dir, f"synthetic-{n}", ["--synthetic", str(n)])
        try:
            r = _child(["--_loader-child", server.address, "--batch-size", str(args.batch_size)])
            r["server_start"] = start
            r["server_rss_mb"] = rss(server.process.pid) / MB
        finally:
            server.stop()
        loaders[n] = r
        print(f"plan: RemoteLoader on a --synthetic {n:,} server: first batch {r['first_batch_s']:.2f}s after "
              f"RemoteLoader() ({r['construct_s']:.2f}s constructing), training RSS growth {r['rss_growth_mb']:.0f} "
              f"MB; server started in {start['ready_s']:.1f}s, RSS {r['server_rss_mb']:.0f} MB", flush=True)
    return {"world_size": args.plan_world_size, "plan": plans, "loader": loaders}


# ---- start-up -------------------------------------------------------------------------------

def startup_section(packs: dict[int, pathlib.Path], args, log_dir: pathlib.Path) -> dict:
    """Each round: a fresh hard-linked copy of each packing's tars without their indexes (the
    server indexes and keeps them), then a second start on that copy (kept indexes)."""
    records = collections.defaultdict(list)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=".scale-startup-", dir=CACHE))
    try:
        for rnd in range(args.startup_rounds):
            order = sorted(packs) if rnd % 2 == 0 else sorted(packs, reverse=True)
            for k in order:
                copy = scratch / f"{k}-{rnd}"
                copy.mkdir()
                for t in tars(packs[k]):
                    os.link(t, copy / t.name)
                shutil.copy(packs[k] / "classes.txt", copy / "classes.txt")
                for kind in ("fresh", "kept"):
                    server, r = start_server(copy, args.workers, log_dir, f"startup-{k}-{rnd}-{kind}")
                    server.stop()
                    r.update(shards=k, kind=kind, round=rnd,
                             indexes=len(list(copy.glob("*.index.npz"))))
                    records[(k, kind)].append(r)
                    print(f"startup: {k:>6} tars, {kind:>5} indexes: ready in {r['ready_s']:6.2f}s, RSS "
                          f"{r['rss_main_mb']:.0f} MB (+ workers {r['rss_workers_mb']:.0f}), {r['log_lines']} log "
                          f"lines", flush=True)
                shutil.rmtree(copy)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {}
    for (k, kind), rs in records.items():
        summary[f"{k}/{kind}"] = {"shards": k, "kind": kind, **{key: statistics.median(r[key] for r in rs) for key in
                                  ("ready_s", "rss_main_mb", "rss_workers_mb", "log_lines", "index_s")}}
    return {"records": [r for rs in records.values() for r in rs], "summary": summary}


# ---- report ---------------------------------------------------------------------------------

def shard_table(section: dict) -> str:
    lines = ["| shards | img/s (median) | x 1 shard | training CPU ms/img | x 1 shard | server CPU ms/img "
             "(main + workers) | x 1 shard | server ready s | server RSS MB | RemoteLoader() s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for _, s in sorted(section["summary"].items()):
        lines.append(f"| {s['shards']:,} | {s['images_per_s']:.0f} | {s['ratio_images_per_s']:.3f} | "
                     f"{s['training_cpu_ms']:.3f} | {s['ratio_training_cpu']:.3f} | {s['server_cpu_ms']:.2f} "
                     f"({s['server_main_cpu_ms']:.2f} + {s['server_workers_cpu_ms']:.2f}) | "
                     f"{s['ratio_server_cpu']:.3f} | {s['start']['ready_s']:.2f} | "
                     f"{s['start']['rss_main_mb']:.0f} | {s['loader']['construct_s']:.2f} |")
    return "\n".join(lines)


def verdicts(results: dict) -> list[tuple[str, str, bool | None]]:
    out = []
    sh = results.get("shards", {}).get("summary", {})
    k = max((k for k in sh if k > 1), default=None, key=lambda k: (k == 207, k <= 207, k))
    if k is not None:
        s = sh[k]
        out.append((f"{s['shards']} shards: img/s >= 0.95x one shard's", f"{s['ratio_images_per_s']:.3f}x",
                    s["ratio_images_per_s"] >= 0.95))
        out.append((f"{s['shards']} shards: training CPU/img within 10% of one shard's",
                    f"{s['ratio_training_cpu']:.3f}x", s["ratio_training_cpu"] <= 1.10))
    ti = results.get("tiny", {}).get("summary", {})
    if ti and max(ti) > 1:
        s = ti[max(ti)]
        out.append((f"{s['shards']:,} tiny shards: img/s within 10% of one shard's", f"{s['ratio_images_per_s']:.3f}x",
                    s["ratio_images_per_s"] >= 0.90))
    plans = results.get("plan", {}).get("plan", {})
    if plans:
        n = max(plans)
        p = plans[n]
        mem = max(p["rss_growth_mb"], p["tracemalloc_peak_mb"])
        out.append((f"{n:,}-sample plan: < 64 MB per rank", f"{mem:.2f} MB", mem < 64))
        out.append((f"{n:,}-sample plan: first batch < 1 s", f"{1000 * p['first_batch_s']:.2f} ms",
                    p["first_batch_s"] < 1))
    st = results.get("startup", {}).get("summary", {})
    kept = [s for s in st.values() if s["kind"] == "kept"]
    if kept:
        s = max(kept, key=lambda s: s["shards"])
        one = min(kept, key=lambda s: s["shards"])
        out.append((f"{s['shards']:,}-tar server, kept indexes: ready < 10 s",
                    f"{s['ready_s']:.2f} s from launch (indexing {s['index_s']:.2f} s of it, as the server logs; "
                    f"{one['shards']:,} tar: {one['ready_s']:.2f} s, indexing {one['index_s']:.2f} s)",
                    s["ready_s"] < 10))
        out.append((f"{s['shards']:,}-tar server: a few log lines", f"{s['log_lines']:.0f} lines",
                    s["log_lines"] <= 10))
    return out


def report(results: dict) -> None:
    for name in ("shards", "tiny"):
        if name in results:
            sec = results[name]
            print(f"\n## {name}: {sec['images']:,} images, {sec['image_size']}x{sec['image_size']} output "
                  f"(median of {results['config']['epochs']} rounds; ratios per round against 1 shard)\n")
            print(shard_table(sec))
    if "plan" in results:
        sec = results["plan"]
        print(f"\n## plan (rank 0 of {sec['world_size']}, batch {results['config']['batch_size']}), each in a fresh "
              f"process\n")
        print("| samples | first batch ms (first plan of the process) | next epochs' first batch ms | last batch ms "
              "| tracemalloc peak MB | peak RSS growth MB |")
        print("|---:|---:|---:|---:|---:|---:|")
        for n, p in sorted(sec["plan"].items()):
            print(f"| {n:,} | {1000 * p['first_batch_s']:.2f} | {1000 * p['next_epochs_first_batch_s']:.2f} | "
                  f"{1000 * p['last_batch_s']:.2f} | "
                  f"{p['tracemalloc_peak_mb']:.3f} | {p['rss_growth_mb']:.1f} |")
        if sec["loader"]:
            print("\n| samples (--synthetic server) | RemoteLoader() s | first batch s (from RemoteLoader()) | "
                  "training peak RSS growth MB | server RSS MB | server ready s |")
            print("|---:|---:|---:|---:|---:|---:|")
            for n, p in sorted(sec["loader"].items()):
                print(f"| {n:,} | {p['construct_s']:.2f} | {p['first_batch_s']:.2f} | {p['rss_growth_mb']:.0f} | "
                      f"{p['server_rss_mb']:.0f} | {p['server_start']['ready_s']:.2f} |")
    if "startup" in results:
        print(f"\n## start-up (median of {results['config']['startup_rounds']} rounds)\n")
        print("| tars | indexes | launch to ready s | of which indexing s (server log) | server RSS MB (main) | "
              "workers RSS MB | log lines |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        for s in sorted(results["startup"]["summary"].values(), key=lambda s: (s["shards"], s["kind"] != "fresh")):
            print(f"| {s['shards']:,} | {s['kind']} | {s['ready_s']:.2f} | {s['index_s']:.2f} | "
                  f"{s['rss_main_mb']:.0f} | {s['rss_workers_mb']:.0f} | {s['log_lines']:.0f} |")
    for name in ("shards", "tiny"):
        profiles = results.get(name, {}).get("profiles", {})
        for k, prof in profiles.items():
            for side in ("training", "server"):
                t = prof[side]
                if not t:
                    continue
                print(f"\n### py-spy, {name}, {k} shards, {side} ({t['ms_per_image']:.3f} ms/img sampled): "
                      f"most samples of their own, ms/img (self / total)\n")
                for f, ms in list(t["self"].items())[:12]:
                    print(f"    {ms:7.4f} {t['total'].get(f, 0.0):7.4f}  {f}")
        if len(profiles) >= 2:
            a, b = (profiles[k] for k in sorted(profiles)[:1] + sorted(profiles)[-1:])
            ka, kb = sorted(profiles)[0], sorted(profiles)[-1]
            for side in ("training", "server"):
                rows = growth(a[side], b[side])
                if not rows:
                    continue
                print(f"\n### py-spy, {name}, {side}: what grows from {ka} to {kb} shards "
                      f"({a[side]['ms_per_image']:.3f} -> {b[side]['ms_per_image']:.3f} ms/img sampled); "
                      f"ms/img self/total\n")
                for f, sa, ta, sb, tb in rows:
                    print(f"    {sa:.4f}/{ta:.4f} -> {sb:.4f}/{tb:.4f}  {f}")
    print("\n## targets\n")
    for what, value, ok in results["verdicts"]:
        print(f"* {what}: {value} -> {'met' if ok else 'NOT met'}")


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), dpi=80)
    ax = axes[0]
    for name, marker in (("shards", "o"), ("tiny", "s")):
        sec = results.get(name)
        if not sec:
            continue
        ks = sorted(sec["summary"])
        x = [sec["summary"][k]["shards"] for k in ks]
        ax.plot(x, [sec["summary"][k]["ratio_images_per_s"] for k in ks], marker=marker, label=f"{name}: img/s")
        ax.plot(x, [sec["summary"][k]["ratio_training_cpu"] for k in ks], marker=marker, linestyle="--",
                label=f"{name}: training CPU/img")
    ax.axhline(0.95, color="grey", linewidth=0.8, linestyle=":")
    ax.axhline(1.10, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    ax.set_xlabel("shards")
    ax.set_ylabel("x one shard")
    ax.set_title("Throughput and training CPU by shard count")
    ax.legend(fontsize=7)
    ax = axes[1]
    plans = results.get("plan", {}).get("plan", {})
    if plans:
        ns = sorted(plans)
        ax.plot(ns, [1000 * plans[n]["first_batch_s"] for n in ns], marker="o", label="first batch, ms")
        ax.plot(ns, [plans[n]["rss_growth_mb"] for n in ns], marker="s", label="peak RSS growth, MB")
        ax.plot(ns, [plans[n]["tracemalloc_peak_mb"] for n in ns], marker="^", label="tracemalloc peak, MB")
        ax.set_xscale("log")
        ax.set_xlabel("samples")
        ax.set_title("Plan of one rank (of 8)")
        ax.legend(fontsize=7)
    ax = axes[2]
    st = results.get("startup", {}).get("summary", {})
    if st:
        for kind, marker in (("fresh", "o"), ("kept", "s")):
            rows = sorted((s for s in st.values() if s["kind"] == kind), key=lambda s: s["shards"])
            ax.plot([s["shards"] for s in rows], [s["ready_s"] for s in rows], marker=marker,
                    label=f"ready s, {kind} indexes")
        rows = sorted((s for s in st.values() if s["kind"] == "kept"), key=lambda s: s["shards"])
        ax2 = ax.twinx()
        ax2.plot([s["shards"] for s in rows], [s["rss_main_mb"] for s in rows], color="grey", linestyle="--",
                 marker="^", label="server RSS MB (kept)")
        ax2.set_ylabel("MB")
        ax2.legend(fontsize=7, loc="lower right")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tiny tars")
        ax.set_ylabel("s")
        ax.set_title("Server start-up")
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    print(f"wrote {path}")


def _int_keys(results: dict) -> dict:
    """A --json document as the run held it: shard and sample counts as int keys again."""
    for name in ("shards", "tiny"):
        for part in ("summary", "epochs", "profiles"):
            if name in results:
                results[name][part] = {int(k): v for k, v in results[name][part].items()}
    if "plan" in results:
        for part in ("plan", "loader"):
            results["plan"][part] = {int(k): v for k, v in results["plan"][part].items()}
    return results


def _ints(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    cores = _common.default_cores()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run (default {','.join(SECTIONS)})")
    p.add_argument("--images", type=int, default=5000, help="photos (default 5000)")
    p.add_argument("--data", type=pathlib.Path, default=CACHE / "scale-photos",
                   help="cached photo ImageFolder (default ~/.cache/remoteloader-bench/scale-photos)")
    p.add_argument("--shards", type=_ints, default=[1, 20, 207, 1000],
                   help="photo shard counts (default 1,20,207,1000)")
    p.add_argument("--tiny-images", type=int, default=100_000, help="tiny images (default 100000)")
    p.add_argument("--tiny-size", type=int, default=32, help="tiny images' side and output side (default 32)")
    p.add_argument("--tiny-shards", type=_ints, default=[1, 20000], help="tiny shard counts (default 1,20000)")
    p.add_argument("--epochs", type=int, default=3, help="timed rounds (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up epochs per configuration (default 1)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--workers", type=int, default=cores, help=f"server --workers (default {cores})")
    p.add_argument("--transport", choices=("same-host", "grpc"), default="same-host",
                   help="how batches reach this process: the same-host path (default for a local server) or "
                        "gRPC (RemoteLoader(shared_memory=False), as from another machine)")
    p.add_argument("--plan-samples", type=_ints, default=[10**6, 10**8, 10**9])
    p.add_argument("--plan-world-size", type=int, default=8)
    p.add_argument("--loader-samples", type=_ints, default=[10**6, 10**8, 10**9],
                   help="--synthetic servers a RemoteLoader reads its first batch from (default 1e6,1e8,1e9; "
                        "the server holds about a byte a sample)")
    p.add_argument("--startup-shards", type=_ints, default=[1, 1000, 20000], help="tiny tars (default 1,1000,20000)")
    p.add_argument("--startup-rounds", type=int, default=2)
    p.add_argument("--profile", type=pathlib.Path, help="py-spy flame graphs and tables into this folder")
    p.add_argument("--profile-shards", type=_ints, default=[1, 207])
    p.add_argument("--profile-native", action="store_true", help="py-spy --native (pauses the processes sampled)")
    p.add_argument("--json", type=pathlib.Path)
    p.add_argument("--plot", type=pathlib.Path, help="write the chart (PNG, matplotlib)")
    p.add_argument("--from-json", type=pathlib.Path, help="print the tables (and --plot) of a saved --json run; "
                                                            "run nothing")
    p.add_argument("--_plan-child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_loader-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in args.only if s not in SECTIONS]
    if bad:
        p.error(f"--only: unknown {bad}; choose from {', '.join(SECTIONS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._plan_child:
        print(json.dumps(plan_child(args._plan_child, args.batch_size, args.plan_world_size)))
        return 0
    if args._loader_child:
        print(json.dumps(loader_child(args._loader_child, args.batch_size, 64)))
        return 0
    if args.from_json:
        results = _int_keys(json.loads(args.from_json.read_text()))
        results["verdicts"] = verdicts(results)
        report(results)
        if args.plot:
            plot(results, args.plot)
        return 0
    cores = _common.default_cores()
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(128 + s))
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="remoteloader-scale-"))
    load = os.getloadavg()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=pathlib.Path(__file__).parent).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=pathlib.Path(__file__).parent).stdout.split("\n")
    results: dict = {"config": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()},
                     "host": {"cores": cores, "cpu_count": os.cpu_count(), "python": platform.python_version(),
                              "platform": platform.platform(), "load_average_start": load,
                              "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": head,
                              "uncommitted": [d.strip() for d in dirty if d.strip()]}}
    print("# remoteloader scale benchmark\n")
    print(f"host: {cores} usable cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; commit {head}"
          + (f" + uncommitted {', '.join(results['host']['uncommitted'])}" if results["host"]["uncommitted"] else ""))
    if load[0] > 0.5 * cores:
        print(f"warning: load average {load[0]:.1f} on {cores} cores: other processes compete; read the ratios "
              f"(measured side by side) rather than the absolute figures")
    sys.stdout.flush()
    profile = set(args.profile_shards) if args.profile else None
    try:
        if "shards" in args.only:
            root = _common.ensure_dataset(args.data, args.images, processes=cores)
            packs = ensure_packs(root, "scale-photos", args.shards, cores)
            results["shards"] = shard_rounds("shards", packs, args, args.image_size, log_dir, profile)
        tiny_packs = {}
        if "tiny" in args.only or "startup" in args.only:
            tiny = ensure_tiny(CACHE / f"scale-tiny-{args.tiny_images}", args.tiny_images, args.tiny_size, cores)
            wanted = sorted(set(args.tiny_shards) | (set(args.startup_shards) if "startup" in args.only else set()))
            tiny_packs = ensure_packs(tiny, f"scale-tiny-{args.tiny_images}", wanted, cores)
        if "tiny" in args.only:
            packs = {k: tiny_packs[k] for k in args.tiny_shards}
            results["tiny"] = shard_rounds("tiny", packs, args, args.tiny_size, log_dir, profile)
        if "plan" in args.only:
            results["plan"] = plan_section(args, log_dir)
        if "startup" in args.only:
            results["startup"] = startup_section({k: tiny_packs[k] for k in args.startup_shards}, args, log_dir)
    except KeyboardInterrupt:
        print(f"\ninterrupted; server logs in {log_dir}", file=sys.stderr)
        return 130
    results["host"]["load_average_end"] = os.getloadavg()
    results["verdicts"] = verdicts(results)
    report(results)
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in results['host']['load_average_end'])}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=str))
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot)
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
