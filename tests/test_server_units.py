"""Server pieces in isolation: cache bookkeeping, catalog parsing, config from the environment, pipeline caps."""

from __future__ import annotations

import io
import json
import os
import pathlib
import subprocess
import sys
import tarfile

import pytest

from remoteloader.server.fair_queue import Job
from remoteloader.server.formats import open_shards, read_classes
from remoteloader.server.formats.index import INDEX_SUFFIX
from remoteloader.server.formats.tar import TarShard
from remoteloader.server.storage import open_storage


def test_a_failed_cache_fill_keeps_its_space_for_the_next_try(tmp_path):
    from remoteloader.server.shared_memory import SampleCache

    cache = SampleCache(1000, 4)
    try:
        for _ in range(5):  # a corrupt file requested again and again
            mode, offset = cache.plan(0, 300)
            assert (mode, offset) == (1, 0)
            cache.filled(0, offset, ok=False)
        assert cache.used == 300
        assert cache.plan(1, 300) == (1, 300)  # the rest of the cache is still there
        cache.filled(1, 300, ok=True)
        assert cache.plan(1, 300) == (2, 300)
    finally:
        cache.close()


def test_a_sample_file_that_changed_since_indexing_is_an_error_not_other_bytes(tmp_path):
    from remoteloader.server.decode import DecodeError
    from remoteloader.server.sample_reads import read_sample

    path = tmp_path / "a.jpg"
    path.write_bytes(b"0123456789")
    assert read_sample(str(path), 0, 10)[0] == b"0123456789"  # a whole file
    assert read_sample(str(path), 3, 4)[0] == b"3456"  # a tar member
    assert read_sample(str(path), 0, 10)[1] == path.stat().st_mtime_ns
    for indexed_length in (11, 9):  # the file shrank, or grew, since the server indexed it
        with pytest.raises(DecodeError, match="changed since the server indexed it"):
            read_sample(str(path), 0, indexed_length)
    with pytest.raises(DecodeError, match="changed since"):
        read_sample(str(path), 8, 4)  # a member now past the end


def test_a_workers_task_keeps_a_few_files_open_and_closes_them_all(tmp_path):
    """A decode worker's task reads its samples through SampleFiles: the same bytes and checks as
    read_sample, with at most KEEP descriptors held, and none once the task is done."""
    from remoteloader.server.decode import DecodeError
    from remoteloader.server.sample_reads import SampleFiles, read_sample

    paths = []
    for k in range(SampleFiles.KEEP + 3):
        paths.append(str(tmp_path / f"shard-{k}"))
        pathlib.Path(paths[-1]).write_bytes(bytes(range(k, k + 200)))

    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = descriptors()
    with SampleFiles() as files:
        for _ in range(3):
            for path in paths:
                assert files.read(path, 5, 40) == read_sample(path, 5, 40)
                assert descriptors() - before <= SampleFiles.KEEP
        with pytest.raises(DecodeError, match="changed since"):
            files.read(paths[0], 0, 150)  # a whole file that is not this size any more
    assert descriptors() == before


def test_classes_txt_without_a_final_newline_or_with_crlf(tmp_path):
    (tmp_path / "classes.txt").write_bytes(b"cat\r\ndog")
    assert read_classes(*open_storage(str(tmp_path))) == ["cat", "dog"]


def _tar(path, members):
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_a_damaged_sidecar_index_is_ignored(tmp_path):
    tar = _tar(tmp_path / "a.tar", [("x/1.jpg", b"\xff\xd8\xff" + b"0" * 50), ("x/1.cls", b"3")])
    first = TarShard(*open_storage(str(tar)), [])
    sidecar = tmp_path / ("a.tar" + INDEX_SUFFIX)
    assert sidecar.is_file()
    sidecar.write_bytes(sidecar.read_bytes()[:100])  # truncated
    again = TarShard(*open_storage(str(tar)), [])
    assert again.id == first.id and again.labels.tolist() == [3]


