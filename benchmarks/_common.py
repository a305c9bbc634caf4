"""Helpers for the benchmarks: an ImageNet-like JPEG ImageFolder and process CPU accounting.

Nothing here downloads anything. The dataset is generated: photo-like RGB images (a colour
gradient, 1/f-ish structure at several scales, busy and calm regions of fine texture,
shapes with sharp and defocused edges, small clutter, mild sensor noise), encoded by
OpenCV at quality 90, so that JPEG file sizes and decode costs resemble ImageNet photos
(~100-150 KB for 500x375) rather than flat synthetic images (a few KB) or pure noise.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import cv2
import numpy as np

from remoteloader.client import cpu

GENERATOR_VERSION = 1
MANIFEST = ".remoteloader-bench.json"
NUM_CLASSES = 10
DEFAULT_DATA = pathlib.Path.home() / ".cache" / "remoteloader-bench" / "imagenet-like"
_NAME = re.compile(r"^img_(\d{6})\.jpg$")


# ---- the dataset ---------------------------------------------------------------------------

def _field(rng: np.random.Generator, h: int, w: int, cell: int, channels: int = 1) -> np.ndarray:
    """Smooth random field with features about ``cell`` pixels wide (bicubic-upsampled noise)."""
    gh, gw = h // cell + 3, w // cell + 3
    small = rng.standard_normal((gh, gw, channels)).astype(np.float32)
    big = cv2.resize(small, (gw * cell, gh * cell), interpolation=cv2.INTER_CUBIC)
    if big.ndim == 2:
        big = big[..., None]
    oy, ox = (int(v) for v in rng.integers(0, cell, 2))
    return big[oy:oy + h, ox:ox + w]


def make_photo(rng: np.random.Generator, h: int, w: int, detail: float = 5.0, noise: float = 3.0) -> np.ndarray:
    """A photo-like RGB uint8 image (see the module docstring)."""
    c0, c1 = rng.uniform(30, 225, 3).astype(np.float32), rng.uniform(30, 225, 3).astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    t = (np.linspace(0, 1, w, dtype=np.float32)[None, :] * np.float32(np.cos(angle))
         + np.linspace(0, 1, h, dtype=np.float32)[:, None] * np.float32(np.sin(angle)))
    t = (t - t.min()) / (np.ptp(t) + 1e-6)
    img = c0 + (c1 - c0) * t[..., None]
    # Coarse structure: luminance, plus weaker chroma.
    mix = ((rng.normal(0, 0.25, 3) + 1.0) / 2).astype(np.float32)
    coarse = sum(_field(rng, h, w, c) * a for c, a in ((120, 35), (60, 25), (30, 18)))
    chroma = sum(_field(rng, h, w, c, 3) * a for c, a in ((120, 12), (60, 8)))
    img = img + coarse * mix + chroma
    # Fine texture, strong where a smooth "busy" mask says so (foliage, fur) and weak elsewhere (sky).
    busy = np.clip(_field(rng, h, w, 90)[..., 0] * 0.8 + rng.uniform(-0.3, 0.6), 0, 1)[..., None]
    texture = sum(_field(rng, h, w, c) * a for c, a in ((12, 10), (6, 10), (3, 12), (2, 10), (1, 8)))
    img = img + texture * (0.25 + busy) * detail
    # Objects: ellipses, polygons and bars, sharp or out of focus, each shaded and textured.
    for _ in range(int(rng.integers(3, 9))):
        layer = np.zeros((h, w), np.uint8)
        kind = int(rng.integers(0, 3))
        cx, cy = int(rng.uniform(0, w)), int(rng.uniform(0, h))
        s = max(2, int(rng.uniform(0.05, 0.35) * min(h, w)))
        if kind == 0:
            axes = (s, max(1, int(s * rng.uniform(0.3, 1.5))))
            cv2.ellipse(layer, (cx, cy), axes, float(rng.uniform(0, 180)), 0, 360, 255, -1, cv2.LINE_AA)
        elif kind == 1:
            pts = (np.array([cx, cy]) + rng.normal(0, s, (int(rng.integers(3, 7)), 2))).astype(np.int32)
            cv2.fillPoly(layer, [pts], 255, cv2.LINE_AA)
        else:
            end = (int(cx + rng.normal(0, 3 * s)), int(cy + rng.normal(0, 3 * s)))
            cv2.line(layer, (cx, cy), end, 255, int(rng.integers(2, 10)), cv2.LINE_AA)
        if rng.random() < 0.4:
            k = int(rng.integers(1, 5)) * 2 + 1
            layer = cv2.GaussianBlur(layer, (k, k), 0)
        alpha = layer.astype(np.float32)[..., None] / 255
        color = rng.uniform(20, 235, 3).astype(np.float32)
        shade = _field(rng, h, w, int(rng.choice([20, 40]))) * 20 + texture * rng.uniform(0.2, 1.2) * detail
        img = img * (1 - alpha) + (color + shade) * alpha
    # Clutter: small sharp strokes and blobs in darker/lighter tones of what is under them.
    over = np.clip(img, 0, 255)
    base = over.copy()
    for _ in range(int(rng.integers(20, 120))):
        cx, cy = int(rng.uniform(0, w)), int(rng.uniform(0, h))
        col = tuple(float(v) for v in np.clip(base[cy, cx] * rng.uniform(0.4, 1.6) + rng.normal(0, 20, 3), 0, 255))
        if rng.random() < 0.5:
            end = (int(cx + rng.normal(0, 25)), int(cy + rng.normal(0, 25)))
            cv2.line(over, (cx, cy), end, col, int(rng.integers(1, 4)), cv2.LINE_AA)
        else:
            r = int(rng.integers(2, 14))
            cv2.ellipse(over, (cx, cy), (r, max(1, int(r * rng.uniform(0.3, 1)))), float(rng.uniform(0, 180)),
                        0, 360, col, -1, cv2.LINE_AA)
    a = np.float32(rng.uniform(0.5, 0.9))
    img = base * (1 - a) + over * a
    img += rng.normal(0, noise, img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def image_spec(seed: int, index: int) -> tuple[int, int, float]:
    """(height, width, detail) of image ``index``: ~500x375-ish, about one in five portrait."""
    rng = np.random.default_rng([seed, index, 1])
    long_side = int(rng.integers(480, 521))
    short_side = int(long_side * rng.choice([2 / 3, 0.75, 0.75, 0.75, 0.8]) * rng.uniform(0.97, 1.03))
    detail = 5.0 * float(rng.lognormal(0.0, 0.2))
    if rng.random() < 0.2:
        return long_side, short_side, detail
    return short_side, long_side, detail


def sample_path(root: pathlib.Path, index: int) -> pathlib.Path:
    return root / f"class_{index % NUM_CLASSES:02d}" / f"img_{index:06d}.jpg"


def _write_one(job: tuple[str, int, int, int]) -> int:
    root, seed, quality, index = job
    h, w, detail = image_spec(seed, index)
    rng = np.random.default_rng([seed, index, 2])
    rgb = make_photo(rng, h, w, detail)
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise RuntimeError("OpenCV failed to encode a JPEG")
    path = sample_path(pathlib.Path(root), index)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(buf.tobytes())
    os.replace(tmp, path)  # never leave a half-written JPEG behind (Ctrl-C)
    return len(buf)


def read_manifest(root: pathlib.Path) -> dict | None:
    """The benchmark manifest of a dataset directory (None: new, empty, or unreadable); a
    non-empty directory without one was not made by a benchmark and is refused (SystemExit)."""
    manifest_path = root / MANIFEST
    manifest = None
    if manifest_path.exists():
        try:
            manifest = json.loads(manifest_path.read_text())
        except ValueError:
            manifest = None
    if manifest is None and root.exists() and any(root.iterdir()):
        raise SystemExit(f"{root} exists and was not made by this benchmark (no {MANIFEST}); "
                         f"pass --data pointing at an empty or new directory")
    return manifest


def ensure_dataset(root: pathlib.Path, count: int, seed: int = 0, quality: int = 90,
                   processes: int = 1) -> pathlib.Path:
    """Creates or updates ``root`` to hold exactly images 0..count-1 (deterministic per index).

    Images are a pure function of (generator version, seed, quality, index), so a cached
    directory is extended or trimmed rather than rebuilt when ``count`` changes. A
    non-empty directory without our manifest is refused, never modified.
    """
    root = pathlib.Path(root).expanduser()
    manifest_path = root / MANIFEST
    wanted = {"generator": GENERATOR_VERSION, "seed": seed, "quality": quality}
    manifest = read_manifest(root)
    root.mkdir(parents=True, exist_ok=True)
    stale = manifest is not None and {k: manifest.get(k) for k in wanted} != wanted
    existing: set[int] = set()
    for d in root.iterdir():
        if not d.is_dir() or not d.name.startswith("class_"):
            continue
        for f in d.iterdir():
            if f.name.startswith(".") and f.name.endswith(".tmp"):
                f.unlink()  # left by an interrupted run
                continue
            m = _NAME.match(f.name)
            if not m:
                continue
            index = int(m.group(1))
            if stale or index >= count or f.parent.name != f"class_{index % NUM_CLASSES:02d}" or f.stat().st_size == 0:
                f.unlink()
            else:
                existing.add(index)
    for c in range(NUM_CLASSES):
        (root / f"class_{c:02d}").mkdir(exist_ok=True)
    manifest_path.write_text(json.dumps({**wanted, "count": count, "complete": False}))
    missing = [i for i in range(count) if i not in existing]
    if missing:
        print(f"generating {len(missing)} JPEGs in {root} ({processes} processes) ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        jobs = [(str(root), seed, quality, i) for i in missing]
        done = 0
        ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        with ctx.Pool(max(1, processes)) as pool:
            for _ in pool.imap_unordered(_write_one, jobs, chunksize=8):
                done += 1
                if done % 250 == 0 or done == len(jobs):
                    print(f"  {done}/{len(jobs)} ({time.perf_counter() - started:.0f}s)", file=sys.stderr, flush=True)
    manifest_path.write_text(json.dumps({**wanted, "count": count, "complete": True}))
    return root


def add_remote_data_argument(parser) -> None:
    parser.add_argument("--remote-data", choices=("packed", "folder"), default="packed",
                        help="what the server reads: tar shards written once by `remoteloader pack` from --data "
                             "(default; JPEGs rewritten losslessly, so it decodes only a crop's blocks), or the "
                             "ImageFolder itself. DataLoaders, where there are any, read the ImageFolder's files")


def served_data(root: pathlib.Path, remote_data: str, workers: int) -> pathlib.Path:
    """What the server reads for --remote-data: the packed shards of ``root``, or ``root``."""
    return ensure_packed(root, workers) if remote_data == "packed" else root


def ensure_packed(root: pathlib.Path, workers: int) -> pathlib.Path:
    """``remoteloader pack`` of the ImageFolder ``root`` (made by ensure_dataset), cached beside
    it as ``<root>-packed`` and re-made when the ImageFolder changed. Packing is not timed."""
    from remoteloader.server.packing import can_transcode

    root = pathlib.Path(root).expanduser()
    # Re-made too once the native module is built: without it, pack copies the files as they are.
    # "pack" 2: its indexes mark the rewritten JPEGs verified (region-decoded from the first epoch).
    source = {**json.loads((root / MANIFEST).read_text()), "rewritten": can_transcode(), "pack": 2}
    return pack_cached(root, root.with_name(root.name + "-packed"), source, workers)


def pack_cached(src: pathlib.Path, dst: pathlib.Path, made_from: dict, workers: int, *pack_args: str) -> pathlib.Path:
    """``remoteloader pack SRC DST [PACK_ARGS]`` into ``dst``, kept while it was ``made_from`` the
    same (a JSON-able description of the source and the arguments) and re-made otherwise; a
    ``dst`` this function did not make is never touched. Packing is not timed."""
    marker = dst / MANIFEST
    if marker.exists() and json.loads(marker.read_text()) == made_from:
        return dst
    if dst.exists():
        if not marker.exists():
            raise SystemExit(f"{dst} exists and was not made by this benchmark (no {MANIFEST}); move it away")
        shutil.rmtree(dst)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"packing {src} into {dst} (remoteloader pack {' '.join(pack_args)}, {workers} processes) ...",
          file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        subprocess.run([sys.executable, "-m", "remoteloader.tools.cli", "pack", str(src), str(tmp), *pack_args,
                        "--workers", str(workers), "--quiet"], check=True)
        (tmp / MANIFEST).write_text(json.dumps(made_from))
        try:
            os.replace(tmp, dst)
        except OSError:  # another run made it meanwhile: keep theirs if it is the same
            if not (marker.exists() and json.loads(marker.read_text()) == made_from):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"  packed in {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)
    return dst


def list_samples(root: pathlib.Path) -> tuple[list[tuple[str, int]], list[str]]:
    """ImageFolder order (sorted classes, sorted files), as the server and torchvision index it."""
    classes = sorted(d.name for d in os.scandir(root) if d.is_dir() and not d.name.startswith("."))
    samples = []
    for label, cls in enumerate(classes):
        for name in sorted(e.name for e in os.scandir(root / cls) if e.is_file() and e.name.lower().endswith(".jpg")):
            samples.append((str(root / cls / name), label))
    return samples, classes


def dataset_stats(samples: list[tuple[str, int]]) -> dict:
    """File sizes (KB) and image dimensions (read from the headers with PIL)."""
    from PIL import Image

    sizes = np.array([os.path.getsize(p) for p, _ in samples], dtype=np.float64) / 1000
    dims = []
    for p, _ in samples:
        with Image.open(p) as im:
            dims.append(im.size)  # (w, h)
    dims = np.array(dims)
    portrait = int((dims[:, 1] > dims[:, 0]).sum())
    return {
        "images": len(samples), "total_mb": float(sizes.sum() / 1000),
        "kb_mean": float(sizes.mean()), "kb_median": float(np.median(sizes)),
        "kb_p5": float(np.percentile(sizes, 5)), "kb_p95": float(np.percentile(sizes, 95)),
        "kb_min": float(sizes.min()), "kb_max": float(sizes.max()),
        "mean_width": float(dims[:, 0].mean()), "mean_height": float(dims[:, 1].mean()),
        "portrait": portrait, "landscape": len(samples) - portrait,
        "bits_per_pixel": float((sizes * 8000).sum() / (dims[:, 0] * dims[:, 1]).sum()),
    }


def default_cores() -> int:
    """The CPUs this process may run on (what the server's --workers defaults to)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# ---- CPU accounting over process trees -------------------------------------------------------

def cpu_split(me: int, server: int | None) -> dict[str, float]:
    """CPU seconds so far of: this process (all its threads), its other descendants
    (DataLoader workers), the server's main process, and the server's descendants
    (forkserver and decode workers). Processes that have exited are not counted.
    """
    table = cpu.processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)

    def below(root: int, skip: int | None) -> float:
        total, stack = 0.0, list(children.get(root, ()))
        while stack:
            pid = stack.pop()
            if pid == skip or pid not in table:
                continue
            total += table[pid][1]
            stack.extend(children.get(pid, ()))
        return total

    out = {"client": table.get(me, (0, 0.0))[1], "client_children": below(me, server),
           "server_main": 0.0, "server_workers": 0.0}
    if server is not None:
        out["server_main"] = table.get(server, (0, 0.0))[1]
        out["server_workers"] = below(server, None)
    return out
