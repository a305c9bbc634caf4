"""Wire encodings (RemoteLoader(wire=...)): what users rely on when the pixels travel compressed.

* ``"zstd"`` is lossless: the same batches, bit for bit, as ``"raw"``, masks included, with
  either receiver.
* ``"jpeg95"`` is lossy but close (a PSNR bound per image); labels, ids and masks are exact.
* Exactly-once and failover hold with an encoded wire.
* Bytes from the wire are never trusted: a chunk whose encoded payload does not decode to
  exactly its rows fails that server's link with an error that says so, and the epoch
  completes from the orders sent again; the decoders refuse frames that claim another size.
* A server that does not offer the encoding, or a client without the decoder, is a clear
  error at construction.
"""

from __future__ import annotations

import collections
import pathlib
import sys

import numpy as np
import pytest
import torch
from conftest import Cluster

from remoteloader.client import RemoteLoader
from remoteloader.protos import codec, wire
from remoteloader.tools.local import LocalServer
from remoteloader.tools.shapes import make_coco
from remoteloader.tools.textures import make_imagefolder

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

SIZE = 64
BATCH = 8


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


# ---- the codec on its own ------------------------------------------------------------------
def photo(seed: int, h: int = SIZE, w: int = SIZE) -> np.ndarray:
    """A smooth image with some noise (a photo's statistics, roughly)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = 128 + 60 * np.sin(x / 9 + seed) + 40 * np.cos(y / 7)
    image = base[..., None] + np.asarray([0, 20, -20], np.float32) + rng.normal(0, 3, (h, w, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


@pytest.mark.parametrize("name", ["zstd", "jpeg95"])
def test_an_image_round_trips_exactly_with_zstd_and_closely_with_jpeg95(name):
    encoder = wire.Encoder(name)
    for seed in range(3):
        image = photo(seed)
        data = encoder.image(image)
        assert data is not None and len(data) < image.nbytes
        out = np.empty_like(image)
        wire.decode_part(name, memoryview(data), out, mask=False)
        if name == "zstd":
            assert np.array_equal(out, image)
        else:
            assert psnr(out, image) > 30


def test_an_image_that_would_not_shrink_travels_raw():
    noise = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    assert wire.Encoder("zstd").image(noise) is None
    assert wire.Encoder("jpeg95").image(noise[:2, :2]) is None  # a JPEG's tables alone are larger


def test_masks_round_trip_exactly_under_every_encoding():
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[10:30, 5:50] = 3
    mask[40:, :] = 255
    for name in ("zstd", "jpeg95"):
        data = wire.Encoder(name).mask(mask)
        assert data is not None and len(data) < mask.nbytes // 10
        out = np.empty_like(mask)
        wire.decode_part(name, memoryview(data), out, mask=True)
        assert np.array_equal(out, mask)


def test_decoders_refuse_what_does_not_decode_to_exactly_the_row():
    image = photo(1)
    out = np.empty_like(image)
    small = np.empty((SIZE // 2, SIZE, 3), np.uint8)
    frame = wire.Encoder("zstd").image(image)
    jpeg = wire.Encoder("jpeg95").image(image)
    assert frame is not None and jpeg is not None
    with pytest.raises(ValueError, match="holds 12288 bytes, expected 6144"):  # a frame claiming more
        wire.decode_part("zstd", memoryview(frame), small, mask=False)
    with pytest.raises(ValueError, match="zstd"):
        wire.decode_part("zstd", memoryview(frame[: len(frame) // 2]), out, mask=False)
    with pytest.raises(ValueError, match=f"JPEG is {SIZE}x{SIZE}, expected {SIZE // 2}x{SIZE}"):
        wire.decode_part("jpeg95", memoryview(jpeg), small, mask=False)
    for bad in (jpeg[: len(jpeg) // 2], b"\xff\xd8" + bytes(100), bytes(50)):
        with pytest.raises(ValueError, match="bad JPEG"):
            wire.decode_part("jpeg95", memoryview(bad), out, mask=False)


def test_encoded_sizes_must_fit_the_chunk():
    image, mask = SIZE * SIZE * 3, SIZE * SIZE
    assert wire.parts([10, image, 0], 3, image, 0, 10 + image) == [(0, 10), (10, image), (10 + image, 0)]
    with pytest.raises(ValueError, match="2 encoded sizes for 3"):
        wire.parts([10, 10], 3, image, 0, 20)
    with pytest.raises(ValueError, match="larger than its raw"):
        wire.parts([image + 1], 1, image, 0, image + 1)
    with pytest.raises(ValueError, match="larger than its raw"):
        wire.parts([10, mask + 1], 1, image, mask, mask + 11)
    with pytest.raises(ValueError, match="add up to 20 bytes, the payload has 21"):
        wire.parts([10, 10], 2, image, 0, 21)


# ---- end to end ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """0, 1: replicas of one ImageFolder (slowed, so orders are in flight when one dies);
    2: a COCO file with masks."""
    root = tmp_path_factory.mktemp("wire-data")
    folder = make_imagefolder(root / "folder", ["a", "b", "c"], 16, size=(80, 96), seed=5)
    coco = make_coco(root / "coco", 20, seed=1)
    with Cluster(tmp_path_factory.mktemp("wire-logs"), args=("--workers", "2")) as cluster:
        cluster.add_many([folder, folder], "--max-rate", "200")
        cluster.add(coco, "--coco-masks", "true")
        yield cluster


def epoch(address, **kwargs) -> list:
    options = dict(batch_size=BATCH, image_size=SIZE, seed=7, drop_last=False, return_ids=True)
    options.update(kwargs)
    with RemoteLoader(address, **options) as loader:
        return [b if isinstance(b, dict) else tuple(b) for b in loader]


def ids_of(batches) -> list[int]:
    return torch.cat([b["ids"] if isinstance(b, dict) else b[2] for b in batches]).tolist()


def test_zstd_gives_the_same_batches_bit_for_bit_with_both_receivers(servers):
    address = servers.address(0)
    raw = epoch(address, wire="raw")
    assert len(ids_of(raw)) == 48
    for receiver in ("thread", "process"):
        got = epoch(address, wire="zstd", receiver=receiver)
        assert len(got) == len(raw)
        for (x, y, i), (xr, yr, ir) in zip(got, raw):
            assert torch.equal(i, ir) and torch.equal(y, yr)
            assert torch.equal(x, xr), f"receiver={receiver}: pixels differ from the raw wire's"


def test_jpeg95_is_close_and_its_labels_and_ids_are_exact(servers):
    address = servers.address(0)
    raw = epoch(address, wire="raw")
    got = epoch(address, wire="jpeg95")
    assert len(got) == len(raw)
    worst = float("inf")
    for (x, y, i), (xr, yr, ir) in zip(got, raw):
        assert torch.equal(i, ir) and torch.equal(y, yr)
        worst = min([worst, *(psnr(a, b) for a, b in zip(x.numpy(), xr.numpy()))])
    assert 30 < worst < float("inf"), f"worst PSNR {worst:.1f} dB"


@pytest.mark.parametrize("name", ["zstd", "jpeg95"])
def test_masks_and_targets_stay_exact_under_every_encoding(servers, name):
    address = servers.address(2)
    fields = ["mask", "masks", "bboxes", "bbox_labels"]  # (a COCO server: no class label; instance masks too)
    raw = epoch(address, wire="raw", pipeline="segmentation-train", fields=fields)
    got = epoch(address, wire=name, pipeline="segmentation-train", fields=fields)
    assert len(got) == len(raw)
    assert any(r["mask"].any() for r in raw), "the test data should have masks"
    for b, r in zip(got, raw):
        assert set(b) == set(r)
        for key in set(r) - {"images"}:
            if isinstance(r[key], torch.Tensor):
                assert torch.equal(b[key], r[key]), key
            else:
                assert all(torch.equal(x, y) for x, y in zip(b[key], r[key])), key
        if name == "zstd":
            assert torch.equal(b["images"], r["images"])


def test_sigkill_of_a_replica_mid_epoch_loses_and_duplicates_nothing_with_zstd(servers):
    target = f"{servers.address(0)},{servers.address(1)}"
    reference = epoch(target, wire="raw")
    with RemoteLoader(
        target, batch_size=BATCH, image_size=SIZE, seed=7, drop_last=False, return_ids=True, wire="zstd",
        connect_timeout=20,
    ) as loader:
        it = iter(loader)
        got = [tuple(next(it)) for _ in range(2)]
        servers.kill(1)
        got += [tuple(b) for b in it]
    counts = collections.Counter(ids_of(got))
    assert sorted(counts) == list(range(48)) and set(counts.values()) == {1}
    for (x, y, i), (xr, yr, ir) in zip(got, reference):
        assert torch.equal(i, ir) and torch.equal(y, yr) and torch.equal(x, xr)
    servers.restart(1)


def test_a_bad_encoded_payload_fails_that_link_with_a_clear_error_and_the_epoch_completes(
    servers, monkeypatch, caplog
):
    """The first chunk's payload is corrupted as it is received: its link fails naming the
    encoding and what was wrong, reconnects, and the orders sent again give the same epoch."""
    address = servers.address(0)
    reference = epoch(address, wire="zstd")
    real = codec.decode_chunk
    corrupted = []

    def corrupt(data: bytes):
        header, pixels = real(data)
        if not corrupted and header.encoded_sizes and header.encoded_sizes[0] < SIZE * SIZE * 3:
            corrupted.append(header.order_id)
            bad = bytearray(pixels)
            bad[: header.encoded_sizes[0]] = bytes(header.encoded_sizes[0])  # zeros: no zstd frame
            return codec.DecodedChunk(header, memoryview(bytes(bad)))
        return header, pixels

    monkeypatch.setattr(codec, "decode_chunk", corrupt)
    options = dict(batch_size=BATCH, image_size=SIZE, seed=7, drop_last=False, return_ids=True)
    with RemoteLoader(address, wire="zstd", receiver="thread", reconnect_timeout=30, **options) as loader:
        got = [tuple(b) for b in loader]
        stats = loader.stats()["servers"][address]
    assert corrupted, "no chunk was corrupted"
    assert stats["failures"] == 1, stats
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage() and address in r.getMessage()]
    assert failed and f"bad zstd chunk from {address}" in failed[0] and "bad zstd frame" in failed[0], failed
    assert len(got) == len(reference)
    for (x, y, i), (xr, yr, ir) in zip(got, reference):
        assert torch.equal(i, ir) and torch.equal(y, yr) and torch.equal(x, xr)


def test_a_server_that_does_not_offer_the_encoding_is_refused_at_construction(tmp_path):
    blocked = tmp_path / "blocked"
    (blocked / "zstandard").mkdir(parents=True)
    (blocked / "zstandard" / "__init__.py").write_text("raise ImportError('zstandard is blocked in this test')\n")
    data = make_imagefolder(tmp_path / "data", ["a"], 4, size=(48, 48), seed=1)
    server = LocalServer([str(data)], env={"PYTHONPATH": str(blocked)}, args=["--workers", "1"]).start()
    try:
        with pytest.raises(ValueError, match=r"wire='zstd': loader server .* offers raw \("):
            RemoteLoader(server.address, batch_size=2, image_size=32, wire="zstd")
        with RemoteLoader(server.address, batch_size=2, image_size=32, wire="raw") as loader:
            assert sum(len(labels) for _, labels in loader) == 4
    finally:
        server.stop()


def test_a_client_without_the_decoder_or_with_an_unknown_wire_is_told_at_construction(monkeypatch):
    with pytest.raises(ValueError, match="wire='png': expected one of raw, zstd, jpeg95"):
        RemoteLoader("127.0.0.1:1", wire="png")
    monkeypatch.setitem(sys.modules, "simplejpeg", None)  # an import of it raises ImportError
    with pytest.raises(ValueError, match=r"needs the simplejpeg package: pip install 'remoteloader\[wire\]'"):
        RemoteLoader("127.0.0.1:1", wire="jpeg95")


def test_the_lossy_choice_is_named_lossy():
    assert wire.LOSSY == {"jpeg95"}
    guide = (pathlib.Path(__file__).parents[1] / "docs" / "operator-guide.md").read_text()
    assert "lossy" in guide[guide.index("## Wire choices") :].lower()
