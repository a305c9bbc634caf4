"""A bounded-time fuzzer against one real server: random bytes and mutated messages to every RPC.

FUZZ_SECONDS (default 15) bounds the fuzzing; FUZZ_SEED (default 1234) seeds it; FUZZ_THREADS
(default 3) sets how many callers run at once (each with its own seeded generator). Calls go
through the generic channel API with identity serializers, so any bytes can be sent. Afterwards
the server must still run, hold no open streams, and serve a full epoch whose pixels are
identical to the epoch it served before the fuzzing.
"""

from __future__ import annotations

import collections
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from conftest import ANY_PORT, wait_until_equal

from remoteloader.client import RemoteLoader
from remoteloader.protos import codec, loader_pb2
from remoteloader.tools.textures import make_imagefolder

FUZZ_SECONDS = float(os.environ.get("FUZZ_SECONDS", "15"))
FUZZ_SEED = int(os.environ.get("FUZZ_SEED", "1234"))
FUZZ_THREADS = int(os.environ.get("FUZZ_THREADS", "3"))
CALL_TIMEOUT = 2.0

pytestmark = [pytest.mark.timeout(120 + 2 * FUZZ_SECONDS), pytest.mark.slow]

SERVICE = "/remoteloader.v1.Loader/"
SIZE = 32
N = 16
U64 = (1 << 64) - 1
U32 = (1 << 32) - 1
# Status codes a sound server may answer fuzz with. INTERNAL comes from gRPC itself when a
# request does not parse; the service's own catch-all ("server error: ...") is checked apart.
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
           grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


