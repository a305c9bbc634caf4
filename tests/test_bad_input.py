"""Files a server cannot decode, requests it cannot honour, and servers that are not there."""

from __future__ import annotations

import json
import time
import warnings

import cv2
import grpc
import numpy as np
import pytest

from remoteloader.client import LoaderError, RemoteLoader, SampleFailure
from remoteloader.protos import codec, loader_pb2, loader_pb2_grpc
from remoteloader.tools.textures import make_image, make_imagefolder

pytestmark = pytest.mark.timeout(120)

STREAM = "/remoteloader.v1.Loader/Stream"
SIZE = 32
MAX_IMAGE_SIZE = 96  # the server is started with --max-image-size 96
BAD = {
    "cat/broken.jpg": "truncated JPEG (its first half)",
    "cat/empty.jpg": "zero bytes",
    "cat/garbage.jpg": "not an image",
}
PNG = "cat/png.jpg"  # a PNG under a .jpg name: a supported format, so it must decode


class Data:
    def __init__(self, cluster, root, files, run_bounded):
        self.cluster = cluster
        self.address = cluster.address(0)
        self.root = root
        self.files = files  # key -> path
        self._run_bounded = run_bounded

    def delivered(self, loader, seconds: float = 60) -> dict[int, np.ndarray]:
        """One epoch (failing the test if it hangs): each delivered sample's pixels by id, once each."""
        out = {}
        for images, _labels, ids in self._run_bounded(loader, seconds):
            for image, i in zip(images.numpy(), ids.tolist()):
                assert i not in out, f"sample {i} delivered twice"
                out[i] = image
        return out

    @property
    def good(self) -> set[str]:
        return set(self.files) - set(BAD)


