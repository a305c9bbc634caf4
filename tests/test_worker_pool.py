"""The decode worker pool end to end (``server/worker_pool.py``, ``server/worker_process.py``),
with what shares its servers: the RAM cache of encoded samples (``--cache-bytes``,
``server/shared_memory.py``), the synthetic transport mode (``--synthetic``) and ``--max-rate``
(``server/rate_limit.py``). One module-wide set of real servers on 127.0.0.1:

    workers   --workers 2 on DATA (image_size 16: the whole order is one chunk of many tasks)
    cached    --cache-bytes 10 MB on CACHED (a copy of DATA whose files a test deletes)
    plain     no cache and --region-decode false, on CACHED too (the reference for the cached
              server's pixels)
    small     a cache too small for SMALL (another copy of DATA, also deleted)
    rate      --max-rate 100 on RATE (150 samples)
    synthetic --synthetic 50 and no --data (started by hand: Cluster always passes --data)
"""

from __future__ import annotations

import hashlib
import pathlib
import shutil
import signal
import time

import numpy as np
import pytest

from remoteloader.client import RemoteLoader
from remoteloader.server import decode as dec
from remoteloader.server.pipelines import Pipeline, PipelineSpec
from remoteloader.server.seeds import sample_seeds
from remoteloader.tools.textures import make_imagefolder

pytestmark = pytest.mark.timeout(120)

CLASSES = ["ant", "bee", "cat"]
PER_CLASS = 12  # 36 samples
SIZE = 16
SEED = 7
CACHE_BYTES = 10_000_000
RATE, RATE_SAMPLES = 100, 150
SYNTHETIC = 50


class Synthetic:
    """A server started by hand: ``--synthetic N`` without ``--data``."""

    def __init__(self, log_dir: pathlib.Path):
        from remoteloader.tools.local import ServerProcess, server_command

        argv = server_command() + ["--synthetic", str(SYNTHETIC), "--host", "127.0.0.1", "--port", "0",
                                   "--workers", "1", "--grace", "2"]
        self.process = ServerProcess(argv, log_dir / "synthetic.log")
        self.address = None

    def wait(self) -> str:
        self.address = f"127.0.0.1:{self.process.wait_ready(60)}"
        return self.address

    def close(self) -> None:
        self.process.signal(signal.SIGTERM)
        self.process.wait(10)
        self.process.reap()