def test_class_names_are_part_of_the_shard_id(tmp_path):
    tar = _tar(tmp_path / "a.tar", [("x/1.jpg", b"\xff\xd8\xff" + b"0" * 50), ("x/1.cls", b"0")])
    assert TarShard(*open_storage(str(tar)), ["cat"]).id != TarShard(*open_storage(str(tar)), ["dog"]).id
    for folder, classes in (("one", ["a"]), ("two", ["a", "b"])):  # an extra, empty class folder
        for cls in classes:
            (tmp_path / folder / cls).mkdir(parents=True)
        (tmp_path / folder / "a" / "1.jpg").write_bytes(b"\xff\xd8\xff")
    assert open_shards([str(tmp_path / "one")])[0].id != open_shards([str(tmp_path / "two")])[0].id


def test_files_an_image_folder_cannot_serve_are_counted_in_a_warning(tmp_path, caplog):
    for cls, names in (("cat", ["1.jpg", "2.JPEG", "3.webp", "4.webp", "notes"]), ("dog", ["5.png", ".DS_Store"])):
        (tmp_path / cls).mkdir()
        for name in names:
            (tmp_path / cls / name).write_bytes(b"\xff\xd8\xff")
    shard = open_shards([str(tmp_path)])[0]
    assert sorted(shard.key(i) for i in range(len(shard))) == ["cat/1.jpg", "cat/2.JPEG", "dog/5.png"]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "left out 3 file(s)" in warned[0] and "2 '.webp', 1 ''" in warned[0], warned


def test_a_bad_environment_variable_is_a_usage_error(tmp_path):
    env = {**os.environ, "REMOTELOADER_WORKERS": "abc"}
    result = subprocess.run([sys.executable, "-m", "remoteloader.server.cli", "--data", str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 2
    assert "--workers: invalid int value: 'abc'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("transforms", [
    [{"__class_fullname__": "Resize", "height": 100000, "width": 100000}],
    [{"__class_fullname__": "GaussianBlur", "blur_limit": [3, 9999]}],
])
def test_custom_pipelines_with_absurd_sizes_are_refused_before_they_run(transforms):
    from remoteloader.server.pipelines import Pipeline, PipelineError, PipelineSpec

    document = {"__version__": "2.0.8", "transform": {"__class_fullname__": "Compose", "p": 1.0,
                                                        "transforms": transforms}}
    with pytest.raises(PipelineError, match="over this server's limit"):
        Pipeline(PipelineSpec("custom", 64, 64, json.dumps(document)), allow_custom=True)


def _custom(document):
    """A custom pipeline from its A.to_dict document (or its JSON text), as a server builds it."""
    from remoteloader.server.pipelines import Pipeline, PipelineSpec

    text = document if isinstance(document, str) else json.dumps(document)
    return Pipeline(PipelineSpec("custom", 64, 64, text), allow_custom=True)


def _compose(transforms) -> dict:
    return {"__version__": "2.0.8", "transform": {"__class_fullname__": "Compose", "p": 1.0,
                                                    "transforms": transforms}}