class Fuzzer:
    def __init__(self, channel: grpc.Channel, shard_id: str, rng: random.Random):
        self.rng = rng
        self.shard_id = shard_id
        self.describe = channel.unary_unary(SERVICE + "Describe")
        self.get_keys = channel.unary_unary(SERVICE + "GetKeys")
        self.stream = channel.stream_stream(SERVICE + "Stream")
        self.health = channel.unary_unary("/grpc.health.v1.Health/Check")
        self.unknown = channel.unary_unary(SERVICE + "NoSuchMethod")
        self.codes: collections.Counter = collections.Counter()
        self.calls = 0
        self.chunks = 0
        self.problems: list[str] = []

    # ---- values -------------------------------------------------------------------------
    def _bytes(self, limit: int = 300) -> bytes:
        return self.rng.randbytes(self.rng.randint(0, limit))

    def _int(self, bits: int) -> int:
        r = self.rng
        return r.choice([0, 1, 2, N - 1, N, N + 1, 1023, 1024, 1025, (1 << (bits - 1)) - 1, 1 << (bits - 1),
                         (1 << bits) - 1, r.getrandbits(bits)])

    def _shard(self) -> str:
        r = self.rng
        return r.choice([self.shard_id, self.shard_id, self.shard_id, "", "nope", self.shard_id + "x",
                         self.shard_id[:-1], "\u00e9\u0000\u2603" * r.randint(1, 50), "x" * r.randint(100, 100_000)])

    def _size(self) -> int:
        return self.rng.choice([0, 1, 7, 8, 9, SIZE, SIZE, SIZE, 33, 100, 1023, 1024, 1025, 65535, U32])

    def _setup(self) -> loader_pb2.Setup:
        r = self.rng
        pipeline = r.choice(["train", "eval", "eval", "custom", "", "TRAIN", "nope", "x" * 1000])
        setup = loader_pb2.Setup(pipeline=pipeline, height=self._size(), width=self._size())
        if pipeline == "custom" or r.random() < 0.2:
            setup.albumentations_json = r.choice([
                "", "{}", "[]", "null", "{\"__version__\": \"2.0.8\"}", self._bytes(50).decode("latin-1"),
                '{"__version__": "2.0.8", "transform": {"__class_fullname__": "Resize", "height": 32, '
                '"width": 32, "p": 1.0}}',
                '{"__version__": "2.0.8", "transform": {"__class_fullname__": "os.system", "command": "true"}}',
                '{"transform": {"__class_fullname__": "Compose", "transforms": ' + "[" * 200 + "]" * 200 + "}}",
                "{" * 10_000,
                '{"a": "' + "b" * 70_000 + '"}',
            ])
        return setup

    def _order(self) -> loader_pb2.Order:
        r = self.rng
        kind = r.random()
        if kind < 0.35:
            indices = [r.randrange(N) for _ in range(r.randint(1, 8))]
        elif kind < 0.45:
            indices = [r.randrange(N) for _ in range(r.choice([1023, 1024, 1025, 4000]))]
        elif kind < 0.55:
            indices = []
        elif kind < 0.75:
            indices = [self._int(64) for _ in range(r.randint(1, 4))]
        else:
            indices = [r.randrange(N) for _ in range(r.randint(1, 4))] + [r.choice([N, U64, 1 << 63])]
        # Usually one shard; else several (the same one twice, too) and each sample's position among
        # them, which may be missing, short, long or past them.
        shard_ids = [self._shard() for _ in range(1 if r.random() < 0.7 else r.randint(0, 3))]
        count = max(0, len(indices) + r.choice([-1, 0, 0, 1]))
        shards = [] if r.random() < 0.7 else [r.choice([0, 0, 1, 2, 3, U32]) for _ in range(count)]
        return loader_pb2.Order(order_id=self._int(64), shard_ids=shard_ids, shards=shards, indices=indices,
                                seed=self._int(64), epoch=self._int(64))

    def _mutate(self, data: bytes) -> bytes:
        r = self.rng
        data = bytearray(data)
        for _ in range(r.randint(1, 6)):
            op = r.random()
            if op < 0.3 and data:
                data[r.randrange(len(data))] = r.randrange(256)
            elif op < 0.5 and data:
                del data[r.randrange(len(data)):][:r.randint(1, 8)]
            elif op < 0.7:
                i = r.randint(0, len(data))
                data[i:i] = r.randbytes(r.randint(1, 8))
            elif op < 0.85 and data:
                data = data[:r.randrange(len(data))]  # truncate
            else:
                i = r.randint(0, len(data))
                data[i:i] = bytes([r.choice([0x08, 0x0A, 0x12, 0x1A, 0xFF]), 0xFF, 0xFF, 0xFF, 0xFF, 0x0F])
        return bytes(data)

    def _request(self) -> bytes:
        """One StreamRequest's bytes: valid, mutated or random."""
        r = self.rng
        choice = r.random()
        if choice < 0.3:
            message = loader_pb2.StreamRequest(setup=self._setup())
        elif choice < 0.75:
            message = loader_pb2.StreamRequest(order=self._order())
        elif choice < 0.8:
            message = loader_pb2.StreamRequest()
        else:
            return self._bytes()
        data = message.SerializeToString()
        return self._mutate(data) if r.random() < 0.3 else data

    def _sequence(self) -> tuple[list[bytes], loader_pb2.Setup | None]:
        r = self.rng
        kind = r.random()
        setup = None
        if kind < 0.5:  # a plausible stream: a Setup, then orders (some absurd)
            setup = loader_pb2.Setup(pipeline=r.choice(["train", "eval"]), height=SIZE, width=SIZE)
            messages = [loader_pb2.StreamRequest(setup=setup).SerializeToString()]
            messages += [loader_pb2.StreamRequest(order=self._order()).SerializeToString()
                         for _ in range(r.randint(0, 20))]
            if r.random() < 0.2:
                messages.insert(r.randint(1, len(messages)), loader_pb2.StreamRequest(
                    setup=self._setup()).SerializeToString())  # a second Setup
        elif kind < 0.6:  # orders without a Setup
            messages = [loader_pb2.StreamRequest(order=self._order()).SerializeToString()
                        for _ in range(r.randint(1, 5))]
        elif kind < 0.7:  # repeated Setups
            messages = [loader_pb2.StreamRequest(setup=self._setup()).SerializeToString()
                        for _ in range(r.randint(2, 5))]
        elif kind < 0.72:  # one message over the server's 4 MiB receive limit
            messages = [loader_pb2.StreamRequest(setup=loader_pb2.Setup(
                pipeline="custom", height=SIZE, width=SIZE, albumentations_json="x" * (5 << 20))).SerializeToString()]
        else:  # anything
            messages = [self._request() for _ in range(r.randint(0, 8))]
        return messages, setup

    # ---- calls --------------------------------------------------------------------------
    def _record(self, code: grpc.StatusCode, details: str, what: str) -> None:
        self.calls += 1
        self.codes[code.name] += 1
        if code not in ALLOWED:
            self.problems.append(f"{what}: unexpected {code.name}: {details}")
        # A message that does not parse mid-stream comes back as INTERNAL "server error:
        # DecodeError" (the client's fault, labelled as the server's): tolerated here.
        if details and ("server error" in details or "Traceback" in details) and "DecodeError" not in details:
            self.problems.append(f"{what}: the service failed internally: {code.name}: {details[:300]}")

    def _unary(self, method, payload: bytes, what: str) -> None:
        try:
            method(payload, timeout=CALL_TIMEOUT)
            self._record(grpc.StatusCode.OK, "", what)
        except grpc.RpcError as exc:
            self._record(exc.code(), exc.details() or "", what)

    def one(self) -> None:
        r = self.rng
        op = r.random()
        if op < 0.1:
            payload = self._bytes() if r.random() < 0.7 else self._mutate(b"")
            self._unary(self.describe, payload, "Describe")
        elif op < 0.25:
            if r.random() < 0.5:
                payload = self._bytes()
            else:
                payload = loader_pb2.GetKeysRequest(shard_id=self._shard(), start=self._int(64),
                                                    count=self._int(32)).SerializeToString()
                if r.random() < 0.3:
                    payload = self._mutate(payload)
            self._unary(self.get_keys, payload, "GetKeys")
        elif op < 0.28:
            self._unary(self.health, self._bytes(40), "Health/Check")
        elif op < 0.3:
            self._unary(self.unknown, self._bytes(40), "NoSuchMethod")
        else:
            self._stream()

    def _stream(self) -> None:
        r = self.rng
        messages, setup = self._sequence()
        linger = r.random() < 0.2  # keep the stream open (no half-close) until the deadline
        cancel_after = r.choice([None, None, 0, 1, 3])

        def requests():
            yield from messages
            if linger:
                time.sleep(CALL_TIMEOUT + 0.5)

        call = self.stream(requests(), timeout=CALL_TIMEOUT)
        received = 0
        try:
            for raw in call:
                received += 1
                self._check_chunk(raw, setup)
                if cancel_after is not None and received > cancel_after:
                    call.cancel()
                    break
            code, details = (grpc.StatusCode.CANCELLED, "") if call.cancelled() else (call.code(), call.details())
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        self.chunks += received
        self._record(code, details, f"Stream ({len(messages)} messages)")

    def _check_chunk(self, raw: bytes, setup: loader_pb2.Setup | None) -> None:
        try:
            header, pixels = codec.decode_chunk(raw)
        except Exception as exc:
            self.problems.append(f"a Chunk that does not parse: {exc}")
            return
        if setup is None:
            return
        expected = header.count * setup.height * setup.width * 3
        if (header.count == 0 or header.height != setup.height or header.width != setup.width
                or header.channels != 3 or len(pixels) != expected or len(header.labels) != header.count
                or header.start + header.count > header.order_size):
            self.problems.append(f"a malformed Chunk: {header} with {len(pixels)} pixel bytes")


