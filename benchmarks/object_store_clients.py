"""Which S3 client reads samples' byte ranges for the least CPU: obstore, boto3, s3fs.

A loader server reads its samples from an object store as byte ranges, many at once. This
reads the same random ranges (``--range-kb``, like an ImageNet JPEG) of one object in a real
S3 server on 127.0.0.1 (SeaweedFS, ``tools/local_s3.py``) with each client, ``--inflight``
at a time, side by side in one run, and prints MB per CPU-second of this process (the
store's own CPU is not counted) and MB/s. obstore is what the server uses; boto3 and s3fs are
measured only here:

    pip install boto3 s3fs    # not dependencies of remoteloader
    python benchmarks/object_store_clients.py --ranges 3000 --inflight 32
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import random
import resource
import tempfile
import time

from remoteloader.tools.local_s3 import LocalS3

OBJECT = "bench/object.bin"


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def with_obstore(ranges: list[tuple[int, int]], inflight: int) -> int:
    import obstore
    from obstore.store import from_url

    store = from_url("s3://bench")

    async def run() -> int:
        gate = asyncio.Semaphore(inflight)

        async def one(start: int, length: int) -> int:
            async with gate:
                return len(await obstore.get_range_async(store, OBJECT, start=start, length=length))

        return sum(await asyncio.gather(*(one(s, n) for s, n in ranges)))

    return asyncio.run(run())


def with_boto3(ranges: list[tuple[int, int]], inflight: int) -> int:
    import boto3
    import botocore.config

    client = boto3.client("s3", config=botocore.config.Config(max_pool_connections=inflight))

    def one(start: int, length: int) -> int:
        reply = client.get_object(Bucket="bench", Key=OBJECT, Range=f"bytes={start}-{start + length - 1}")
        return len(reply["Body"].read())

    with concurrent.futures.ThreadPoolExecutor(inflight) as pool:
        return sum(pool.map(lambda r: one(*r), ranges))


def with_s3fs(ranges: list[tuple[int, int]], inflight: int) -> int:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"], asynchronous=False)
    path = f"bench/{OBJECT}"
    total = 0
    for k in range(0, len(ranges), inflight):  # cat_ranges fetches a batch concurrently
        batch = ranges[k : k + inflight]
        parts = fs.cat_ranges([path] * len(batch), [s for s, _ in batch], [s + n for s, n in batch])
        total += sum(len(p) for p in parts)
    return total


CLIENTS = {"obstore": with_obstore, "boto3": with_boto3, "s3fs": with_s3fs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranges", type=int, default=3000)
    parser.add_argument("--range-kb", type=int, default=110)
    parser.add_argument("--object-mb", type=int, default=256)
    parser.add_argument("--inflight", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="each client runs this many times, interleaved")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder, LocalS3(folder, buckets=("bench",)) as store:
        os.environ.update(store.env())
        import obstore
        from obstore.store import from_url

        size = args.object_mb << 20
        obstore.put(from_url("s3://bench"), OBJECT, os.urandom(size))
        rng = random.Random(0)
        length = args.range_kb << 10
        ranges = [(rng.randrange(0, size - length), length) for _ in range(args.ranges)]
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in CLIENTS}
        for _ in range(args.rounds):
            for name, read in CLIENTS.items():
                try:
                    started, cpu_before = time.perf_counter(), cpu()
                    got = read(ranges, args.inflight)
                    wall, used = time.perf_counter() - started, cpu() - cpu_before
                except ImportError as exc:
                    print(f"{name}: not installed ({exc.name}); pip install boto3 s3fs")
                    continue
                assert got == len(ranges) * length, (name, got)
                results[name].append((wall, used))
        mb = len(ranges) * length / 1e6
        print(f"{len(ranges)} ranges of {args.range_kb} KB, {args.inflight} in flight, best of {args.rounds}:")
        for name, runs in results.items():
            if runs:
                wall, used = min(runs, key=lambda r: r[1])
                print(f"  {name:8s} {mb / used:7.0f} MB per CPU-second   {mb / wall:6.0f} MB/s   ({used:.2f} CPU-s)")


if __name__ == "__main__":
    main()