def test_custom_pipelines_too_large_or_too_deep_are_refused_as_the_clients_error():
    from remoteloader.server.pipelines import MAX_PIPELINE_JSON, MAX_TRANSFORMS, PipelineError

    resize = {"__class_fullname__": "Resize", "height": 64, "width": 64, "p": 1.0}
    # Under the limit in characters, over it in bytes: the limit is what travels and is stored.
    wide = _compose([{**resize, "note": "\U0001F600" * (MAX_PIPELINE_JSON // 3)}])
    assert len(json.dumps(wide, ensure_ascii=False)) < MAX_PIPELINE_JSON
    with pytest.raises(PipelineError, match="bytes, over the limit"):
        _custom(json.dumps(wide, ensure_ascii=False))
    with pytest.raises(PipelineError, match="nested too deeply"):
        _custom("[" * 30_000 + "]" * 30_000)
    nested = resize
    for _ in range(MAX_TRANSFORMS):
        nested = {"__class_fullname__": "Sequential", "p": 1.0, "transforms": [nested]}
    with pytest.raises(PipelineError, match=f"over the limit of {MAX_TRANSFORMS}"):
        _custom(_compose([nested]))
    _custom(_compose([resize]))  # and a plain one is fine


def test_max_order_samples_is_bounded_by_the_orders_clients_send():
    """An order's indices travel in one message of at most MAX_ORDER_MESSAGE_BYTES both ways: a
    server offering larger orders would refuse every full one, so its settings refuse that."""
    from remoteloader.protos import limits
    from remoteloader.server.config import ServerConfig

    most = limits.most_order_samples()
    assert most * 10 < limits.MAX_ORDER_MESSAGE_BYTES  # every index a full uint64 varint
    assert ServerConfig(data=("d",), max_order_samples=most).max_order_samples == most
    with pytest.raises(ValueError, match=f"max_order_samples={most + 1}: at most {most}"):
        ServerConfig(data=("d",), max_order_samples=most + 1)


def test_shared_chunks_size_the_slots_only_where_same_host_clients_can_come():
    """Same-host streams get chunks of --shared-chunk-bytes, and the slots hold them; a server
    with --local-socket false keeps slots of max(--chunk-bytes, largest sample)."""
    from remoteloader.protos import limits
    from remoteloader.server.config import ServerConfig

    MiB = 1 << 20
    local = ServerConfig(data=("d",), chunk_bytes=2 * MiB, shared_chunk_bytes=8 * MiB, max_image_size=1024)
    assert (local.stream_chunk_bytes(shared=False), local.stream_chunk_bytes(shared=True)) == (2 * MiB, 8 * MiB)
    assert limits.pixel_bytes(local.slot_bytes) == 8 * MiB
    remote = ServerConfig(data=("d",), chunk_bytes=2 * MiB, shared_chunk_bytes=8 * MiB, local_socket=False)
    assert remote.stream_chunk_bytes(shared=True) == 2 * MiB
    assert limits.pixel_bytes(remote.slot_bytes) == 1024 * 1024 * 3  # the largest sample
    with pytest.raises(ValueError, match="shared_chunk_bytes=0"):
        ServerConfig(data=("d",), shared_chunk_bytes=0)


# ---- how busy the decode workers are ------------------------------------------------------
class _Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_busy_meter_is_time_weighted_over_its_window():
    from remoteloader.server.worker_pool import BusyMeter

    clock = _Clock()
    meter = BusyMeter(window=5.0, steps=10, clock=clock)
    assert meter.share() == 0.0  # no workers yet
    meter.set(0, 2)
    clock.now += 10
    assert meter.share() == 0.0  # two idle workers
    meter.set(1, 2)  # one of two busy for 2 s, then both for 3 s
    clock.now += 2
    meter.set(2, 2)
    clock.now += 3
    assert meter.share() == pytest.approx((1 * 2 + 2 * 3) / (2 * 5), abs=0.02)
    assert meter.busy_seconds() == pytest.approx(1 * 2 + 2 * 3)  # the counter: no window
    clock.now += 5.5  # a whole window later, all of it saturated
    assert meter.share() == pytest.approx(1.0)
    meter.set(0, 2)
    clock.now += 2.5  # half the window idle
    assert meter.share() == pytest.approx(0.5, abs=0.06)
    clock.now += 3600  # long idle: nothing of the busy time is left, and reading costs a window's marks
    assert meter.share() == 0.0
    meter.set(1, 1)  # a worker lost: the share is of the workers there were
    clock.now += 5.5
    assert meter.share() == pytest.approx(1.0)


def test_busy_meter_at_start_covers_only_the_time_since():
    from remoteloader.server.worker_pool import BusyMeter

    clock = _Clock()
    meter = BusyMeter(window=5.0, clock=clock)
    meter.set(3, 4)
    clock.now += 1
    assert meter.share() == pytest.approx(0.75)  # not diluted by the 4 s before it existed


def test_worker_pool_busy_share_reads_idle_then_saturated(tmp_path):
    """A real pool: ~0 while its workers wait, ~1 while the event loop keeps them fed."""
    import asyncio

    import numpy as np

    from remoteloader.server.catalog import Catalog
    from remoteloader.server.order_samples import Samples
    from remoteloader.server.pipelines import PipelineSpec
    from remoteloader.server.render import Renderer
    from remoteloader.server.shared_memory import Arena
    from remoteloader.server.worker_pool import WorkerPool
    from remoteloader.tools.textures import make_imagefolder

    (shard,) = open_shards([str(make_imagefolder(tmp_path / "data", ["a"], 8, size=(192, 256)))])
    catalog = Catalog([shard])
    spec = PipelineSpec("train", 64, 64)
    eight = Samples.of_shard(catalog, shard, np.arange(8))
    window = 1.0

    async def run() -> tuple[float, float, float]:
        arena = Arena(4, 8 * 64 * 64 * 3)
        pool = WorkerPool(arena, workers=2, allow_custom=False, max_pixels=10**8, busy_window=window)
        try:
            pool.start()
            renderer = Renderer(catalog, pool, None)
            # Started and waiting: a warm-up task each, then a whole window with no work.
            await asyncio.gather(
                *(renderer.render(spec, eight, list(range(8)), s, Job()) for s in range(2))
            )
            await asyncio.sleep(window * 1.2)
            idle = pool.busy_share()
            loop = asyncio.get_running_loop()
            until = loop.time() + window * 1.5

            async def keep_rendering(slot: int) -> None:  # four slots in turn keep two workers fed
                while loop.time() < until:
                    await renderer.render(spec, eight, list(range(8)), slot, Job())

            await asyncio.gather(*(keep_rendering(s) for s in range(4)))
            saturated = pool.busy_share()
            await asyncio.sleep(window * 1.2)
            return idle, saturated, pool.busy_share()
        finally:
            pool.close()
            arena.close()

    idle, saturated, after = asyncio.run(run())
    assert idle < 0.05, idle
    assert saturated > 0.9, saturated
    assert after < 0.05, after


def test_an_order_over_several_shards_is_checked_and_each_sample_keeps_its_own_seed(tmp_path):
    import numpy as np

    from remoteloader.protos import loader_pb2
    from remoteloader.server.catalog import Catalog, SyntheticShard
    from remoteloader.server.order_samples import OrderError, Samples
    from remoteloader.server.seeds import sample_seeds, shard_key

    a, b = SyntheticShard(5), SyntheticShard(7)
    held = Catalog([a, b])
    order = loader_pb2.Order(shard_ids=[b.id, a.id], shards=[0, 1, 1, 0], indices=[6, 0, 4, 3], seed=9, epoch=2)
    samples = Samples.of_order(order, held)
    assert [(s.id, i) for s, i in samples.pairs()] == [(b.id, 6), (a.id, 0), (a.id, 4), (b.id, 3)]
    assert samples.labels() == [int(b.labels[6]), int(a.labels[0]), int(a.labels[4]), int(b.labels[3])]
    # A sample's seed is a function of its shard and index alone: the same as in an order of its shard only.
    alone = [sample_seeds(9, 2, shard_key(s.id), np.asarray([i]))[0] for s, i in samples.pairs()]
    assert samples.seeds(9, 2) == alone
    assert [s.id for s, _ in samples[1:3].pairs()] == [a.id, a.id]
    one = Samples.of_order(loader_pb2.Order(shard_ids=[a.id], indices=[4, 1]), held)  # one shard: no positions
    assert [(s.id, i) for s, i in one.pairs()] == [(a.id, 4), (a.id, 1)]
    for bad, why in [
        (dict(shard_ids=["nope"], indices=[0]), "no shard 'nope' on this server"),
        (dict(shard_ids=[], indices=[0]), "names no shard"),
        (dict(shard_ids=[a.id, a.id], shards=[0], indices=[0]), "a shard twice"),
        (dict(shard_ids=[a.id, b.id], indices=[0]), "not which sample is of which"),
        (dict(shard_ids=[a.id, b.id], shards=[0], indices=[0, 1]), "2 indices but 1 shard positions"),
        (dict(shard_ids=[a.id, b.id], shards=[0, 2], indices=[0, 1]), "shard position 2 is past its 2 shard_ids"),
        (dict(shard_ids=[a.id, b.id], shards=[1, 0], indices=[6, 5]), f"index 5 is out of range for shard {a.id} of 5"),
        (dict(shard_ids=[a.id], indices=[2**64 - 1]), f"index {2**64 - 1} is out of range"),
    ]:
        with pytest.raises(OrderError, match=why):
            Samples.of_order(loader_pb2.Order(**bad), held)