@pytest.fixture(scope="module")
def data(module_cluster, tmp_path_factory, run_bounded):
    root = make_imagefolder(tmp_path_factory.mktemp("bad"), ["cat", "dog"], 5, size=(64, 80), seed=3)
    valid = (root / "cat" / "cat_00000.jpg").read_bytes()
    (root / "cat" / "broken.jpg").write_bytes(valid[: len(valid) // 2])
    (root / "cat" / "empty.jpg").write_bytes(b"")
    (root / "cat" / "garbage.jpg").write_bytes(b"this is not an image, just some text\n" * 40)
    rgb = make_image(0, 2, np.random.default_rng(9), 64, 80)
    ok, png = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    assert ok and png.tobytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (root / PNG).write_bytes(png.tobytes())
    files = {f"{p.parent.name}/{p.name}": p for p in sorted(root.glob("*/*.jpg"))}
    assert set(BAD) | {PNG} <= set(files) and len(files) == 10 + len(BAD) + 1
    module_cluster.add(root, "--max-image-size", str(MAX_IMAGE_SIZE), "--allow-custom-pipelines")
    return Data(module_cluster, root, files, run_bounded)


def loader_for(data: Data, **kwargs) -> RemoteLoader:
    options = dict(batch_size=4, image_size=SIZE, pipeline="eval", drop_last=False, return_ids=True,
                   connect_timeout=20)
    options.update(kwargs)
    return RemoteLoader(data.address, **options)


def failures_by_key(data: Data) -> dict[str, SampleFailure]:
    """Runs an epoch with a callable on_error and returns what it was told, by key."""
    seen: list[SampleFailure] = []
    with loader_for(data, on_error=lambda failures: seen.extend(failures)) as loader:
        data.delivered(loader)
    return {f.key: f for f in seen}


# ---- per-sample failures ---------------------------------------------------------------
def test_default_on_error_raises_naming_key_and_reason_and_server_stays_up(data):
    reasons = {k: f.reason for k, f in failures_by_key(data).items()}
    with loader_for(data, batch_size=len(data.files)) as loader:  # one batch holds every sample
        with pytest.raises(LoaderError) as info:
            data.delivered(loader)
    message = str(info.value)
    for key in BAD:
        assert key in message, f"{key} missing from: {message}"
        assert reasons[key] and reasons[key] in message, f"reason for {key} missing from: {message}"
    assert PNG not in message
    assert data.address in message

    # The server is still up, and a fresh loader on it delivers the good samples.
    assert data.cluster.alive(0)
    with loader_for(data, on_error="skip") as loader:
        got = data.delivered(loader)
        assert {loader.sample_key(i) for i in got} == data.good


def test_loader_error_is_raised_by_the_batch_holding_the_bad_sample(data):
    with loader_for(data, shuffle=True, seed=0, batch_size=2) as loader:
        bad_ids = {i for i in range(loader.num_samples) if loader.sample_key(i) in BAD}
        assert len(bad_ids) == len(BAD)

        def first_bad_batch(epoch):
            return next(k for k, b in enumerate(loader.plan(epoch)) if bad_ids & set(b.tolist()))

        epoch = next(e for e in range(50) if first_bad_batch(e) >= 2)  # good batches come first
        loader.set_epoch(epoch)
        plan = loader.plan(epoch)
        first = first_bad_batch(epoch)
        served = []
        with pytest.raises(LoaderError) as info:
            for _images, _labels, ids in loader:
                served.extend(ids.tolist())
    assert served == np.concatenate(plan[:first]).tolist()
    named = [k for k in BAD if k in str(info.value)]
    culprits = {loader.sample_key(i) for i in plan[first].tolist()} & set(BAD)
    assert set(named) == culprits


def test_skip_delivers_every_good_sample_once_and_no_bad_one(data, eval_reference):
    with loader_for(data, on_error="skip", shuffle=True, seed=1) as loader, warnings.catch_warnings():
        warnings.simplefilter("error")  # skip is silent
        got = data.delivered(loader)
        keys = {i: loader.sample_key(i) for i in got}
    assert sorted(keys.values()) == sorted(data.good)
    # The PNG decoded like any image, and every delivered sample is its own file.
    for i, image in got.items():
        reference = eval_reference(data.files[keys[i]], SIZE).astype(np.float32)
        assert np.abs(reference - image.astype(np.float32)).mean() < 10, keys[i]


def test_warn_warns_about_each_bad_sample_and_skips_it(data):
    with loader_for(data, on_error="warn") as loader:
        with pytest.warns(UserWarning) as record:
            got = data.delivered(loader)
        keys = {loader.sample_key(i) for i in got}
    assert keys == data.good
    text = "\n".join(str(w.message) for w in record)
    for key in BAD:
        assert key in text
    assert PNG not in text


@pytest.mark.parametrize("pipeline", ["eval", "train"])
def test_callable_receives_sample_failures_and_batches_are_kept(data, pipeline):
    seen: list = []
    calls = []

    def on_error(failures):
        calls.append(len(failures))
        seen.extend(failures)

    with loader_for(data, pipeline=pipeline, on_error=on_error, shuffle=True, seed=4) as loader:
        got = data.delivered(loader)
        assert sorted(got) == list(range(loader.num_samples))  # nothing dropped
        assert all(n > 0 for n in calls)
        assert all(isinstance(f, SampleFailure) for f in seen)
        assert sorted(f.key for f in seen) == sorted(BAD)
        for f in seen:
            assert loader.sample_key(f.sample_id) == f.key
            assert isinstance(f.reason, str) and f.reason.strip()
            assert f.server == data.address
            assert not got[f.sample_id].any(), f"{f.key}: a failed sample's pixels are zero"
        bad_ids = {f.sample_id for f in seen}
        assert all(got[i].any() for i in got if i not in bad_ids)


@pytest.mark.parametrize("on_error", ["skip", "warn"])
def test_a_batch_of_only_failed_samples_is_left_out_with_a_warning(data, on_error):
    # len(loader) promises one batch per sample here; three batches hold nothing servable.
    with loader_for(data, on_error=on_error, batch_size=1) as loader, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yielded = len(data._run_bounded(loader, 60))
        assert yielded == len(loader) - len(BAD)
    left_out = [w for w in caught if "left out" in str(w.message)]
    assert len(left_out) == len(BAD), [str(w.message) for w in caught]
    assert all("fewer batches than len(loader)" in str(w.message) and "DDP" in str(w.message) for w in left_out)


def test_labels_of_good_samples_survive_skipping(data):
    checked = []
    with loader_for(data, on_error="skip", batch_size=3) as loader:
        for _images, labels, ids in data._run_bounded(loader, 60):
            for label, i in zip(labels.tolist(), ids.tolist(), strict=True):
                assert loader.class_names[label] == loader.sample_key(i).split("/")[0]
                checked.append(loader.sample_key(i))
    # Every good sample was checked, once (a loader that skipped every batch checks nothing).
    assert sorted(checked) == sorted(data.good)


# ---- the wire protocol ------------------------------------------------------------------
def describe(address: str) -> loader_pb2.DescribeResponse:
    with grpc.insecure_channel(address) as channel:
        return loader_pb2_grpc.LoaderStub(channel).Describe(loader_pb2.DescribeRequest(), timeout=10)


def open_stream(address: str, requests: list, timeout: float = 20):
    """Sends ``requests`` on a raw Stream, half-closes, and returns every chunk (or raises RpcError)."""
    with grpc.insecure_channel(address) as channel:
        method = channel.stream_stream(STREAM, request_serializer=loader_pb2.StreamRequest.SerializeToString,
                                       response_deserializer=codec.decode_chunk)
        return list(method(iter(requests), timeout=timeout))


@pytest.mark.parametrize("first", [b"\xff\xff\xff", b"\x0a\x04\x0a\x02\xff\xfe"], ids=["not protobuf", "bad UTF-8"])
def test_a_malformed_first_message_is_invalid_argument(data, first):
    with grpc.insecure_channel(data.address) as channel:
        method = channel.stream_stream(STREAM, request_serializer=lambda raw: raw,
                                       response_deserializer=codec.decode_chunk)
        with pytest.raises(grpc.RpcError) as info:
            list(method(iter([first]), timeout=20))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "malformed StreamRequest" in info.value.details()


def test_stream_refuses_an_unknown_pipeline_listing_the_offer(data):
    offer = describe(data.address)
    assert {"train", "eval"} <= set(offer.pipelines)
    with pytest.raises(grpc.RpcError) as info:
        open_stream(data.address, [loader_pb2.StreamRequest(setup=loader_pb2.Setup(pipeline="nope", height=SIZE,
                                                                                   width=SIZE))])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details()
    assert "nope" in details
    for name in offer.pipelines:
        assert name in details


@pytest.mark.parametrize("side", ["height", "width"])
def test_stream_refuses_a_size_over_max_image_size_listing_the_range(data, side):
    offer = describe(data.address)
    assert offer.max_image_size == MAX_IMAGE_SIZE  # the --max-image-size flag took effect
    size = {"height": SIZE, "width": SIZE, side: offer.max_image_size + 1}
    with pytest.raises(grpc.RpcError) as info:
        open_stream(data.address, [loader_pb2.StreamRequest(setup=loader_pb2.Setup(pipeline="train", **size))])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details()
    assert side in details
    assert str(offer.min_image_size) in details and str(offer.max_image_size) in details


def test_stream_reports_bad_samples_in_chunk_headers(data):
    offer = describe(data.address)
    (shard,) = offer.shards
    n = shard.num_samples
    chunks = open_stream(data.address, [
        loader_pb2.StreamRequest(setup=loader_pb2.Setup(pipeline="eval", height=SIZE, width=SIZE)),
        loader_pb2.StreamRequest(order=loader_pb2.Order(order_id=77, shard_ids=[shard.id], indices=list(range(n)))),
    ])
    assert chunks and all(c.header.order_id == 77 for c in chunks)
    assert sum(c.header.count for c in chunks) == n
    with grpc.insecure_channel(data.address) as channel:
        keys = list(loader_pb2_grpc.LoaderStub(channel).GetKeys(
            loader_pb2.GetKeysRequest(shard_id=shard.id, start=0, count=n), timeout=10).keys)
    assert sorted(keys) == sorted(data.files)
    errors = [e for c in chunks for e in c.header.errors]
    assert sorted(e.key for e in errors) == sorted(BAD)
    pixels = np.concatenate([np.frombuffer(c.pixels, np.uint8) for c in chunks]).reshape(n, SIZE, SIZE, 3)
    for e in errors:
        assert keys[e.index] == e.key and e.position == e.index  # the order asked for 0..n-1
        assert e.reason
        assert not pixels[e.position].any()


# ---- custom albumentations pipelines (the server runs with --allow-custom-pipelines) ----------
def custom_setup(compose, size: int) -> loader_pb2.StreamRequest:
    import albumentations as A

    return loader_pb2.StreamRequest(setup=loader_pb2.Setup(
        pipeline="custom", height=size, width=size, albumentations_json=json.dumps(A.to_dict(compose))))


def test_identical_custom_setups_at_once_share_one_check(data):
    import threading

    import albumentations as A

    size = 44  # a spec no other test sends: not cached yet
    slow = A.Compose([A.GlassBlur(sigma=0.7, max_delta=2, iterations=500, p=1.0), A.Resize(size, size)])
    shard = describe(data.address).shards[0].id
    results = []

    def stream() -> None:
        order = loader_pb2.StreamRequest(order=loader_pb2.Order(order_id=1, shard_ids=[shard], indices=[0]))
        results.append(sum(c.header.count for c in open_stream(data.address, [custom_setup(slow, size), order])))

    streams = [threading.Thread(target=stream) for _ in range(4)]
    for t in streams:
        t.start()
    for t in streams:
        t.join(60)
    assert results == [1, 1, 1, 1]
    checks = [line for line in data.cluster.stderr(0).splitlines() if f"pipeline custom {size}x{size} built" in line]
    assert len(checks) == 1, checks


def test_custom_pipeline_is_served(data):
    import albumentations as A

    assert describe(data.address).custom_pipelines
    with loader_for(data, pipeline=A.Compose([A.Resize(height=SIZE, width=SIZE)]), on_error="skip") as loader:
        got = data.delivered(loader)
        assert {loader.sample_key(i) for i in got} == data.good
    assert all(image.shape == (SIZE, SIZE, 3) and image.any() for image in got.values())


def test_custom_pipeline_of_the_wrong_size_is_refused(data):
    import albumentations as A

    wrong = A.Compose([A.Resize(height=SIZE // 2, width=SIZE // 2)])  # never the requested size
    with pytest.raises(grpc.RpcError) as info:
        open_stream(data.address, [custom_setup(wrong, SIZE)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{SIZE}x{SIZE}" in info.value.details()
    with loader_for(data, pipeline=wrong) as loader:
        with pytest.raises(LoaderError, match=f"{SIZE}x{SIZE}"):
            data.delivered(loader, seconds=30)


# A pipeline that raises on some inputs instead of returning an image: a center crop larger
# than small images. The server's set-up check runs it on a test image it cannot crop.
def _crashing_pipeline():
    import albumentations as A

    return A.Compose([A.CenterCrop(height=64, width=64)])


def test_custom_pipeline_that_raises_at_setup_is_invalid_argument(data):
    with pytest.raises(grpc.RpcError) as info:
        open_stream(data.address, [custom_setup(_crashing_pipeline(), 64)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (
        f"a pipeline the server cannot run is the client's error: got {info.value.code().name}: "
        f"{info.value.details()}")
    assert data.cluster.alive(0)


def test_client_fails_instead_of_retrying_forever_when_setup_is_refused(data):
    with loader_for(data, image_size=64, pipeline=_crashing_pipeline()) as loader:
        with pytest.raises((LoaderError, ValueError)):
            data.delivered(loader, seconds=20)


def test_client_refuses_an_unknown_pipeline_listing_the_offer(data):
    with pytest.raises(ValueError) as info:
        loader_for(data, pipeline="nope")
    message = str(info.value)
    assert "nope" in message and "train" in message and "eval" in message


def test_client_refuses_a_size_the_server_does_not_offer(data):
    with pytest.raises(ValueError) as info:
        loader_for(data, image_size=MAX_IMAGE_SIZE + 32)
    message = str(info.value)
    assert "image_size" in message and str(MAX_IMAGE_SIZE) in message


# ---- unreachable servers -----------------------------------------------------------------
def test_unreachable_server_raises_connection_error_in_time(closed_port):
    address = f"127.0.0.1:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(ConnectionError) as info:
        RemoteLoader(address, batch_size=4, image_size=SIZE, connect_timeout=2)
    elapsed = time.monotonic() - started
    assert address in str(info.value)
    assert elapsed < 10, f"took {elapsed:.1f}s with connect_timeout=2"


def test_one_unreachable_server_among_live_ones_is_named(data, closed_port):
    dead = f"127.0.0.1:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(ConnectionError) as info:
        RemoteLoader([data.address, dead], batch_size=4, image_size=SIZE, connect_timeout=2)
    assert dead in str(info.value)
    assert time.monotonic() - started < 10
