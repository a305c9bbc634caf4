"""End to end through three real servers holding different shards: the epoch contract.

Each server has its own ImageFolder with its own classes, some class names shared across
servers. File names carry the server's number (``cat/s0_cat_00000.jpg``), so a sample's
key says which server holds it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time

import numpy as np
import pytest
import torch
from conftest import outcome_in_fork, pixels_by_id

from remoteloader.client import RemoteLoader
from remoteloader.tools.textures import make_imagefolder

pytestmark = pytest.mark.timeout(120)

SERVER_CLASSES = [["cat", "dog"], ["dog", "fox", "owl"], ["ant", "cat"]]
PER_CLASS = [7, 5, 6]  # 14 + 15 + 12 = 41 samples: not a multiple of the batch size
BATCH = 8
SIZE = 32


class Data:
    def __init__(self, cluster, files: dict[str, object], run_bounded):
        self.cluster = cluster
        self.target = cluster.target
        self.files = files  # key -> path, over all servers
        self.total = len(files)
        self._run_bounded = run_bounded

    def epoch(self, loader, seconds: float = 60) -> list[tuple]:
        """One epoch of ``loader`` as a list of batches; fails the test if it does not finish in time."""
        return self._run_bounded(loader, seconds)

    @staticmethod
    def server_of(key: str) -> int:
        return int(key.split("/")[1].split("_")[0][1:])


@pytest.fixture(scope="module")
def data(module_cluster, tmp_path_factory, run_bounded):
    files = {}
    roots = []
    for k, (classes, per_class) in enumerate(zip(SERVER_CLASSES, PER_CLASS)):
        root = make_imagefolder(tmp_path_factory.mktemp(f"shard{k}"), classes, per_class, size=(64, 80),
                                seed=100 + k)
        for path in sorted(root.glob("*/*.jpg")):
            renamed = path.with_name(f"s{k}_{path.name}")
            path.rename(renamed)
            files[f"{renamed.parent.name}/{renamed.name}"] = renamed
        roots.append(root)
    module_cluster.add_many(roots)
    return Data(module_cluster, files, run_bounded)


def loader_for(data: Data, **kwargs) -> RemoteLoader:
    options = dict(batch_size=BATCH, image_size=SIZE, connect_timeout=20)
    options.update(kwargs)
    return RemoteLoader(data.target, **options)


# ---- exactly once ---------------------------------------------------------------------
def test_num_samples_is_the_total_of_all_servers(data):
    with loader_for(data) as loader:
        assert loader.num_samples == data.total == sum(len(c) * n for c, n in zip(SERVER_CLASSES, PER_CLASS))
        assert sorted(loader.servers) == sorted(data.cluster.addresses)


def test_epoch_without_drop_last_covers_every_sample_exactly_once(data):
    with loader_for(data, drop_last=False, return_ids=True) as loader:
        assert len(loader) == math.ceil(data.total / BATCH)
        batches = data.epoch(loader)
        assert len(batches) == len(loader)
        sizes = [len(ids) for _, _, ids in batches]
        assert sizes == [BATCH] * (len(batches) - 1) + [data.total - BATCH * (len(batches) - 1)]
        ids = torch.cat([ids for _, _, ids in batches]).tolist()
        assert sorted(ids) == list(range(loader.num_samples))
        # ... and the ids name every file of every server, each once.
        assert sorted(loader.sample_key(i) for i in ids) == sorted(data.files)


def test_epoch_with_drop_last_covers_all_but_the_remainder_exactly_once(data):
    with loader_for(data, drop_last=True, return_ids=True) as loader:
        assert len(loader) == data.total // BATCH
        batches = data.epoch(loader)
        assert len(batches) == len(loader)
        assert all(len(ids) == BATCH for _, _, ids in batches)
        ids = torch.cat([ids for _, _, ids in batches]).tolist()
        assert len(set(ids)) == len(ids), "a sample came twice in one epoch"
        assert set(ids) <= set(range(loader.num_samples))
        missing = set(range(loader.num_samples)) - set(ids)
        assert len(missing) == data.total % BATCH < BATCH


def test_labels_index_the_sorted_union_of_class_names(data):
    with loader_for(data, drop_last=False, return_ids=True) as loader:
        union = sorted({c for classes in SERVER_CLASSES for c in classes})
        assert loader.class_names == union
        seen = 0
        for _images, labels, ids in loader:
            assert labels.dtype == torch.int64 and labels.shape == ids.shape
            for label, i in zip(labels.tolist(), ids.tolist()):
                assert loader.class_names[label] == loader.sample_key(i).split("/")[0], f"sample {i}"
                seen += 1
        assert seen == data.total


def test_shuffled_batches_mix_samples_of_several_servers(data):
    with loader_for(data, shuffle=True, drop_last=True, return_ids=True) as loader:
        spread = [len({data.server_of(loader.sample_key(i)) for i in ids.tolist()}) for _, _, ids in loader]
    assert len(spread) == data.total // BATCH
    assert all(n >= 2 for n in spread), spread
    assert max(spread) == len(SERVER_CLASSES), spread


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_get_equal_batch_counts_and_together_cover_the_epoch(data, drop_last):
    world = 3
    per_rank = []
    for rank in range(world):
        with loader_for(data, rank=rank, world_size=world, drop_last=drop_last, return_ids=True, seed=6) as loader:
            batches = data.epoch(loader)
            assert len(batches) == len(loader)
            per_rank.append(torch.cat([i for _, _, i in batches]).tolist())
    counts = {len(ids) for ids in per_rank}
    lengths = [len(ids) for ids in per_rank]
    everything = [i for ids in per_rank for i in ids]
    assert len(set(everything)) == len(everything), "two ranks got the same sample"
    if drop_last:
        assert counts == {BATCH * (data.total // (BATCH * world))}
        assert data.total - len(everything) < BATCH * world
    else:
        assert sorted(everything) == list(range(data.total))
        assert max(lengths) - min(lengths) <= 1, lengths


def test_unshuffled_epoch_is_in_id_order(data):
    with loader_for(data, shuffle=False, drop_last=False, return_ids=True) as loader:
        ids = torch.cat([ids for _, _, ids in loader]).tolist()
    assert ids == list(range(data.total))


# ---- reproducibility ------------------------------------------------------------------
def test_same_seed_gives_identical_epochs(data):
    with loader_for(data, seed=3, return_ids=True) as a, loader_for(data, seed=3, return_ids=True) as b:
        first, second = data.epoch(a), data.epoch(b)
    assert len(first) == len(second) == data.total // BATCH
    for (xa, ya, ia), (xb, yb, ib) in zip(first, second):
        assert torch.equal(ia, ib)
        assert torch.equal(ya, yb)
        assert torch.equal(xa, xb)


def test_different_seeds_give_different_epochs(data):
    with loader_for(data, seed=3, return_ids=True, drop_last=False) as a, \
            loader_for(data, seed=4, return_ids=True, drop_last=False) as b:
        first, second = data.epoch(a), data.epoch(b)
    order_a = torch.cat([i for _, _, i in first]).tolist()
    order_b = torch.cat([i for _, _, i in second]).tolist()
    assert order_a != order_b, "the shuffle ignores the seed"
    pa, pb = pixels_by_id(first), pixels_by_id(second)
    assert pa.keys() == pb.keys()
    differ = sum(not np.array_equal(pa[i], pb[i]) for i in pa)
    assert differ > len(pa) // 2, f"only {differ}/{len(pa)} samples were augmented differently"


def test_epochs_differ_and_set_epoch_replays_one(data):
    with loader_for(data, seed=7, return_ids=True, drop_last=False) as loader:
        loader.set_epoch(0)
        epoch0 = data.epoch(loader)
        loader.set_epoch(1)
        epoch1 = data.epoch(loader)
        loader.set_epoch(0)
        again = data.epoch(loader)
    assert torch.cat([i for _, _, i in epoch0]).tolist() != torch.cat([i for _, _, i in epoch1]).tolist()
    p0, p1 = pixels_by_id(epoch0), pixels_by_id(epoch1)
    assert sum(not np.array_equal(p0[i], p1[i]) for i in p0) > len(p0) // 2
    assert len(again) == len(epoch0)
    for (xa, ya, ia), (xb, yb, ib) in zip(epoch0, again):
        assert torch.equal(ia, ib) and torch.equal(ya, yb) and torch.equal(xa, xb)


def test_iteration_without_set_epoch_advances_the_epoch(data):
    with loader_for(data, seed=7, return_ids=True) as loader, \
            loader_for(data, seed=7, return_ids=True) as reference:
        first = data.epoch(loader)
        second = data.epoch(loader)
        reference.set_epoch(1)
        expected = data.epoch(reference)
    # Each pass plays a whole epoch (an empty one would compare equal to anything), and the
    # second plays epoch 1: another order than the first, the same as epoch 1 played by name.
    assert len(first) == len(second) == len(expected) == len(loader) > 0
    assert torch.cat([i for _, _, i in second]).tolist() != torch.cat([i for _, _, i in first]).tolist()
    for (xa, _, ia), (xb, _, ib) in zip(second, expected, strict=True):
        assert torch.equal(ia, ib) and torch.equal(xa, xb)


def test_eval_preset_is_deterministic_and_independent_of_the_order(data):
    with loader_for(data, pipeline="eval", shuffle=True, seed=5, drop_last=False, return_ids=True) as a, \
            loader_for(data, pipeline="eval", shuffle=False, seed=9, drop_last=False, return_ids=True) as b:
        shuffled0 = data.epoch(a)
        shuffled1 = data.epoch(a)  # the next epoch: another order
        plain = data.epoch(b)
    orders = [torch.cat([i for _, _, i in run]).tolist() for run in (shuffled0, shuffled1, plain)]
    assert len({tuple(o) for o in orders}) == 3, "the test needs three different orders"
    maps = [pixels_by_id(run) for run in (shuffled0, shuffled1, plain)]
    assert maps[0].keys() == maps[1].keys() == maps[2].keys() == set(range(data.total))
    for i in range(data.total):
        assert np.array_equal(maps[0][i], maps[2][i]), f"sample {i}: eval pixels depend on the order"
        assert np.array_equal(maps[1][i], maps[2][i]), f"sample {i}: eval pixels depend on the epoch"


@pytest.mark.parametrize("size", [SIZE, (24, 40), (40, 24)])
def test_pixels_belong_to_the_sample_their_id_names(data, eval_reference, size):
    with loader_for(data, pipeline="eval", image_size=size, shuffle=True, seed=11, drop_last=False,
                    return_ids=True) as loader:
        got = pixels_by_id(data.epoch(loader))
        keys = {i: loader.sample_key(i) for i in got}
    names = sorted(data.files)
    references = np.stack([eval_reference(data.files[k], size).astype(np.float32) for k in names])
    for i, image in got.items():
        errors = np.abs(references - image.astype(np.float32)).mean(axis=(1, 2, 3))
        nearest = names[int(errors.argmin())]
        assert nearest == keys[i], f"sample {i} ({keys[i]}) looks like {nearest}"
        assert errors[names.index(keys[i])] < 10, f"sample {i} ({keys[i]}) is far from its file"


# ---- output ---------------------------------------------------------------------------
def test_output_is_uint8_nhwc(data):
    with loader_for(data, image_size=(32, 48), return_ids=True, drop_last=False) as loader:
        for images, labels, ids in loader:
            n = len(ids)
            assert images.dtype == torch.uint8
            assert tuple(images.shape) == (n, 32, 48, 3)
            assert images.device.type == "cpu"
            assert tuple(labels.shape) == (n,) and tuple(ids.shape) == (n,)
            assert images.float().std() > 0, "blank images"
    with loader_for(data) as loader:  # without return_ids: (images, labels)
        item = next(iter(loader))
        assert len(item) == 2 and tuple(item[0].shape) == (BATCH, SIZE, SIZE, 3)


@pytest.mark.parametrize("pipeline", ["train", "eval"])
@pytest.mark.parametrize("size", [(24, 40), (40, 24)])
def test_presets_serve_non_square_sizes(data, pipeline, size):
    # image_size may be (height, width); every preset must give every sample that size.
    failures = []
    with loader_for(data, pipeline=pipeline, image_size=size, drop_last=False, return_ids=True,
                    on_error=failures.extend) as loader:
        batches = data.epoch(loader)
    assert not failures, (f"{len(failures)} of {data.total} samples failed with image_size={size}, "
                          f"e.g. {failures[0].key}: {failures[0].reason}")
    assert sorted(torch.cat([i for _, _, i in batches]).tolist()) == list(range(data.total))
    for images, _labels, ids in batches:
        assert tuple(images.shape) == (len(ids), *size, 3)


@pytest.mark.parametrize("dtype, atol, receiver", [(torch.float32, 1e-5, "thread"), (torch.bfloat16, 0.05, "thread"),
                                                     (torch.float32, 1e-5, "process")])
def test_normalize_gives_float_nchw_channels_last(data, dtype, atol, receiver):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    with loader_for(data, seed=2, return_ids=True, normalize=(mean, std), dtype=dtype, receiver=receiver) as a, \
            loader_for(data, seed=2, return_ids=True) as b:
        normalized, raw = data.epoch(a), data.epoch(b)
    assert len(normalized) == len(raw) == data.total // BATCH
    m = torch.tensor(mean).view(1, 3, 1, 1)
    s = torch.tensor(std).view(1, 3, 1, 1)
    for (x, yx, ix), (u, yu, iu) in zip(normalized, raw):
        assert torch.equal(ix, iu) and torch.equal(yx, yu)
        assert x.dtype == dtype
        assert tuple(x.shape) == (BATCH, 3, SIZE, SIZE)
        assert x.is_contiguous(memory_format=torch.channels_last)
        expected = (u.permute(0, 3, 1, 2).double() / 255 - m.double()) / s.double()
        torch.testing.assert_close(x.double(), expected, atol=atol, rtol=0.01 if dtype != torch.float32 else 1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_device_without_a_gpu_is_a_clear_error(data):
    with pytest.raises(ValueError) as info:
        loader_for(data, device="cuda")
    message = str(info.value)
    assert "cuda" in message and "is_available" in message and "cpu" in message


# ---- arguments and lifecycle ----------------------------------------------------------
@pytest.mark.parametrize("kwargs, name", [
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": -3}, "batch_size"),
    ({"rank": 2, "world_size": 2}, "rank"),
    ({"rank": -1, "world_size": 2}, "rank"),
    ({"on_error": "explode"}, "on_error"),
    ({"image_size": 0}, "image_size"),
    ({"image_size": (32,)}, "image_size"),
    ({"image_size": (32, -1)}, "image_size"),
    ({"image_size": "big"}, "image_size"),
    ({"image_size": 4}, "image_size"),  # below the servers' min_image_size (8)
    ({"image_size": 4096}, "image_size"),  # above their max_image_size (1024)
    ({"dtype": torch.uint8}, "dtype"),
    ({"normalize": ((123.7, 116.3, 103.5), (58.4, 57.1, 57.4))}, "0..1 scale"),
    ({"dtype": torch.float8_e4m3fn, "normalize": ((0.5,) * 3, (0.5,) * 3)}, "dtype"),
    ({"batch_size": True}, "batch_size"),
    ({"image_size": True}, "image_size"),
    ({"image_size": 64.0}, "image_size"),
    ({"image_size": 10**12}, "image_size"),
    ({"seed": -1}, "seed"),  # seeds travel as uint64
    ({"seed": 2**64}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"prefetch": 2.0}, "prefetch"),
    ({"connect_timeout": None}, "connect_timeout"),
])
def test_invalid_arguments_raise_value_error_naming_them(data, kwargs, name):
    with pytest.raises(ValueError, match=name):
        loader_for(data, **kwargs)


def _io_threads() -> int:
    return sum(t.name == "remoteloader-io" and t.is_alive() for t in threading.enumerate())


def _tasks_on_the_io_loop() -> int:
    from remoteloader.client.thread_receiver import io_loop

    async def count():
        return len(asyncio.all_tasks()) - 1  # less this one

    return asyncio.run_coroutine_threadsafe(count(), io_loop()[0]).result(10)


def _tasks_on_the_io_loop_settle_at(tasks: int, seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while _tasks_on_the_io_loop() != tasks and time.monotonic() < deadline:
        time.sleep(0.05)
    return _tasks_on_the_io_loop() == tasks


def test_context_manager_closes_and_close_is_idempotent(data):
    tasks = _tasks_on_the_io_loop()
    with loader_for(data) as loader:
        images, _labels = next(iter(loader))
        assert len(images) == BATCH
        assert _io_threads() == 1 and _tasks_on_the_io_loop() > tasks
    # Its streams, tasks and channels are gone; the process's I/O thread stays for the next.
    assert _tasks_on_the_io_loop_settle_at(tasks) and _io_threads() == 1
    loader.close()  # a second close is fine
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)
    explicit = loader_for(data)
    explicit.close()
    explicit.close()
    assert _io_threads() == 1


def test_loaders_opened_and_closed_beside_another_leave_it_undisturbed(data, caplog):
    # A training loader beside short-lived evaluation loaders. With a loop per loader,
    # gRPC handed late completions of a closed loader's calls to its closed loop from the
    # live loader's callback: "Exception in callback ... Event loop is closed".
    caplog.set_level(logging.ERROR, logger="asyncio")
    with loader_for(data, seed=1) as keeper:
        batches = iter(keeper)
        first = next(batches)
        for seed in range(8):
            with loader_for(data, seed=seed + 2) as other:
                next(iter(other))
                assert other._io._loop is keeper._io._loop
        rest = list(batches)
    assert len(rest) + 1 == data.total // BATCH and len(first[0]) == BATCH
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors[:3]


def test_a_loader_collected_on_the_io_thread_closes_without_stalling_it(data):
    # A loader in a reference cycle is closed by the cyclic garbage collector, on whichever
    # thread runs it: often the shared I/O thread, which must not wait for itself (10 s).
    import gc

    from remoteloader.client.thread_receiver import io_loop

    tasks = _tasks_on_the_io_loop()
    with loader_for(data, seed=3) as keeper:

        async def collect_here():
            started = time.monotonic()
            gc.collect()
            return time.monotonic() - started

        # A collection takes its own time, which a loaded machine stretches (over 3 s once, beside
        # three busy cores): the bound is on what closing the loader adds to one (timed on the
        # I/O thread once what earlier tests left is collected here).
        gc.collect()
        collecting = asyncio.run_coroutine_threadsafe(collect_here(), io_loop()[0]).result(30)
        dropped = loader_for(data, seed=4)
        next(iter(dropped))
        dropped.me = dropped  # a cycle: only the collector frees it
        del dropped
        took = asyncio.run_coroutine_threadsafe(collect_here(), io_loop()[0]).result(30)
        assert took - collecting < 3, (f"closing a collected loader held the I/O thread for {took:.1f}s "
                                       f"(a collection alone: {collecting:.1f}s)")
        assert len(list(keeper)) == data.total // BATCH  # the other loader is unharmed
    assert _tasks_on_the_io_loop_settle_at(tasks), "the collected loader left tasks behind"


def test_a_loader_used_in_a_forked_child_is_a_clear_error_not_a_hang(data):
    # e.g. a DataLoader worker holding the RemoteLoader: its connections live in the parent.
    with loader_for(data) as loader:
        outcome = outcome_in_fork(lambda: next(iter(loader)))
        assert outcome.startswith("RuntimeError") and "fork" in outcome, outcome
        assert len(next(iter(loader))[0]) == BATCH  # the parent's loader still works


def test_breaking_out_early_then_iterating_again(data):
    with loader_for(data, return_ids=True, drop_last=False, prefetch=2) as loader:
        for n, _batch in enumerate(loader):
            if n == 1:
                break
        for _batch in loader:  # break at the very first batch too
            break
        batches = data.epoch(loader)
        assert len(batches) == len(loader)
        ids = torch.cat([i for _, _, i in batches]).tolist()
        assert sorted(ids) == list(range(data.total))
        again = data.epoch(loader)  # and the next full epoch still works
        assert sorted(torch.cat([i for _, _, i in again]).tolist()) == list(range(data.total))
