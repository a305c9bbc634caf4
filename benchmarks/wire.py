"""The wire alone: GB/s and CPU-seconds per GB, client and servers, with 1 and 3 servers.

Servers run in transport benchmark mode (``--synthetic N``): they hold N samples whose
pixels are generated once and never decoded, so the figures are gRPC + framing + the
client's copy into the batch, nothing else. Everything runs on 127.0.0.1.

The ``grpcio`` row is the floor under the client's figures: the same servers' streams read
with grpcio alone (orders of one batch, ``prefetch`` in flight per server, each chunk's
pixels copied once into a batch buffer), with no remoteloader client: no plan, no
reassembly, no queue to the training loop. What the ``thread`` row costs above it is
remoteloader's; the rest is grpcio's receive path and the kernel's.

    python benchmarks/wire.py [--servers 1 3] [--epochs 4] [--image-size 224] [--batch-size 256]
    python benchmarks/wire.py --servers 1 --chunk-bytes 1048576 2097152 4194304 8388608   # message size sweep
    python benchmarks/wire.py --receiver grpcio thread   # RemoteLoader against grpcio alone
    python benchmarks/wire.py --codecs   # each wire encoding on one core: bytes, encode/decode ms, PSNR

``--codecs`` runs the wire encodings (``protos.wire``, the code the servers and clients run)
on 224 px "train" crops of the benchmark's photos, one core, no network: bytes per image,
encode ms (a decode worker's extra cost), decode ms (the receiver's), and PSNR.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import time

import grpc
import numpy as np

from remoteloader.client import RemoteLoader
from remoteloader.client.control_channel import channel_options
from remoteloader.client.cpu import process_cpu
from remoteloader.protos import codec, loader_pb2, loader_pb2_grpc, malloc
from remoteloader.server.config import ServerConfig
from remoteloader.tools.local import LocalServer


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class BareGrpc:
    """Reads the servers' streams with grpcio alone: the floor under RemoteLoader's figures."""

    STREAM = "/remoteloader.v1.Loader/Stream"

    def __init__(self, addresses: list[str], args):
        malloc.tune_malloc()  # as RemoteLoader does: without it each message costs page faults
        self.args = args
        self.loop = asyncio.new_event_loop()
        self.streams = self.loop.run_until_complete(self._gather(self._open(a) for a in addresses))
        self.batch = np.empty(args.batch_size * args.image_size ** 2 * 3, np.uint8)

    async def _open(self, address: str):
        sample_bytes = self.args.image_size ** 2 * 3
        channel = grpc.aio.insecure_channel(address, options=channel_options(64 << 20))
        describe = await loader_pb2_grpc.LoaderStub(channel).Describe(loader_pb2.DescribeRequest(), timeout=30,
                                                                     wait_for_ready=True)
        (shard,) = describe.shards
        call = channel.stream_stream(self.STREAM, request_serializer=loader_pb2.StreamRequest.SerializeToString,
                                     response_deserializer=codec.decode_chunk)()
        size = self.args.image_size
        await call.write(loader_pb2.StreamRequest(setup=loader_pb2.Setup(pipeline="train", height=size, width=size)))
        return channel, call, shard, sample_bytes

    def epoch(self, epoch: int) -> int:
        """Reads every sample of every server once; returns the number of images."""
        return sum(self.loop.run_until_complete(self._gather(self._epoch(s, epoch) for s in self.streams)))

    @staticmethod
    async def _gather(coroutines) -> list:
        return await asyncio.gather(*coroutines)

    async def _epoch(self, stream, epoch: int) -> int:
        _, call, shard, sample_bytes = stream
        b, n = self.args.batch_size, shard.num_samples
        orders = [range(i, min(i + b, n)) for i in range(0, n, b)]
        remaining, sent, images = {}, 0, 0
        while sent < len(orders) or remaining:
            while sent < len(orders) and len(remaining) < self.args.prefetch:
                remaining[sent] = len(orders[sent])
                await call.write(loader_pb2.StreamRequest(order=loader_pb2.Order(
                    order_id=sent, shard_ids=[shard.id], indices=orders[sent], seed=0, epoch=epoch)))
                sent += 1
            header, pixels = await call.read()
            start = header.start * sample_bytes
            self.batch[start:start + len(pixels)] = np.frombuffer(pixels, np.uint8)  # the one copy
            images += header.count
            remaining[header.order_id] -= header.count
            if not remaining[header.order_id]:
                del remaining[header.order_id]
        return images

    def close(self) -> None:
        for channel, call, _, _ in self.streams:
            call.cancel()
            self.loop.run_until_complete(channel.close())
        self.loop.close()


def measure(servers: int, chunk_bytes: int, receiver: str, args) -> dict:
    started = [LocalServer([], args=["--synthetic", str(args.samples), "--log-level", "WARNING",
                                     "--chunk-bytes", str(chunk_bytes)]).start() for _ in range(servers)]
    try:
        if receiver == "grpcio":
            source = BareGrpc([s.address for s in started], args)
            read_epoch, receiver_cpu = source.epoch, lambda: 0.0
        else:  # thread, process: over gRPC; local-thread, local-process: the same-host path
            local = receiver.startswith("local-")
            receiver = receiver.removeprefix("local-")
            source = RemoteLoader([s.address for s in started], batch_size=args.batch_size,
                                  image_size=args.image_size, shuffle=False, prefetch=args.prefetch,
                                  receiver=receiver, shared_memory=local)
            in_process = receiver == "thread"  # its CPU time is the trainer's (self_cpu)
            receiver = f"local-{receiver}" if local else receiver

            def receiver_cpu() -> float:
                """The receiver process's CPU seconds so far (the loader's documented stats())."""
                return 0.0 if in_process else source.stats()["receiver_cpu_s"]

            def read_epoch(_epoch: int) -> int:
                images = sum(len(labels) for _, labels in source)
                paths = {s["shared_memory"] for s in source.stats()["servers"].values()}
                assert paths == {local}, "not the path asked for"
                return images
        try:
            rows = []
            for epoch in range(args.epochs + 1):
                server_cpu = [process_cpu(s.process.pid) for s in started]
                received_before = receiver_cpu()
                client_cpu, start = self_cpu(), time.perf_counter()
                images = read_epoch(epoch)
                elapsed = time.perf_counter() - start
                gb = images * args.image_size ** 2 * 3 / 1e9
                if epoch:  # the first epoch warms up connections and caches
                    trainer = (self_cpu() - client_cpu) / gb
                    received = (receiver_cpu() - received_before) / gb
                    rows.append({"gb_per_s": gb / elapsed,
                                 "client_cpu_s_per_gb": trainer + received,
                                 "trainer_cpu_s_per_gb": trainer,
                                 "trainer_core_s_per_1000_images": trainer * args.image_size ** 2 * 3 * 1000 / 1e9,
                                 "server_cpu_s_per_gb": sum(process_cpu(s.process.pid) - c
                                                            for s, c in zip(started, server_cpu)) / gb})
        finally:
            source.close()
    finally:
        for s in started:
            s.stop()
    rows.sort(key=lambda r: r["gb_per_s"])
    median = rows[len(rows) // 2]
    return {"servers": servers, "chunk_bytes": chunk_bytes, "receiver": receiver, **median}


def codecs(args) -> None:
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import _common

    from remoteloader.protos import wire
    from remoteloader.server.pipelines import Pipeline, PipelineSpec

    samples, _ = _common.list_samples(_common.ensure_dataset(_common.DEFAULT_DATA, 2000)
                                      if not _common.read_manifest(_common.DEFAULT_DATA) else _common.DEFAULT_DATA)
    size = args.image_size
    pipeline = Pipeline(PipelineSpec("train", size, size), False, 1 << 26, True)
    crops = [np.ascontiguousarray(pipeline(open(path, "rb").read(), i))
             for i, (path, _) in enumerate(samples[:: max(1, len(samples) // args.photos)][:args.photos])]
    raw = crops[0].nbytes
    print(f"{len(crops)} train crops of {size} px ({raw} raw bytes each), one core")
    print("| wire | bytes/image | ratio | encode ms/image | decode ms/image | PSNR dB (worst) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in ("zstd", "jpeg95"):
        encoder = wire.Encoder(name)
        start = time.process_time()
        encoded = [encoder.image(c) for c in crops]
        encode = (time.process_time() - start) / len(crops)
        out = [np.empty_like(c) for c in crops]
        start = time.process_time()
        for data, o, c in zip(encoded, out, crops):
            wire.decode_part(name, memoryview(data if data is not None else c.tobytes()), o, mask=False)
        decode = (time.process_time() - start) / len(crops)
        nbytes = sum(len(d) if d is not None else raw for d in encoded) / len(crops)
        mse = [float(np.mean((o.astype(np.float64) - c) ** 2)) for o, c in zip(out, crops)]
        worst = "exact" if max(mse) == 0 else f"{10 * np.log10(255 ** 2 / max(mse)):.1f}"
        print(f"| {name} | {nbytes / 1e3:.1f} KB | {raw / nbytes:.2f}x | {encode * 1e3:.2f} | {decode * 1e3:.2f} "
              f"| {worst} |")


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
    parser.add_argument("--receiver", nargs="+", default=["grpcio", "thread", "process", "local-thread",
                                                            "local-process"],
                        choices=["grpcio", "thread", "process", "local-thread", "local-process"],
                        help="where the client receives: an I/O thread of the training process, or a child "
                             "process, over gRPC; local-: the same, with the pixels read from the servers' memory "
                             "(the same-host path); grpcio: the streams read with grpcio alone, no remoteloader "
                             "client")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--codecs", action="store_true", help="time the wire encodings on photos instead")
    parser.add_argument("--photos", type=int, default=300, help="photos for --codecs")
    args = parser.parse_args()
    if args.codecs:
        codecs(args)
        return
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
