"""Each format against the same images in ``pack``ed tar shards, side by side in one run.

Part 1, throughput: the ImageNet-like JPEGs of ``benchmarks/_common.py`` (``--images``) written
as a tar of the same bytes, a TFRecord file, an LMDB database (Caffe Datum records) and a
Parquet file (Hugging Face's ``{bytes, path}`` image struct), and as ``pack`` writes them
(``packed``: JPEGs rewritten losslessly, so a crop decodes only its own blocks), each served by
one local server with ``--workers`` decode workers, read ``--epochs`` times (after a warm-up
epoch) by the same training-loop-less reader, the formats' epochs in turn; prints the median
images/s and the ratio to the tar of the same bytes (what a format alone costs; target 0.9x),
and ``packed``'s.

Part 2, catalogs: ``--catalog-samples`` (default 1,000,000) samples of one small JPEG in each
format, indexed as a server indexes them, in this process: the start-up time of the first
start (which scans or extracts) and of the next (which reads the kept index), and the catalog's
bytes per sample (its numpy arrays and blobs).

    python benchmarks/formats.py                           # 2000 images; 1M-sample catalogs
    python benchmarks/formats.py --images 600 --epochs 2 --catalog-samples 100000    # quick

The TFRecord and Parquet files here are written by this script (a minimal TFRecord writer, and
pyarrow): the tests check that the server reads what TensorFlow and Hugging Face write.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import struct
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from _common import DEFAULT_DATA, default_cores, ensure_dataset, ensure_packed, list_samples  # noqa: E402

from remoteloader.server.formats import FormatOptions, open_shards  # noqa: E402
from remoteloader.server.formats.tfrecord import masked_crc  # noqa: E402
from remoteloader.tools.local import LocalServer  # noqa: E402
from remoteloader.tools.textures import encode_jpeg  # noqa: E402


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def example(jpeg: bytes, label: int) -> bytes:
    """A tf.train.Example of image/encoded and image/class/label."""

    def feature(name: str, value: bytes) -> bytes:
        return _field(1, _field(1, name.encode()) + _field(2, value))

    image = _field(1, _field(1, jpeg))  # Feature.bytes_list(BytesList.value)
    klass = _field(3, _field(1, _varint(label)))  # Feature.int64_list (packed)
    return _field(1, feature("image/encoded", image) + feature("image/class/label", klass))


def write_tfrecord(path: pathlib.Path, samples: list[tuple[bytes, int]]) -> None:
    with open(path, "wb") as f:
        for jpeg, label in samples:
            data = example(jpeg, label)
            head = struct.pack("<Q", len(data))
            f.write(head + struct.pack("<I", masked_crc(head)) + data + struct.pack("<I", masked_crc(data)))


def datum(jpeg: bytes, label: int) -> bytes:
    """A Caffe Datum: channels, height, width, data (encoded), label, encoded."""
    return (
        _varint(1 << 3) + _varint(3) + _field(4, jpeg) + _varint(5 << 3) + _varint(label) + _varint(7 << 3) + _varint(1)
    )


def write_lmdb(folder: pathlib.Path, samples: list[tuple[bytes, int]]) -> None:
    import lmdb

    # A map is address space, not disk: room for half-full pages of small values (a million of them).
    size = sum(len(j) for j, _ in samples) * 4 + 1024 * len(samples) + (64 << 20)
    env = lmdb.open(str(folder), map_size=size)
    txn = env.begin(write=True)
    for i, (jpeg, label) in enumerate(samples):
        txn.put(f"{i:09d}".encode(), datum(jpeg, label))
        if i % 100_000 == 99_999:
            txn.commit()
            txn = env.begin(write=True)
    txn.commit()
    env.close()


def write_parquet(path: pathlib.Path, samples: list[tuple[bytes, int]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    rows = 10_000
    with pq.ParquetWriter(path, pa.schema([("image", image), ("label", pa.int64())])) as writer:
        for k in range(0, len(samples), rows):
            part = samples[k : k + rows]
            images = pa.array([{"bytes": j, "path": f"{k + i:09d}.jpg"} for i, (j, _) in enumerate(part)], image)
            writer.write_table(pa.table({"image": images, "label": pa.array([lab for _, lab in part], pa.int64())}))


def write_tar(folder: pathlib.Path, samples: list[tuple[bytes, int]]) -> None:
    import io
    import tarfile

    with tarfile.open(folder / "shard-00000.tar", "w") as tar:
        for i, (jpeg, label) in enumerate(samples):
            for name, data in ((f"{i:09d}.jpg", jpeg), (f"{i:09d}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def throughput(paths: dict[str, str], args: argparse.Namespace, work: pathlib.Path) -> dict[str, list[float]]:
    """Images/s of each format's epochs: one server per format, all started first, their epochs
    taken in turn (a round of one epoch each, the order rotating) after a warm-up epoch each
    (whole decodes, page cache), so that the machine's drifts fall on every format alike."""
    from remoteloader.client import RemoteLoader

    servers = {
        name: LocalServer(
            path,
            args=["--workers", str(args.workers), "--cache-dir", str(work / "cache" / name), "--log-level", "WARNING"],
        )
        for name, path in paths.items()
    }
    loaders: dict[str, RemoteLoader] = {}
    rates: dict[str, list[float]] = {name: [] for name in paths}
    try:
        for server in servers.values():
            server.launch()
        for name, server in servers.items():
            server.wait_ready(600)
            loaders[name] = RemoteLoader(server.address, batch_size=args.batch_size, image_size=224, connect_timeout=60)
        names = list(paths)
        for round_ in range(args.epochs + 1):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                started, images = time.perf_counter(), 0
                for batch, _labels in loaders[name]:
                    images += len(batch)
                if round_:  # the first round: warm-up
                    rates[name].append(images / (time.perf_counter() - started))
    finally:
        for loader in loaders.values():
            loader.close()
        for server in servers.values():
            server.stop(30)
    return rates