def _epoch_pixels(address: str, run_bounded) -> dict[int, np.ndarray]:
    out = {}
    with RemoteLoader(address, batch_size=5, image_size=SIZE, pipeline="train", seed=7, drop_last=False,
                      return_ids=True, connect_timeout=10) as loader:
        loader.set_epoch(3)
        for images, _labels, ids in run_bounded(loader, 20):
            for image, i in zip(images.numpy(), ids.tolist()):
                assert i not in out, f"sample {i} delivered twice"
                out[i] = image.copy()
    assert sorted(out) == list(range(N)), sorted(out)
    return out


def test_fuzz_every_rpc_then_serve_a_correct_epoch(cluster, tmp_path, run_bounded):
    data = make_imagefolder(tmp_path / "data", ["p", "q"], N // 2, size=(48, 64), seed=21)
    cluster.add(data, "--allow-custom-pipelines", "--metrics-port", ANY_PORT)
    metrics_port = cluster.metrics_port(0)
    address = cluster.address(0)
    before = _epoch_pixels(address, run_bounded)

    with grpc.insecure_channel(address) as channel:
        describe = channel.unary_unary(SERVICE + "Describe",
                                       response_deserializer=loader_pb2.DescribeResponse.FromString)
        shard_id = describe(b"", timeout=10).shards[0].id
        fuzzers = [Fuzzer(channel, shard_id, random.Random(FUZZ_SEED + i)) for i in range(FUZZ_THREADS)]
        deadline = time.monotonic() + FUZZ_SECONDS
        crashed: list[BaseException] = []

        def run(fuzzer: Fuzzer) -> None:
            try:
                while time.monotonic() < deadline and cluster.alive(0):
                    fuzzer.one()
            except BaseException as exc:  # a bug in the fuzzer itself must fail the test
                crashed.append(exc)

        started = time.monotonic()
        threads = [threading.Thread(target=run, args=(f,), daemon=True) for f in fuzzers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(FUZZ_SECONDS + 4 * CALL_TIMEOUT + 10)
        elapsed = time.monotonic() - started
        assert not any(t.is_alive() for t in threads), "a fuzz call did not end within its deadline"
        assert not crashed, crashed

    calls = sum(f.calls for f in fuzzers)
    codes = sum((f.codes for f in fuzzers), collections.Counter())
    chunks = sum(f.chunks for f in fuzzers)
    print(f"\nfuzz: {calls} calls in {elapsed:.1f}s ({FUZZ_THREADS} threads, seed {FUZZ_SEED}), "
          f"{chunks} chunks received; status codes {dict(codes)}")
    assert cluster.alive(0), f"the server died during fuzzing:\n{cluster.stderr(0)}"
    assert calls > 20, f"only {calls} fuzz calls in {elapsed:.1f}s"

    # Every stream the fuzzer opened is closed again on the server.
    wait_until_equal(lambda: _metric(metrics_port, "remoteloader_active_streams"), 0, "streams open after the fuzzing")

    after = _epoch_pixels(address, run_bounded)
    for i in range(N):
        assert np.array_equal(before[i], after[i]), f"sample {i} differs from before the fuzzing"
    assert cluster.alive(0)
    # Beyond surviving: no call may have hit the service's catch-all for its own failures
    # (INTERNAL "server error: ..."), and no decode worker may have died.
    problems = [p for f in fuzzers for p in f.problems]
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:20])
    log = cluster.stderr(0)
    assert "died with exit code" not in log, f"a decode worker died:\n{log[-3000:]}"


