"""``remoteloader pack SRC DST``: write WebDataset tar shards from an ImageFolder tree.

Each sample becomes ``<class>/<file>`` (the original bytes under the ImageFolder key, not
re-encoded) and ``<class>/<stem>.cls`` (its label as decimal text); beside each tar,
``<tar>.index.npz`` holds its index so servers start without scanning it, written in a seeded random order so
every shard mixes all classes; ``classes.txt`` beside the shards names the labels. Reading
one large file by offset is much faster than opening many small files on real disks.
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import re
import sys
import tarfile

import numpy as np

from remoteloader.server.catalog import CLASSES_FILE, ImageFolderShard, TarShard
from remoteloader.server.decode import DecodeError, read_size

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 500MB, 1GiB or 200000")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="ImageFolder tree: SRC/<class>/<image>")
    parser.add_argument("dst", help="output folder for shard-NNNNN.tar and classes.txt")
    parser.add_argument("--shard-size", type=parse_size, default=parse_size("256MB"),
                        help="target bytes per tar shard (default 256MB)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample order (mixes classes across shards)")
    parser.add_argument("--no-shuffle", action="store_true", help="keep the ImageFolder order")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def pack(src: str, dst: str, shard_size: int, seed: int = 0, shuffle: bool = True, progress: bool = True) -> list[pathlib.Path]:
    """Writes the shards; returns their paths."""
    if shard_size <= 0:
        raise ValueError(f"shard_size={shard_size}: expected a positive number of bytes")
    source = ImageFolderShard(pathlib.Path(src))
    out = pathlib.Path(dst)
    if out.exists() and any(out.iterdir()):
        # A server reads every .tar in a folder: packing next to other files would mix datasets.
        raise FileExistsError(f"{out} is not empty; choose a new or empty folder for the shards")
    out.mkdir(parents=True, exist_ok=True)
    order = np.random.default_rng(seed).permutation(len(source)) if shuffle else np.arange(len(source))
    (out / CLASSES_FILE).write_text("".join(f"{c}\n" for c in source.class_names))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(source), unit="img", desc=f"packing into {out}", file=sys.stderr)
    paths: list[pathlib.Path] = []
    tar = None
    written = 0
    unreadable, first_unreadable = 0, []  # a count and the first five, named
    try:
        for index in order.tolist():
            key = source.key(index)
            data = pathlib.Path(source.locate(index).path).read_bytes()
            try:  # the header only (a full decode would cost ~1 ms per image): copied anyway
                read_size(data, max_pixels=1 << 62)
            except DecodeError as exc:
                unreadable += 1
                if len(first_unreadable) < 5:
                    first_unreadable.append(f"{key} ({exc})")
            if tar is None or written >= shard_size:
                if tar is not None:
                    tar.close()
                paths.append(out / f"shard-{len(paths):05d}.tar")
                tar = tarfile.open(paths[-1], "w", format=tarfile.USTAR_FORMAT)
                written = 0
            stem, _ = os.path.splitext(key)
            _add(tar, key, data)  # the ImageFolder key, so both layouts name samples alike
            _add(tar, f"{stem}.cls", str(int(source.labels[index])).encode())
            written += len(data) + 1536
            if bar is not None:
                bar.update(1)
    finally:
        if tar is not None:
            tar.close()
        if bar is not None:
            bar.close()
    names = list(source.class_names)
    for path in paths:  # the sidecar indexes: servers start without scanning the tars
        TarShard(path, names)
    if unreadable:
        print(f"remoteloader pack: warning: {unreadable} file(s) have no readable image header; they are "
              f"packed as they are and will fail when served: {'; '.join(first_unreadable)}"
              f"{' ...' if unreadable > 5 else ''}", file=sys.stderr)
    return paths


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def run(args: argparse.Namespace) -> int:
    try:
        paths = pack(args.src, args.dst, args.shard_size, args.seed, not args.no_shuffle, progress=not args.quiet)
    except (OSError, ValueError) as exc:  # CatalogError is a ValueError
        print(f"remoteloader pack: error: {exc}", file=sys.stderr)
        return 2
    total = sum(p.stat().st_size for p in paths)
    print(f"wrote {len(paths)} shard(s), {total / 1e6:.1f} MB, to {args.dst}")
    return 0
