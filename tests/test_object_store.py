"""Loader servers on an object store: a real S3 server (SeaweedFS, ``tools/local_s3.py``) on
127.0.0.1, the same datasets uploaded to it and kept on disk, and servers on both.

Module data (uploaded under the bucket ``data``):
    packed/   ``remoteloader pack`` tar shards, with their indexes and classes.txt
    plain/    a WebDataset tar with .json targets and .mask.png members, no index
    folder/   an ImageFolder tree
    coco/     a COCO annotation file and its images
"""

from __future__ import annotations

import http.client
import http.server
import os
import pathlib
import threading
import time

import numpy as np
import pytest
import torch
from conftest import ANY_PORT

from remoteloader.client import LoaderError, RemoteLoader
from remoteloader.server.object_cache import _coalesce, _Gate, _Mirror, _overlapping, _subtract
from remoteloader.tools.local import ServerProcess, server_command
from remoteloader.tools.local_s3 import LocalS3
from remoteloader.tools.pack import pack
from remoteloader.tools.shapes import make_coco, make_target_tar
from remoteloader.tools.textures import make_imagefolder

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

DATASETS = ("packed", "plain", "folder", "coco", "tfrecord", "parquet")
FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "formats"


class Data:
    def __init__(self, root: pathlib.Path, s3: LocalS3, local: dict[str, pathlib.Path]):
        self.root, self.s3, self.local = root, s3, local

    def url(self, name: str) -> str:
        return f"s3://data/{name}"

    def path(self, name: str) -> str:
        if name == "coco":
            return str(self.local[name] / "annotations.json")
        return str(self.local[name])

    def bucket_path(self, name: str) -> str:
        return self.url("coco/annotations.json") if name == "coco" else self.url(name)

    def upload(self, name: str, folder: pathlib.Path) -> None:
        import obstore
        from obstore.store import from_url

        store = from_url("s3://data", client_options={"allow_http": "true"}, **_credentials(self.s3))
        for file in sorted(folder.rglob("*")):
            if file.is_file():
                obstore.put(store, f"{name}/{file.relative_to(folder).as_posix()}", file.read_bytes())

    def store(self):
        from obstore.store import from_url

        return from_url("s3://data", client_options={"allow_http": "true"}, **_credentials(self.s3))