# ---- the native region decoder: mutated JPEGs, in a child process so that a crash is a failure ----
# The fuzzers' mutation of a JPEG (part of each child's script): up to ``most`` edits from ``start``
# (a share of its length) on: a byte changed, a marker written, bytes cut or inserted.
MUTATE = r"""
def mutate(r, data, most, start, markers):
    data = bytearray(data)
    for _ in range(r.randint(1, most)):
        i = r.randrange(int(len(data) * start), len(data))
        op = r.randrange(4)
        if op == 0:
            data[i] = r.randrange(256)
        elif op == 1:
            data[i:i + 2] = bytes([0xFF, r.choice(markers)])
        elif op == 2:
            del data[i:i + r.randint(1, 64)]
        else:
            data[i:i] = bytes(r.randrange(256) for _ in range(r.randint(1, 16)))
    return bytes(data)
"""


REGION_FUZZ = MUTATE + r"""
import random, sys, time
import cv2, numpy as np
from remoteloader.server import decode as dec
from remoteloader.tools.textures import make_image

seconds, seed = float(sys.argv[1]), int(sys.argv[2])
r = random.Random(seed)
image = make_image(0, 5, np.random.default_rng(seed), 97, 131)
seeds = []
for extra in ([], [cv2.IMWRITE_JPEG_PROGRESSIVE, 1], [cv2.IMWRITE_JPEG_RST_INTERVAL, 2],
              [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444]):
    seeds.append(cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 85] + extra)[1].tobytes())
seeds.append(cv2.imencode(".jpg", image[..., 0])[1].tobytes())
calls = refused = 0
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    data = mutate(r, r.choice(seeds), 6, 0, [0xD0, 0xD7, 0xD8, 0xD9, 0xDA, 0xC0, 0xC4, 0xDB, 0xDD])
    try:
        fmt, h, w = dec.read_size(data, 10**7)
    except dec.DecodeError:
        continue
    x1, y1 = r.randrange(w), r.randrange(h)
    box = (x1, y1, r.randint(x1 + 1, w), r.randint(y1 + 1, h))
    mins = r.choice([(0, 0), (1, 1), (max(1, h // 2), max(1, w // 2)), (h, w)])
    calls += 1
    try:
        out = dec.decode_crop(data, fmt, h, w, box, *mins, native=r.random() < 0.8)
    except dec.DecodeError:
        refused += 1
        continue
    assert out.dtype == np.uint8 and out.ndim == 3 and out.shape[2] == 3 and 0 < out.shape[0] <= h, out.shape
print(f"{calls} decodes of mutated JPEGs, {refused} refused")
"""