@pytest.fixture(scope="module")
def servers(module_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("fast-data")
    data = make_imagefolder(root / "data", CLASSES, PER_CLASS, size=(40, 56), seed=1, jitter=0.2)
    cached = root / "cached"
    small = root / "small"
    shutil.copytree(data, cached)
    shutil.copytree(data, small)
    rate = make_imagefolder(root / "rate", CLASSES, RATE_SAMPLES // len(CLASSES), size=(24, 32), seed=2)
    sizes = sorted(p.stat().st_size for p in small.rglob("*.jpg"))
    small_cache = sum(sizes) // 2
    synthetic = Synthetic(root)
    try:
        c = module_cluster
        names = {}
        names["workers"] = c.add(data, "--workers", "2", wait=False)
        names["cached"] = c.add(cached, "--cache-bytes", str(CACHE_BYTES), wait=False)
        names["plain"] = c.add(cached, "--region-decode", "false", wait=False)
        names["small"] = c.add(small, "--cache-bytes", str(small_cache), wait=False)
        names["rate"] = c.add(rate, "--max-rate", str(RATE), wait=False)
        for i in names.values():
            c.wait_ready(i, timeout=60)
        addresses = {k: c.address(i) for k, i in names.items()}
        pids = {k: c.pid(i) for k, i in names.items()}
        addresses["synthetic"] = synthetic.wait()
        yield {"root": root, "data": data, "cached": cached, "small": small, "small_cache": small_cache,
               "rate": rate, "address": addresses, "pid": pids, "cluster": c, "index": names}
    finally:
        synthetic.close()


def loader(address: str, **kwargs) -> RemoteLoader:
    options = dict(batch_size=64, image_size=SIZE, seed=SEED, shuffle=False, drop_last=False, return_ids=True,
                   connect_timeout=20, reconnect_timeout=5)
    options.update(kwargs)
    return RemoteLoader(address, **options)


def collect(run_bounded, ld: RemoteLoader, seconds: float = 40) -> dict[int, tuple[np.ndarray, int]]:
    """One epoch as {sample id: (pixels, label)}, failing on a duplicate id."""
    out = {}
    for images, labels, ids in run_bounded(ld, seconds):
        for image, label, i in zip(images.numpy(), labels.tolist(), ids.tolist()):
            assert i not in out, f"sample {i} delivered twice"
            out[i] = (image.copy(), label)
    return out


def session_processes(sid: int) -> set[int]:
    """Pids in a session (the server runs in its own: its forkserver and workers are there too)."""
    pids = set()
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.add(int(entry.name))
    return pids


def shard_key(shard_id: str) -> int:
    return int(hashlib.sha256(shard_id.encode()).hexdigest()[:16], 16)


def test_worker_pool_serves_every_sample_once_with_locally_reproducible_pixels(servers, run_bounded):
    root = servers["data"]
    with loader(servers["address"]["workers"], batch_size=40, shuffle=True) as ld:
        assert ld.num_samples == len(CLASSES) * PER_CLASS
        assert ld.class_names == CLASSES
        (shard,) = ld.catalog.shards
        reference = Pipeline(PipelineSpec("train", SIZE, SIZE))
        server_pid = servers["pid"]["workers"]
        processes = session_processes(server_pid)
        # The server, its forkserver and two workers (perhaps a resource tracker).
        forked = [p for p in processes if b"forkserver" in pathlib.Path(f"/proc/{p}/cmdline").read_bytes()]
        assert server_pid in processes and len(forked) >= 3, processes
        for epoch in (0, 1):
            ld.set_epoch(epoch)
            got = collect(run_bounded, ld)
            assert sorted(got) == list(range(ld.num_samples)), "not every sample exactly once"
            for i, (image, label) in got.items():
                key = ld.sample_key(i)
                assert CLASSES[label] == key.split("/")[0], f"sample {i} {key!r} has label {label}"
                seed = sample_seeds(SEED, epoch, shard_key(shard.id), np.asarray([i - shard.offset]))[0]
                expected = reference((root / key).read_bytes(), seed)
                assert np.array_equal(image, expected), f"epoch {epoch} sample {i} {key!r}: pixels differ"
            if epoch == 0:
                first = got
        # The workers are persistent: no process was started or ended for the epochs.
        assert session_processes(server_pid) == processes
        # A new epoch draws new augmentations.
        changed = sum(not np.array_equal(first[i][0], got[i][0]) for i in got)
        assert changed > len(got) // 2


def test_worker_pool_eval_pixels_match_reference(servers, run_bounded):
    root = servers["data"]
    with loader(servers["address"]["workers"], pipeline="eval", batch_size=36, image_size=(16, 24)) as ld:
        got = collect(run_bounded, ld)
        assert sorted(got) == list(range(36))
        for i, (image, label) in got.items():
            key = ld.sample_key(i)
            expected = Pipeline(PipelineSpec("eval", 16, 24))((root / key).read_bytes(), 0)
            assert np.array_equal(image, expected), f"sample {i} {key!r}: pixels differ"
            assert CLASSES[label] == key.split("/")[0]


def test_region_decode_off_serves_the_same_pixels(servers, run_bounded):
    """--region-decode false is taken (and logged); whole-image decoding serves the same pixels."""
    c, index = servers["cluster"], servers["index"]
    assert "JPEG crops: whole images (--region-decode off)" in c.stderr(index["plain"])
    built = "crop regions only, with the rest of a file entropy-decoded too until it has decoded" if dec._jpeg \
        is not None else "whole images (simplejpeg"
    assert f"JPEG crops: {built}" in c.stderr(index["workers"])
    root = servers["cached"]
    with loader(servers["address"]["plain"]) as ld:
        got = collect(run_bounded, ld)
        assert sorted(got) == list(range(36))
        (shard,) = ld.catalog.shards
        for i, (image, _label) in got.items():
            seed = sample_seeds(SEED, 0, shard_key(shard.id), np.asarray([i - shard.offset]))[0]
            expected = Pipeline(PipelineSpec("train", SIZE, SIZE))((root / ld.sample_key(i)).read_bytes(), seed)
            assert np.array_equal(image, expected), f"sample {i}: pixels differ"


def test_a_damaged_file_fails_in_every_epoch_though_the_region_decoder_would_take_it(cluster, tmp_path,
                                                                                      run_bounded):
    """The region decoder is used only for files that decoded whole before (and were not written
    since the server indexed them), so a damaged file is refused every epoch, not only in the
    epochs whose crop reaches the damage: a file cut near its end from the start, and a file
    damaged in place (same length) after it decoded cleanly in epoch 0."""
    root = make_imagefolder(tmp_path / "data", ["a", "b"], 4, size=(120, 160), seed=4)
    cut = root / "a" / "a_00000.jpg"
    whole = cut.read_bytes()
    cut.write_bytes(whole[: len(whole) * 9 // 10])  # its last rows are gone
    cluster.add(root)
    epochs, failures = 5, []
    with loader(cluster.address(0), batch_size=4, on_error=failures.extend) as ld:
        (shard,) = ld.catalog.shards
        ids = {ld.sample_key(i): i for i in range(ld.num_samples)}
        reference = Pipeline(PipelineSpec("train", SIZE, SIZE))

        def seed(key: str, epoch: int) -> int:
            return sample_seeds(SEED, epoch, shard_key(shard.id), np.asarray([ids[key] - shard.offset]))[0]

        def damage(data: bytes) -> bytes:  # the last 10% zeroed: the same length
            return data[: len(data) * 9 // 10] + bytes(len(data) - len(data) * 9 // 10)

        # The file to damage after epoch 0: one whose epoch-1 crop misses the damage, so that
        # only the check of the file's modification time can refuse it in epoch 1.
        later = None
        for key in (k for k in ids if k.startswith("b/")):
            try:
                reference(damage((root / key).read_bytes()), seed(key, 1), verified=True)
                later = root / key
                break
            except dec.DecodeError:
                continue
        if dec._jpeg is not None:
            assert later is not None, "every crop reaches the damage: the test would show nothing"
        else:
            later = root / "b" / "b_00000.jpg"
        served = {"a/a_00000.jpg": 0, f"b/{later.name}": 0}  # epochs the region decoder alone would serve it
        for epoch in range(epochs):
            if epoch == 1:
                later.write_bytes(damage(later.read_bytes()))
            ld.set_epoch(epoch)
            failures.clear()
            got = collect(run_bounded, ld)
            expected = ["a/a_00000.jpg"] + ([f"b/{later.name}"] if epoch else [])
            assert sorted(f.key for f in failures) == expected, f"epoch {epoch}: {failures}"
            assert sorted(got) == list(range(ld.num_samples))  # the failed ones as zeros
            for key in expected:
                assert not got[ids[key]][0].any()
                if epoch and dec._jpeg is not None:
                    try:  # what the region decoder would have made of it this epoch
                        reference((root / key).read_bytes(), seed(key, epoch), verified=True)
                        served[key] += 1
                    except dec.DecodeError:
                        pass
    if dec._jpeg is not None:
        assert all(served.values()), f"some file's crops all reached its damage: the test shows nothing {served}"


def test_first_epoch_region_decodes_serve_and_fail_as_whole_decodes(cluster, tmp_path, run_bounded):
    """A file not yet known to decode has its crop's region decoded with the rest of the file read
    (decode.decode_crop(whole=True)): its pixels are a whole decode's from the first epoch on, and
    a file damaged only outside its crops fails with a whole decode's reason in the first epoch
    and in the next, though the region alone would take it in both."""
    root = make_imagefolder(tmp_path / "data", ["a", "b"], 4, size=(120, 160), seed=5)
    spec = PipelineSpec("train", SIZE, SIZE)
    whole, region_alone = Pipeline(spec, region_decode=False), Pipeline(spec)
    cluster.add(root)
    failures = []
    with loader(cluster.address(0), batch_size=4, on_error=failures.extend) as ld:
        (shard,) = ld.catalog.shards
        ids = {ld.sample_key(i): i for i in range(ld.num_samples)}

        def seed(key: str, epoch: int) -> int:
            return sample_seeds(SEED, epoch, shard_key(shard.id), np.asarray([ids[key] - shard.offset]))[0]

        def damaged(key: str) -> bytes:  # its last tenth zeroed, EOI included: the same length
            data = (root / key).read_bytes()
            return data[: len(data) * 9 // 10] + bytes(len(data) - len(data) * 9 // 10)

        def reason(data: bytes, key: str, epoch: int) -> str | None:
            try:
                whole(data, seed(key, epoch))
            except dec.DecodeError as exc:
                return str(exc)
            return None

        def blind(key: str) -> bool:  # both epochs' crops miss the damage
            try:
                return all(region_alone(damaged(key), seed(key, e), verified=True) is not None for e in (0, 1))
            except dec.DecodeError:
                return False

        if dec._jpeg is not None:
            bad = next((k for k in ids if blind(k)), None)
            assert bad is not None, "every file's crops reach the damage: the test would show nothing"
        else:
            bad = next(iter(ids))
        expected = [reason(damaged(bad), bad, e) for e in (0, 1)]
        assert all(expected), expected
        (root / bad).write_bytes(damaged(bad))
        for epoch in (0, 1):
            ld.set_epoch(epoch)
            failures.clear()
            got = collect(run_bounded, ld)
            assert [(f.key, f.reason) for f in failures] == [(bad, expected[epoch])], f"epoch {epoch}"
            for key, i in ids.items():
                if key != bad:
                    reference = whole((root / key).read_bytes(), seed(key, epoch))
                    assert np.array_equal(got[i][0], reference), f"epoch {epoch}, {key}: not a whole decode's pixels"


def eval_epoch(run_bounded, address: str, **kwargs) -> dict[str, tuple[np.ndarray, int]]:
    """An eval epoch by key, and the failures reported: ({key: (pixels, label)}, [SampleFailure]).

    Each sample is read and decoded anew (share=False): not joined from what the server kept
    of an earlier epoch of the same plan (server/sharing.py), so the files' and the cache's
    states are what the tests see."""
    failures = []
    with loader(address, pipeline="eval", on_error=failures.extend, share=False, **kwargs) as ld:
        got = collect(run_bounded, ld)
        by_key = {ld.sample_key(i): v for i, v in got.items()}
    return by_key, failures


def test_cache_serves_from_memory_after_the_first_epoch(servers, run_bounded):
    cached, plain = servers["address"]["cached"], servers["address"]["plain"]
    root = servers["cached"]
    files = sorted(root.rglob("*.jpg"))
    reference, failures = eval_epoch(run_bounded, plain)
    assert not failures and len(reference) == len(files)
    first, failures = eval_epoch(run_bounded, cached)
    assert not failures
    assert first.keys() == reference.keys()
    for key, (image, label) in reference.items():
        assert np.array_equal(first[key][0], image) and first[key][1] == label
    second, failures = eval_epoch(run_bounded, cached)
    assert not failures
    for key, (image, label) in reference.items():
        assert np.array_equal(second[key][0], image) and second[key][1] == label
    # The files are gone or changed: only the cache can serve them now.
    for n, path in enumerate(files):
        if n % 2:
            path.unlink()
        else:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    third, failures = eval_epoch(run_bounded, cached)
    assert not failures, f"the cache did not serve: {failures[:3]}"
    assert third.keys() == reference.keys()
    for key, (image, label) in reference.items():
        assert np.array_equal(third[key][0], image) and third[key][1] == label
    # The uncached server really sees the damage.
    _, failures = eval_epoch(run_bounded, plain)
    assert len(failures) == len(files)


def test_cache_too_small_serves_cached_files_and_fails_the_others(servers, run_bounded):
    address, root, capacity = servers["address"]["small"], servers["small"], servers["small_cache"]
    sizes = {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*.jpg")}
    first, failures = eval_epoch(run_bounded, address)
    assert not failures and first.keys() == sizes.keys()
    for path in root.rglob("*.jpg"):
        path.unlink()
    second, failures = eval_epoch(run_bounded, address)
    failed = {f.key for f in failures}
    served = set(second) - failed
    assert failed and served, f"{len(failed)} failed, {len(served)} served"
    assert failed | served == set(sizes)
    assert sum(sizes[k] for k in served) <= capacity  # only what fits in the cache is served
    for f in failures:
        assert "No such file" in f.reason or "changed" in f.reason, f.reason
    for key in served:
        assert np.array_equal(second[key][0], first[key][0]), f"{key}: cached pixels differ"
        assert second[key][1] == first[key][1]


def test_synthetic_mode_serves_generated_pixels(servers, run_bounded):
    with loader(servers["address"]["synthetic"], batch_size=8, image_size=24) as ld:
        assert ld.num_samples == SYNTHETIC
        classes = len(ld.class_names)
        assert classes > 0
        got = collect(run_bounded, ld)
        assert sorted(got) == list(range(SYNTHETIC))
        for image, label in got.values():
            assert 0 <= label < classes
            assert image.shape == (24, 24, 3)
        pixels = np.stack([image for image, _ in got.values()])
        assert pixels.any(), "synthetic pixels are all zeros"
        assert pixels.std() > 10


def test_max_rate_bounds_throughput(servers, run_bounded):
    with loader(servers["address"]["rate"], batch_size=10, image_size=SIZE) as ld:
        assert ld.num_samples == RATE_SAMPLES
        started = time.monotonic()
        got = collect(run_bounded, ld, seconds=60)
        elapsed = time.monotonic() - started
    assert len(got) == RATE_SAMPLES
    assert elapsed >= 1.0, f"{RATE_SAMPLES} samples at --max-rate {RATE} took only {elapsed:.2f}s"