def _credentials(s3: LocalS3) -> dict:
    return {"endpoint": s3.endpoint, "access_key_id": s3.access_key, "secret_access_key": s3.secret_key,
            "region": "us-east-1"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("object-store")
    folder = make_imagefolder(root / "folder", ["ant", "bee", "cat"], 16, size=(96, 128), seed=3)
    packed = root / "packed"
    pack(str(folder), str(packed), shard_size=400_000, progress=False)
    plain = make_target_tar(root / "plain" / "shapes.tar", 24, size=(96, 128), seed=4).parent
    coco = make_coco(root / "coco", 20, size=(96, 128), seed=5).parent
    formats = {}
    for kind in ("tfrecord", "parquet"):  # (written by TensorFlow and by Hugging Face datasets: test_formats.py)
        formats[kind] = root / kind
        formats[kind].mkdir()
        (formats[kind] / f"detection.{kind}").write_bytes((FIXTURES / f"detection.{kind}").read_bytes())
        (formats[kind] / "classes.txt").write_text("background\nsquare\ndisc\n")
    s3 = LocalS3(root / "s3").start()
    local = {"packed": packed, "plain": plain, "folder": folder, "coco": coco, **formats}
    d = Data(root, s3, local)
    for name, path in local.items():
        d.upload(name, path)
    yield d
    s3.stop()


def batches(loader, run_bounded, epochs: int = 1) -> list:
    """Every batch of ``epochs`` epochs as plain values: ids, labels, images and any targets."""
    out = []
    for _ in range(epochs):
        for item in loader:  # (dict batches: run_bounded keeps tuples; the test's timeout bounds this)
            if isinstance(item, dict):
                out.append({  # (None: an extra field, e.g. COCO's image_id, that a sample lacks)
                    k: v.numpy().copy() if isinstance(v, torch.Tensor) else [t if t is None else t.numpy().copy()
                                                                            for t in v]
                    for k, v in item.items()
                })
            else:
                images, labels, ids = item
                out.append({"images": images.numpy().copy(), "label": labels.numpy().copy(), "ids": ids.numpy().copy()})
    return out


def same(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.keys() != y.keys():
            return False
        for k in x:
            xs, ys = (x[k], y[k]) if isinstance(x[k], list) else ([x[k]], [y[k]])
            if len(xs) != len(ys) or not all(
                (p is None and q is None) or (p is not None and q is not None and np.array_equal(p, q))
                for p, q in zip(xs, ys)
            ):
                return False
    return True


def loader(addresses, **kwargs) -> RemoteLoader:
    options = dict(batch_size=6, image_size=48, drop_last=False, return_ids=True, seed=7, connect_timeout=30)
    options.update(kwargs)
    return RemoteLoader(addresses, **options)


# ---- the same data from the bucket as from the disk ------------------------------------------
def test_every_format_serves_the_same_batches_from_the_bucket_as_from_disk(cluster, data, run_bounded, tmp_path):
    on_disk = cluster.add([data.path(n) for n in DATASETS], "--cache-dir", str(tmp_path / "disk"))
    cache = tmp_path / "cache"
    in_bucket = cluster.add([data.bucket_path(n) for n in DATASETS], "--cache-dir", str(cache), env=data.s3.env())
    log = cluster.stderr(in_bucket)
    assert "costs one request per image" in log and "remoteloader pack" in log, log  # the ImageFolder
    assert log.count("the traffic to one is unencrypted") == 1, log  # (AWS_ALLOW_HTTP=true: said once)
    with loader(cluster.address(on_disk)) as a, loader(cluster.address(in_bucket)) as b:
        assert a.num_samples == b.num_samples == 48 + 48 + 24 + 20 + 12 + 12
        assert {s.id for s in a.sample_space.shards} == {s.id for s in b.sample_space.shards}, "not the same shards"
        assert "mask" in b.sample_space.fields and "bboxes" in b.sample_space.fields
        first, second = batches(a, run_bounded, 2), batches(b, run_bounded, 2)  # the 2nd: region decodes
    assert same(first, second), "the bucket's samples differ from the disk's"
    kept = list((cache / "indexes").glob("*.index.npz"))
    assert len(kept) == 2, f"the indexes of the plain tar and the TFRecord file were not kept: {kept}"
    assert len(list((cache / "parquet").glob("*.images"))) == 1, "the Parquet file's images were not extracted"
    # A restart reads the kept index instead of scanning the tar again.
    again = cluster.add([data.bucket_path("plain")], "--cache-dir", str(cache), env=data.s3.env())
    assert "scanned" not in cluster.stderr(again) and "scanned" in log, cluster.stderr(again)


def test_gzipped_tars_in_the_bucket_are_decompressed_once_and_serve_as_the_tars(cluster, data, run_bounded,
                                                                                tmp_path):
    import gzip

    gz = tmp_path / "gz"
    gz.mkdir()
    for path in data.local["packed"].iterdir():
        if path.name.endswith(".tar"):
            (gz / (path.name + ".gz")).write_bytes(gzip.compress(path.read_bytes()))
        elif path.name == "classes.txt":
            (gz / path.name).write_bytes(path.read_bytes())
    data.upload("gzipped", gz)
    cache = tmp_path / "cache"
    i = cluster.add([data.url("gzipped")], "--cache-dir", str(cache), env=data.s3.env())
    reference = cluster.add([data.path("packed")], "--cache-dir", str(tmp_path / "disk"))
    assert cluster.stderr(i).count("decompressed into") == len(list(gz.glob("*.tar.gz"))), cluster.stderr(i)
    with loader(cluster.address(reference)) as a, loader(cluster.address(i)) as b:
        assert {s.id for s in a.sample_space.shards} == {s.id for s in b.sample_space.shards}, "not the same shards"
        assert same(batches(a, run_bounded), batches(b, run_bounded)), "the gzipped tars serve other samples"


def test_recordio_files_in_the_bucket_serve_their_images_and_a_split_record_fails_by_name(cluster, data,
                                                                                          run_bounded, tmp_path):
    rec = tmp_path / "rec"
    rec.mkdir()
    for name in ("imagenet.rec", "imagenet.idx", "split.rec", "split.idx"):
        (rec / name).write_bytes((pathlib.Path(__file__).parent / "fixtures" / "recordio" / name).read_bytes())
    data.upload("recordio", rec)
    i = cluster.add([data.url("recordio")], "--cache-dir", str(tmp_path / "cache"), env=data.s3.env())
    failures = []
    with loader(cluster.address(i), on_error=failures.extend) as L:
        ids = [int(v) for _x, _y, batch in run_bounded(L, 90) for v in batch]
    assert sorted(ids) == list(range(6 + 2)), "a sample lost or repeated"
    # (both files number their records from 0: a key carries its file, issue 42)
    assert [(f.key, "split the record" in f.reason) for f in failures] == [("split.rec/1", True)], failures


def test_servers_on_one_bucket_are_replicas_and_fail_over_exactly_once(cluster, data, run_bounded, tmp_path):
    args = ("--max-rate", "150")
    first = cluster.add([data.bucket_path("packed")], *args, "--cache-dir", str(tmp_path / "a"), env=data.s3.env())
    second = cluster.add([data.bucket_path("packed")], *args, "--cache-dir", str(tmp_path / "b"), env=data.s3.env())
    reference = cluster.add([data.path("packed")], "--cache-dir", str(tmp_path / "c"))
    with loader(cluster.address(reference)) as L:
        expected = batches(L, run_bounded)

    def kill_first(n, _batch):
        if n == 2:
            cluster.kill(first)

    with loader([cluster.address(first), cluster.address(second)], prefetch=2) as L:
        (shard,) = L.sample_space.shards
        assert len(shard.owners) == 2, "two servers on one bucket must be replicas of its shards"
        got = []
        for batch in run_bounded(L, 90, kill_first):
            images, labels, ids = batch
            got.append({"images": images.numpy().copy(), "label": labels.numpy().copy(), "ids": ids.numpy().copy()})
    assert same(got, expected)


def test_a_store_down_for_seconds_mid_epoch_loses_and_repeats_nothing(cluster, data, run_bounded, tmp_path):
    i = cluster.add([data.bucket_path("folder")], "--max-rate", "40", "--cache-dir", str(tmp_path / "c"),
                    env=data.s3.env())
    reference = cluster.add([data.path("folder")], "--cache-dir", str(tmp_path / "d"))
    with loader(cluster.address(reference)) as L:
        expected = batches(L, run_bounded)
    outage = []

    def stop_the_store(n, _batch):
        if n == 1:
            data.s3.stop()
            started = time.monotonic()
            time.sleep(3)
            data.s3.start()
            outage.append(time.monotonic() - started)

    with loader(cluster.address(i), prefetch=1, max_inflight=1) as L:
        got = [{"images": x.numpy().copy(), "label": y.numpy().copy(), "ids": ids.numpy().copy()}
               for x, y, ids in run_bounded(L, 120, stop_the_store)]
    assert outage and outage[0] >= 3
    assert same(got, expected), "the epoch changed across the store's outage"


class Throttling(threading.Thread):
    """An HTTP proxy in front of the store that answers 503 SlowDown while ``throttle`` is set."""

    def __init__(self, target: str):
        super().__init__(daemon=True)
        host, port = target.removeprefix("http://").split(":")
        proxy = self
        self.throttle = threading.Event()
        self.refused = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if proxy.throttle.is_set():
                    proxy.refused += 1
                    reply = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                    return
                upstream = http.client.HTTPConnection(host, int(port), timeout=30)
                upstream.request(self.command, self.path, body, dict(self.headers))  # Host kept: it is signed
                answer = upstream.getresponse()
                payload = answer.read()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                upstream.close()

            do_GET = do_HEAD = do_PUT = do_POST = forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def run(self) -> None:
        self.server.serve_forever()


def test_throttling_is_retried_and_nothing_is_lost(cluster, data, run_bounded, tmp_path):
    proxy = Throttling(data.s3.endpoint)
    proxy.start()
    try:
        env = {**data.s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        i = cluster.add([data.bucket_path("folder")], "--max-rate", "40", "--cache-dir", str(tmp_path / "c"), env=env)

        def throttle(n, _batch):
            if n == 1:
                proxy.throttle.set()
                threading.Timer(2.0, proxy.throttle.clear).start()

        with loader(cluster.address(i), prefetch=1, max_inflight=1) as L:
            ids = [int(v) for _x, _y, batch in run_bounded(L, 120, throttle) for v in batch]
    finally:
        proxy.server.shutdown()
    assert proxy.refused > 0, "the proxy never throttled a request"
    assert sorted(ids) == list(range(48))


def test_objects_deleted_or_rewritten_since_indexing_fail_their_samples_by_name(cluster, data, run_bounded, tmp_path):
    import obstore

    store = data.store()
    for name in ("folder", "packed"):  # copies this test may spoil
        for page in obstore.list(store, name):
            for meta in page:
                obstore.copy(store, meta["path"], "spoiled-" + meta["path"])
    i = cluster.add([data.url("spoiled-folder"), data.url("spoiled-packed")], "--cache-dir", str(tmp_path / "c"),
                    env=data.s3.env())
    obstore.delete(store, "spoiled-folder/bee/bee_00003.jpg")
    tars = [p["path"] for page in obstore.list(store, "spoiled-packed") for p in page if p["path"].endswith(".tar")]
    tar = sorted(tars)[0]
    obstore.put(store, tar, bytes(obstore.get(store, tar).bytes()) + b"\0" * 512)  # same samples, another version
    failures = []
    with loader(cluster.address(i), on_error=failures.extend) as L:
        ids = [int(v) for _x, _y, batch in run_bounded(L, 90) for v in batch]
    assert sorted(ids) == list(range(96)), "a batch lost or repeated samples around the failures"
    reasons = {f.key: f.reason for f in failures}
    # (the folder and the tars packed from it name their samples alike: the keys carry the file, issue 42)
    deleted = "spoiled-folder/bee/bee_00003.jpg"
    assert deleted in reasons and "no such object" in reasons[deleted], reasons
    changed = [r for r in reasons.values() if "changed since the server indexed it" in r]
    assert changed and all(tar in r for r in changed), reasons
    assert len(reasons) == 1 + len(changed)


@pytest.mark.parametrize("problem", ["credentials", "bucket", "plain-http"])
def test_bad_credentials_or_a_missing_bucket_stop_the_server_at_start_with_the_fix(data, tmp_path, problem):
    env = data.s3.env()
    url = data.url("packed")
    if problem == "credentials":
        env["AWS_SECRET_ACCESS_KEY"] = "wrong"
    elif problem == "plain-http":  # an http:// AWS_ENDPOINT_URL without AWS_ALLOW_HTTP: refused, naming it
        del env["AWS_ALLOW_HTTP"]
    else:
        url = "s3://no-such-bucket/packed"
    process = ServerProcess([*server_command(), "--data", url, "--port", "0", "--cache-dir", str(tmp_path),
                             "--store-timeout", "2"], env=env)
    code = process.wait(60)
    output = process.stderr()
    process.kill()
    assert code not in (None, 0), output
    assert url in output, output
    if problem == "credentials":
        assert "refused these credentials" in output and "AWS_ACCESS_KEY_ID" in output, output
    elif problem == "plain-http":
        assert "plain HTTP" in output and "AWS_ALLOW_HTTP=true" in output, output
    else:
        assert "no such bucket" in output, output
    assert "Traceback" not in output, output


# ---- the cache's bookkeeping, without a store ------------------------------------------------
def test_a_mirror_knows_exactly_which_bytes_it_holds(tmp_path):
    rng = np.random.default_rng(0)
    mirror = _Mirror(str(tmp_path / "m"))
    held = np.zeros(4000, bool)
    for _ in range(400):
        start = int(rng.integers(0, 3900))
        end = start + int(rng.integers(1, 100))
        added = mirror.add(start, end)
        assert added == int((~held[start:end]).sum())
        held[start:end] = True
        assert mirror.bytes == int(held.sum())
        a = int(rng.integers(0, 3900))
        b = a + int(rng.integers(1, 100))
        assert mirror.covers(a, b) == bool(held[a:b].all())
        missing = np.zeros(4000, bool)
        for s, e in mirror.missing(a, b):
            missing[s:e] = True
        assert np.array_equal(missing[a:b], ~held[a:b])
    mirror.close()
    assert not os.path.exists(tmp_path / "m")


def test_what_is_on_its_way_is_not_asked_for_twice():
    assert _subtract([(0, 10)], [(2, 4), (6, 7)]) == [(0, 2), (4, 6), (7, 10)]
    assert _subtract([(0, 10), (20, 30)], [(5, 25)]) == [(0, 5), (25, 30)]
    assert _subtract([(0, 10)], [(0, 10)]) == [] and _subtract([(5, 8)], []) == [(5, 8)]


def test_what_is_missing_and_what_is_coming_agree_with_every_byte_counted():
    """_subtract and _overlapping walk both sorted lists once; the same answers as byte by byte."""
    rng = np.random.default_rng(1)
    for _ in range(300):
        ranges = sorted((s, s + int(rng.integers(1, 40))) for s in rng.integers(0, 400, int(rng.integers(0, 8))))
        coming = sorted((s, s + int(rng.integers(1, 60))) for s in rng.integers(0, 400, int(rng.integers(0, 12))))
        wanted, on_way = np.zeros(500, bool), np.zeros(500, bool)
        for s, e in ranges:
            wanted[s:e] = True
        for s, e in coming:
            on_way[s:e] = True
        left = np.zeros(500, bool)
        for s, e in _subtract(ranges, coming):
            assert s < e and not on_way[s:e].any()
            left[s:e] = True
        assert np.array_equal(left, wanted & ~on_way)
        assert _overlapping(ranges, coming) == [k for k, (s, e) in enumerate(coming) if wanted[s:e].any()]


def test_neighbouring_ranges_are_fetched_as_one_request():
    from remoteloader.server.object_cache import COALESCE, MAX_REQUEST

    assert _coalesce([(100, 200), (0, 50), (150, 300)]) == [(0, 300)]
    twice = _coalesce([(0, MAX_REQUEST + 10), (5, MAX_REQUEST + 10)])  # (a big sample asked for twice)
    assert sum(e - s for s, e in twice) == MAX_REQUEST + 10 and all(a[1] <= b[0] for a, b in zip(twice, twice[1:]))
    held_between = lambda start, end: False  # noqa: E731
    assert _coalesce([(0, 50), (100, 200), (150, 300)], held_between) == [(0, 50), (100, 300)], "fetched twice"
    assert _coalesce([(0, 10), (10 + COALESCE + 1, 10 + COALESCE + 5)]) == [(0, 10), (COALESCE + 11, COALESCE + 15)]
    big = [(k * 1000, k * 1000 + 1000) for k in range(MAX_REQUEST // 1000 + 10)]
    assert all(e - s <= MAX_REQUEST for s, e in _coalesce(big)) and len(_coalesce(big)) == 2


def test_requests_in_flight_are_bounded_in_count_and_bytes():
    """What the store sends waits in memory until written: the cache sends a request (or a call
    of several) only while _Gate has room, so the requests in flight stay under its count, and
    the bytes they hold under its byte bound and one call, however large that call is."""
    gate = _Gate(most=3, most_bytes=100)
    assert gate.room()
    gate.take(60)
    assert gate.room(), "60 bytes of 100 in: another may go"
    gate.take(50)
    assert not gate.room(), "110 bytes in: the next waits for room"
    gate.leave(60)
    gate.leave(50)
    assert gate.room() and gate.count == 0 and gate.bytes == 0
    gate.take(500, requests=2)  # a call over the byte bound goes alone when nothing is in
    assert not gate.room() and gate.count == 2
    gate.leave(500, requests=2)
    for _ in range(3):
        assert gate.room()
        gate.take(10)
    assert not gate.room(), "three in: the count bound, whatever their bytes"
    for _ in range(3):
        gate.leave(10)
    assert gate.count == 0 and gate.bytes == 0


def test_ranges_of_one_object_come_in_few_calls_and_a_fault_fails_only_its_own_ranges(data, tmp_path, monkeypatch):
    """Ranges of one object too far apart to merge (none at offset 0: none a whole object) go to
    the store in one call per CALL_RANGES (and no more than the concurrency allows), a request
    each; a call that fails is repeated range by range, so that a range past the end of an
    object cut short fails alone, with its reason; an object of another version fails all its
    ranges."""
    import asyncio

    import obstore

    from remoteloader.server.catalog import Location
    from remoteloader.server.object_cache import CALL_RANGES, COALESCE, ObjectCache
    from remoteloader.server.storage import ObjectStorage

    for key, value in data.s3.env().items():
        monkeypatch.setenv(key, value)
    store = data.store()
    blob = np.random.default_rng(5).integers(0, 256, 40 * (COALESCE + 2000), np.uint8).tobytes()
    obstore.put(store, "calls/blob.bin", blob)
    etag = obstore.head(store, "calls/blob.bin")["e_tag"].strip('"')
    path = "s3://data/calls/blob.bin"
    apart = [Location(path, 512 + k * (COALESCE + 2000), 1000, etag) for k in range(40)]

    async def fetch(locations, folder, concurrency=64):
        cache = ObjectCache(str(tmp_path / folder), 1 << 30, [ObjectStorage("s3://data")], concurrency)
        try:
            reasons = await cache.fetch(locations)
            held = []
            for loc, reason in zip(locations, reasons):
                local = cache.local(loc)
                with open(local.path, "rb") as f:
                    held.append(os.pread(f.fileno(), loc.length, loc.offset) if not reason else b"")
            return reasons, held, cache.stats
        finally:
            cache.close()

    reasons, held, stats = asyncio.run(fetch(apart, "a"))
    assert reasons == [""] * 40 and held == [blob[loc.offset : loc.offset + 1000] for loc in apart]
    assert stats.requests == 40 and stats.calls == -(-40 // CALL_RANGES), (stats.requests, stats.calls)
    reasons, held, stats = asyncio.run(fetch(apart, "a4", concurrency=4))  # (a call: no more requests than that)
    assert reasons == [""] * 40 and held == [blob[loc.offset : loc.offset + 1000] for loc in apart]
    assert stats.requests == 40 and stats.calls == 10, (stats.requests, stats.calls)

    past_end = [loc._replace(etag="") for loc in apart[:5]] + [Location(path, len(blob) - 10, 1000, "")]
    reasons, held, stats = asyncio.run(fetch(past_end, "b"))
    assert reasons[:5] == [""] * 5 and held[:5] == [blob[loc.offset : loc.offset + 1000] for loc in apart[:5]]
    assert reasons[5] and "calls/blob.bin" in reasons[5], reasons

    another = [loc._replace(etag="not-its-etag") for loc in apart[:5]]
    reasons, _, _ = asyncio.run(fetch(another, "c"))
    assert all("changed since the server indexed it" in r and "calls/blob.bin" in r for r in reasons), reasons


def test_a_loader_error_names_a_server_whose_store_is_gone_for_good(cluster, data, run_bounded, tmp_path):
    """Past --store-timeout the samples fail, named, under on_error: the server survives."""
    s3 = LocalS3(tmp_path / "gone", buckets=("gone",)).start()
    import obstore
    from obstore.store import from_url

    obstore.put(from_url("s3://gone", client_options={"allow_http": "true"}, **_credentials(s3)),
                "x/a/1.jpg", (data.local["folder"] / "ant" / "ant_00000.jpg").read_bytes())
    i = cluster.add(["s3://gone/x"], "--store-timeout", "2", "--cache-dir", str(tmp_path / "c"), env=s3.env())
    s3.kill()
    with loader(cluster.address(i), batch_size=1) as L:
        with pytest.raises(LoaderError, match="the store failed for 2s of retries"):
            run_bounded(L, 60)
    assert cluster.servers[i].process.poll() is None, "the server died of its store"


def test_pack_writes_shards_and_their_indexes_to_a_bucket(data, tmp_path, monkeypatch):
    import subprocess
    import sys

    from remoteloader.server.formats import FormatOptions, open_shards

    env = {**os.environ, **data.s3.env()}
    done = subprocess.run([sys.executable, "-m", "remoteloader.tools.cli", "pack", data.path("folder"),
                           data.url("packed-by-pack/"), "--shard-size", "400000", "--quiet"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert data.url("packed-by-pack/") in done.stdout
    for key, value in data.s3.env().items():  # (obstore reads the process's environment)
        monkeypatch.setenv(key, value)
    local = open_shards([data.path("packed")])
    remote = open_shards([data.url("packed-by-pack")], FormatOptions(index_folder=str(tmp_path / "indexes")))
    assert [s.id for s in remote] == [s.id for s in local], "pack wrote other shards to the bucket"
    assert not list(tmp_path.glob("indexes/*")), "the uploaded indexes were not used"
    again = subprocess.run([sys.executable, "-m", "remoteloader.tools.cli", "pack", data.path("folder"),
                            data.url("packed-by-pack/"), "--quiet"], capture_output=True, text=True, timeout=120,
                           env=env)
    assert again.returncode == 2 and "is not empty" in again.stderr, again.stderr


def test_the_disk_cache_keeps_to_its_byte_limit_and_refetches_what_it_dropped(cluster, data, run_bounded,
                                                                             tmp_path):
    import urllib.request

    limit = 200_000  # a fraction of the ImageFolder's 48 images
    cache = tmp_path / "cache"
    i = cluster.add([data.bucket_path("folder")], "--disk-cache-bytes", str(limit), "--metrics-port", ANY_PORT,
                    "--cache-dir", str(cache), env=data.s3.env())
    port = cluster.metrics_port(i)

    def metric(name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))

    folder_bytes = sum(p.stat().st_size for p in data.local["folder"].rglob("*.jpg"))
    fetched = []
    with loader(cluster.address(i), prefetch=1, max_inflight=1) as L:
        for _ in range(2):
            ids = [int(v) for _x, _y, batch in run_bounded(L, 90) for v in batch]
            assert sorted(ids) == list(range(48))
            fetched.append(metric("remoteloader_store_fetched_bytes_total"))
            assert metric("remoteloader_disk_cache_bytes") <= limit
            on_disk = sum(p.stat().st_blocks * 512 for p in cache.glob("objects/*"))
            assert on_disk <= limit + 64 * 4096, on_disk  # (sparse files: blocks, not sizes)
    assert fetched[0] == folder_bytes, "the first epoch fetched other than each byte once"
    assert fetched[1] - fetched[0] > folder_bytes - limit, "what the limit dropped was not fetched again"


def test_a_first_epoch_fetches_its_samples_bytes_once_and_nothing_else(cluster, data, run_bounded, tmp_path):
    """From packed tars: each image's bytes once, not the whole tars (as fetching whole blocks
    would), and a second epoch nothing, the shards being within --disk-cache-bytes."""
    import tarfile
    import urllib.request

    i = cluster.add([data.url("packed")], "--metrics-port", ANY_PORT, "--cache-dir", str(tmp_path / "cache"),
                    env=data.s3.env())
    port = cluster.metrics_port(i)

    def fetched() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        name = "remoteloader_store_fetched_bytes_total"
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))

    images = tars = 0
    for path in data.local["packed"].glob("*.tar"):
        tars += path.stat().st_size
        with tarfile.open(path) as tar:
            images += sum(m.size for m in tar.getmembers() if m.name.endswith(".jpg"))
    with loader(cluster.address(i), shuffle=True) as L:
        epochs = []
        for _ in range(2):
            ids = [int(v) for _x, _y, batch in run_bounded(L, 90) for v in batch]
            assert sorted(ids) == list(range(48))
            epochs.append(fetched())
    # (the bytes between neighbouring images, under 64 KiB of tar headers, come with them)
    assert images <= epochs[0] < tars, f"the first epoch fetched {epochs[0]:.0f} bytes: images {images}, tars {tars}"
    assert epochs[1] == epochs[0], "a later epoch fetched again what the cache holds"