def _fuzz_in_a_child(script: str, most_seconds: float) -> str:
    """Runs a fuzz script in a child process (a crash is a failure, not the suite's end); its stdout.
    Skips where the native region decoder was not built."""
    from remoteloader.server import decode as dec

    if dec._jpeg is None:
        pytest.skip("the native region decoder was not built (no compiler or libjpeg-turbo headers)")
    seconds = min(FUZZ_SECONDS, most_seconds)
    result = subprocess.run([sys.executable, "-c", script, str(seconds), str(FUZZ_SEED)],
                            capture_output=True, text=True, timeout=60 + seconds)
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout}\n{result.stderr[-3000:]}"
    return result.stdout


def test_region_decoder_survives_mutated_jpegs():
    """Every call on a mutated JPEG returns an RGB region or raises DecodeError: no crash, no hang."""
    stdout = _fuzz_in_a_child(REGION_FUZZ, 8.0)
    calls, refused = map(int, re.findall(r"(\d+) decodes of mutated JPEGs, (\d+) refused", stdout)[0])
    assert calls > 100 and 0 < refused < calls, stdout  # both outcomes were exercised


# ---- the first epoch's region decode: what it refuses against what a whole decode refuses ----
REST_FUZZ = MUTATE + r"""
import random, sys, time
import cv2, numpy as np
from remoteloader.server import decode as dec
from remoteloader.tools.textures import make_image

seconds, seed = float(sys.argv[1]), int(sys.argv[2])
r = random.Random(seed)
image = make_image(0, 5, np.random.default_rng(seed), 97, 131)
seeds = [cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 85] + extra)[1].tobytes()
         for extra in ([], [cv2.IMWRITE_JPEG_RST_INTERVAL, 2], [cv2.IMWRITE_JPEG_RST_INTERVAL, 1],
                       [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444])]
seeds.append(cv2.imencode(".jpg", image[..., 0])[1].tobytes())
calls = refused = blind = 0
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    data = mutate(r, r.choice(seeds), 3, 0.5, [0xD0, 0xD5, 0xD9, 0xDA, 0xC4, 0xDB, 0xDD])  # below a crop of the top
    try:
        fmt, h, w = dec.read_size(data, 10**7)
    except dec.DecodeError:
        continue
    factor = r.choice([1, 2, 4, 8]) if fmt == "jpeg" else 1
    sh, sw = -(-h // factor), -(-w // factor)
    x1, y1 = r.randrange(sw), r.randrange(max(1, sh // 3))
    x2, y2 = r.randint(x1 + 1, sw), r.randint(y1 + 1, max(y1 + 1, sh // 2))
    calls += 1
    try:
        dec.decode(data, fmt, sh if factor > 1 else 0, sw if factor > 1 else 0, h, w)
        whole = None
    except dec.DecodeError as exc:
        whole = str(exc)
    out = np.empty((y2 - y1, x2 - x1 + 31, 3), np.uint8)
    region = (data, factor, x1, y1, x2 - x1, y2 - y1, out, dec.MAX_SCANS, out.shape[1])
    try:
        dec._jpeg.decode_region(*region, True)
        rest = None
    except ValueError as exc:
        rest = str(exc)
    assert whole is None or rest is not None, f"a whole decode refuses it ({whole}), the region + rest takes it"
    if whole is not None:
        refused += 1
        try:
            dec._jpeg.decode_region(*region)
            blind += 1
        except ValueError:
            pass
print(f"{calls} decodes of mutated JPEGs, {refused} refused whole, {blind} of them taken by the region alone")
"""


def test_reading_the_rest_refuses_what_a_whole_decode_refuses():
    """The first epoch's decode of a file not known to decode (the region, then the rest of the
    file read, _jpeg.decode_region(..., whole=True)) refuses every mutated JPEG a whole decode
    refuses, also where the region alone (a verified file's decode) takes it."""
    stdout = _fuzz_in_a_child(REST_FUZZ, 6.0)
    calls, refused, blind = map(int, re.findall(r"(\d+) decodes of mutated JPEGs, (\d+) refused whole, (\d+) of",
                                                stdout)[0])
    assert calls > 100 and refused > 10 and blind > 5, stdout  # damage the region alone misses was made