def catalog_bytes(shard) -> int:
    return sum(a.nbytes for a in shard.index_arrays().values())


def catalogs(args: argparse.Namespace, work: pathlib.Path, jpeg: bytes) -> dict:
    samples = [(jpeg, i % 1000) for i in range(args.catalog_samples)]
    out = {}
    for name, write, target in (
        ("tar", write_tar, "tar"),
        ("tfrecord", write_tfrecord, "a.tfrecord"),
        ("lmdb", write_lmdb, "lmdb"),
        ("parquet", write_parquet, "a.parquet"),
    ):
        folder = work / f"catalog-{name}"
        folder.mkdir()
        path = folder if name == "tar" else folder / target
        if name == "lmdb":
            path.mkdir()
        started = time.perf_counter()
        write(path, samples)
        written = time.perf_counter() - started
        (folder / "classes.txt").write_text("".join(f"class-{i}\n" for i in range(1000)))  # (labels 0..999)
        options = FormatOptions(index_folder=str(work / f"catalog-cache-{name}" / "indexes"))
        timings = []
        for _ in range(2):  # the first start indexes (scans, extracts); the next reads the kept index
            started = time.perf_counter()
            (shard,) = open_shards([str(path)], options)
            timings.append(time.perf_counter() - started)
        out[name] = {
            "samples": len(shard),
            "first_start_s": round(timings[0], 2),
            "next_start_s": round(timings[1], 2),
            "catalog_bytes_per_sample": round(catalog_bytes(shard) / len(shard), 1),
            "written_in_s": round(written, 1),
        }
        print(f"catalog {name}: {json.dumps(out[name])}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=default_cores())
    parser.add_argument("--catalog-samples", type=int, default=1_000_000)
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    root = ensure_dataset(pathlib.Path(args.data).expanduser(), args.images)
    packed = ensure_packed(root, args.workers)
    files, _ = list_samples(root)
    samples = [(pathlib.Path(path).read_bytes(), label) for path, label in files]
    work = pathlib.Path(tempfile.mkdtemp(prefix="formats-bench-"))
    try:
        write_tfrecord(work / "data.tfrecord", samples)
        (work / "lmdb").mkdir()
        write_lmdb(work / "lmdb", samples)
        write_parquet(work / "data.parquet", samples)
        (work / "tar").mkdir()
        write_tar(work / "tar", samples)  # the same bytes as the other formats: what a format alone costs
        paths = {
            "tar": str(work / "tar"),
            "packed": str(packed),
            "tfrecord": str(work / "data.tfrecord"),
            "lmdb": str(work / "lmdb"),
            "parquet": str(work / "data.parquet"),
        }
        rates = throughput(paths, args, work)
        median = {name: statistics.median(r) for name, r in rates.items()}
        report = {
            "images": len(samples),
            "workers": args.workers,
            "images_per_s": {k: round(v) for k, v in median.items()},
            "over_tar": {k: round(v / median["tar"], 3) for k, v in median.items()},
        }
        print(json.dumps(report, indent=2), flush=True)
        # One small JPEG a million times: the catalogs' cost is per sample, not per byte (and a
        # million photos would not fit the disk).
        small = encode_jpeg(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8), 90)
        report["catalogs"] = catalogs(args, work, small)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps({**report, "epochs": rates}, indent=2))
    finally:  # (gigabytes: the formats' copies, the million-sample catalogs)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
