"""Epochs as a pure function of (seed, epoch, rank, world_size, catalog): plans, ranks, resume,
delivery order, uneven servers and user samplers, through real servers.

One module-wide Cluster (tests here only read from it):
    0, 1, 2  three different shards A, B, C (16 + 18 + 15 = 49 samples), one server each
    3        B and C again, both on one server: with 0 it serves the same data with 2 servers
    4, 5     replicas of one synthetic shard, one slow (--max-rate 60) and one faster (300)
"""

from __future__ import annotations

import collections
import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import pixels_by_id

from remoteloader.client import RemoteLoader
from remoteloader.client import throughput as throughput_module
from remoteloader.tools.textures import make_imagefolder

pytestmark = pytest.mark.timeout(120)

SHARDS = [(["cat", "dog"], 8), (["dog", "fox", "owl"], 6), (["ant", "cat", "eel"], 5)]
TOTAL = 49  # 49 = 6 x 8 + 1 = 3 x 16 + 1: one leftover sample for 2 and for 4 ranks of batch 4
BATCH = 4
SIZE = 32
SLOW_RATE, FAST_RATE = 60, 300
SYNTHETIC = 240


class Servers:
    def __init__(self, cluster, run_bounded):
        self.cluster = cluster
        self.three = ",".join(cluster.address(i) for i in (0, 1, 2))
        self.two = ",".join(cluster.address(i) for i in (0, 3))  # A | B+C
        self.slow, self.fast = cluster.address(4), cluster.address(5)
        self._run_bounded = run_bounded

    def epoch(self, loader, seconds: float = 60) -> list[tuple]:
        return [tuple(b) for b in self._run_bounded(loader, seconds)]


@pytest.fixture(scope="module")
def servers(module_cluster, tmp_path_factory, run_bounded):
    root = tmp_path_factory.mktemp("epochs-data")
    dirs = [make_imagefolder(root / f"shard{k}", classes, n, size=(48, 64), seed=20 + k)
            for k, (classes, n) in enumerate(SHARDS)]
    tiny = make_imagefolder(root / "tiny", ["x"], 1, size=(48, 64), seed=9)
    started = module_cluster.add_many([dirs[0], dirs[1], dirs[2], [dirs[1], dirs[2]]], wait=False)
    started.append(module_cluster.add(tiny, "--synthetic", str(SYNTHETIC), "--max-rate", str(SLOW_RATE), wait=False))
    started.append(module_cluster.add(tiny, "--synthetic", str(SYNTHETIC), "--max-rate", str(FAST_RATE), wait=False))
    assert started == list(range(6))
    for i in started:
        module_cluster.wait_ready(i)
    return Servers(module_cluster, run_bounded)


def make_loader(target: str, **kwargs) -> RemoteLoader:
    options = dict(batch_size=BATCH, image_size=SIZE, seed=5, drop_last=False, return_ids=True, connect_timeout=20)
    options.update(kwargs)
    return RemoteLoader(target, **options)


def ids_of(batches) -> list[list[int]]:
    return [ids.tolist() for _, _, ids in batches]


def flat(batches) -> list[int]:
    return [i for ids in ids_of(batches) for i in ids]


def plan_lists(plan) -> list[list[int]]:
    return [np.asarray(b).tolist() for b in plan]


def assert_same_batches(got, expected, what: str = "") -> None:
    """Bitwise: same ids in the same order, same labels, same pixels."""
    assert len(got) == len(expected), f"{what}{len(got)} batches, expected {len(expected)}"
    for n, ((x, y, i), (xe, ye, ie)) in enumerate(zip(got, expected)):
        assert torch.equal(i, ie), f"{what}batch {n}: ids {i.tolist()} != {ie.tolist()}"
        assert torch.equal(y, ye), f"{what}batch {n}: labels differ"
        assert x.shape == xe.shape and torch.equal(x, xe), f"{what}batch {n}: pixels differ"


# ---- the plan is a pure function ----------------------------------------------------------
_PLAN_SCRIPT = """
import json, sys
from remoteloader.client import RemoteLoader
args = json.loads(sys.argv[1])
with RemoteLoader(args["target"], batch_size=args["batch"], image_size=32, seed=args["seed"], connect_timeout=20,
                  drop_last=False) as loader:
    print(json.dumps({str(e): [b.tolist() for b in loader.plan(e)] for e in args["epochs"]}))
"""


def test_plan_is_a_pure_function_of_seed_epoch_and_data(servers):
    epochs = [0, 1, 2]
    with make_loader(servers.three, seed=11) as a, make_loader(servers.three, seed=11) as b, \
            make_loader(servers.three, seed=12) as other_seed:
        plans = {e: plan_lists(a.plan(e)) for e in epochs}
        for e in epochs:
            assert plan_lists(b.plan(e)) == plans[e], f"two loaders disagree on epoch {e}"
            assert plan_lists(a.plan(e)) == plans[e], f"plan({e}) changed when asked again"
            assert sorted(i for batch in plans[e] for i in batch) == list(range(TOTAL))
            assert plan_lists(other_seed.plan(e)) != plans[e], f"epoch {e}: the plan ignores the seed"
        assert plans[0] != plans[1] != plans[2] != plans[0], "epochs do not reshuffle"
        assert len(a) == len(plans[0])
        assert a.epoch == 0, "asking for plans moved the loader"
        # The plan is what an epoch delivers.
        a.set_epoch(1)
        assert ids_of(servers.epoch(a)) == plans[1]
        assert a.epoch == 2

    # The same data behind other servers, listed in another order: the same plan.
    reordered = ",".join(reversed(servers.three.split(",")))
    for address in (reordered, servers.two):
        with make_loader(address, seed=11) as loader:
            assert loader.num_samples == TOTAL
            assert {e: plan_lists(loader.plan(e)) for e in epochs} == plans, address

    # ... and in another process (another hash seed, another import order).
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    args = json.dumps({"target": reordered, "batch": BATCH, "seed": 11, "epochs": epochs})
    result = subprocess.run([sys.executable, "-c", _PLAN_SCRIPT, args], capture_output=True, text=True,
                            timeout=60, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    remote = json.loads(result.stdout.strip().splitlines()[-1])
    assert {int(e): p for e, p in remote.items()} == plans


# ---- ranks ------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("drop_last", [True, False])
def test_ranks_split_the_epoch_disjointly_with_equal_batch_counts(servers, world_size, drop_last):
    per_rank = []
    for rank in range(world_size):
        with make_loader(servers.three, rank=rank, world_size=world_size, drop_last=drop_last, seed=8) as loader:
            loader.set_epoch(3)
            batches = servers.epoch(loader)
            assert ids_of(batches) == plan_lists(loader.plan(3)), f"rank {rank} did not get its plan"
            assert len(batches) == len(loader), f"rank {rank}: {len(batches)} batches, len() says {len(loader)}"
            per_rank.append(ids_of(batches))

    counts = [len(b) for b in per_rank]
    assert len(set(counts)) == 1, f"ranks got different numbers of batches: {counts}"
    everything = [i for batches in per_rank for batch in batches for i in batch]
    assert set(everything) <= set(range(TOTAL))
    if drop_last:
        assert all(len(batch) == BATCH for batches in per_rank for batch in batches)
        assert len(set(everything)) == len(everything), "two ranks (or two batches) got the same sample"
        assert len(everything) == TOTAL - TOTAL % (BATCH * world_size)
        assert TOTAL - len(everything) < BATCH * world_size
        return
    # drop_last=False: every sample at least once; a sample comes twice only as padding, i.e. as
    # the one sample of a rank's last batch when fewer samples are left over than ranks.
    assert sorted(set(everything)) == list(range(TOTAL)), "some sample reached no rank"
    body = [i for batches in per_rank for batch in batches[:-1] for i in batch]
    assert len(set(body)) == len(body), "a sample came twice outside the last batches"
    assert all(len(batch) == BATCH for batches in per_rank for batch in batches[:-1])
    padding = collections.Counter(batches[-1][0] for batches in per_rank if len(batches[-1]) == 1)
    for i, count in collections.Counter(everything).items():
        assert count == 1 or padding[i] >= count - 1, f"sample {i} came {count} times, not as padding"
    leftover = TOTAL % (BATCH * world_size)
    padded = world_size - leftover if 0 < leftover < world_size else 0
    assert len(everything) - TOTAL == padded, f"{len(everything) - TOTAL} duplicates, expected {padded} padding"


# ---- resume -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def uninterrupted(servers):
    """Epoch 1 of the reference loader, start to end."""
    with make_loader(servers.three) as loader:
        loader.set_epoch(1)
        batches = servers.epoch(loader)
    assert sorted(flat(batches)) == list(range(TOTAL))
    return batches


@pytest.mark.parametrize("layout", ["same servers", "two servers"])
@pytest.mark.parametrize("position", [0, 1, 6, "end"])
def test_resume_in_a_fresh_loader_continues_the_epoch_bitwise(servers, uninterrupted, position, layout):
    n = len(uninterrupted)
    k = n if position == "end" else position
    with make_loader(servers.three) as first:
        first.set_epoch(1)
        seen = []
        if k == 0:
            state = first.state_dict()
        else:
            for batch in first:
                seen.append(tuple(batch))
                if len(seen) == k:
                    state = first.state_dict()
                    break
        assert first.state_dict() == state, "breaking out of the loop moved the position"
    assert_same_batches(seen, uninterrupted[:k], "before the interruption: ")

    text = json.dumps(state)
    assert len(text) < 1024, f"state_dict is not small: {len(text)} bytes"
    assert json.loads(text) == state
    # At the end of the epoch (its last batch delivered), the position is the next epoch's start.
    assert state["seed"] == 5 and (state["epoch"], state["position"]) == ((2, 0) if k == n else (1, k))

    with make_loader(servers.three if layout == "same servers" else servers.two) as fresh:
        assert fresh.num_samples == TOTAL
        fresh.load_state_dict(json.loads(text))
        if k < n:
            rest = servers.epoch(fresh)
            assert_same_batches(rest, uninterrupted[k:], "after resuming: ")
        assert fresh.state_dict()["epoch"] == 2 and fresh.state_dict()["position"] == 0


@pytest.mark.parametrize("change", [{"seed": 6}, {"batch_size": BATCH * 2}])
def test_load_state_dict_refuses_a_different_seed_or_batch_size(servers, change):
    with make_loader(servers.three) as loader:
        loader.set_epoch(2)
        state = json.loads(json.dumps(loader.state_dict()))
    with make_loader(servers.three, **change) as other:
        with pytest.raises(ValueError, match=next(iter(change))):
            other.load_state_dict(state)
        with pytest.raises(ValueError, match="not a RemoteLoader state_dict"):
            other.load_state_dict({"foo": 1})  # e.g. the model's by mistake


def test_load_state_dict_refuses_positions_outside_the_epoch_and_garbage(servers):
    with make_loader(servers.three) as loader:
        loader.set_epoch(1)
        state = json.loads(json.dumps(loader.state_dict()))
        n = len(loader)
        for bad in ({"position": n + 1}, {"position": -1}, {"position": "2"}, {"position": 2.5}, {"position": True},
                    {"epoch": -3}, {"epoch": "x"}, {"epoch": 2**64}, {"delivered_after": [n]},
                    {"delivered_after": [0]}, {"delivered_after": 3}):
            with pytest.raises(ValueError, match=next(iter(bad))):
                loader.load_state_dict({**state, **bad})
            assert loader.state_dict() == state, f"a refused state ({bad}) changed the loader"
        for bad in (None, [state], "state"):
            with pytest.raises(TypeError, match="expects the dict"):
                loader.load_state_dict(bad)
        loader.load_state_dict({**state, "position": n})  # the end of the epoch: the next one's start
        assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (2, 0)
        assert ids_of(servers.epoch(loader)) == plan_lists(loader.plan(2))


@pytest.mark.parametrize("change", [{"shuffle": False}, {"drop_last": True}])
def test_load_state_dict_refuses_a_state_of_another_plan(servers, change):
    with make_loader(servers.three, shuffle=True) as loader:
        loader.set_epoch(1)
        for k, _batch in enumerate(loader):
            if k == 1:
                state = json.loads(json.dumps(loader.state_dict()))
                break
    with make_loader(servers.three, **{"shuffle": True, **change}) as other:
        with pytest.raises(ValueError, match=next(iter(change))):
            other.load_state_dict(state)
        older = {k: v for k, v in state.items() if k not in ("shuffle", "drop_last")}  # as saved before 0.1's last
        with pytest.raises(ValueError, match="another plan"):
            other.load_state_dict(older)


def test_a_position_belongs_to_its_epoch(servers):
    with make_loader(servers.three) as loader:
        loader.set_epoch(1)
        for k, _batch in enumerate(loader):
            if k == 2:
                break
        assert loader.state_dict()["position"] == 3  # where the loop broke off, for a checkpoint
        loader.set_epoch(1)
        assert loader.state_dict()["position"] == 3
        loader.set_epoch(2)  # a new epoch starts at its first batch: not 3 batches in
        assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (2, 0)
        for k, _batch in enumerate(loader):  # set_epoch inside the loop: epoch 2's batches are not epoch 3's
            if k == 1:
                loader.set_epoch(3)
            if k == 3:
                state = loader.state_dict()
                assert (state["epoch"], state["position"], state["delivered_after"]) == (3, 0, []), state


def test_a_batch_larger_than_every_epoch_warns(servers):
    with pytest.warns(UserWarning, match="every epoch is empty"):
        loader = make_loader(servers.three, batch_size=TOTAL + 1, drop_last=True)
    with loader:
        assert len(loader) == 0


# ---- delivery order ---------------------------------------------------------------------
def test_ordered_epochs_repeat_and_unordered_ones_deliver_the_same_samples(servers):
    with make_loader(servers.three, seed=21) as ordered:
        ordered.set_epoch(4)
        first = servers.epoch(ordered)
        ordered.set_epoch(4)
        second = servers.epoch(ordered)
        plan = plan_lists(ordered.plan(4))
    assert ids_of(first) == plan
    assert_same_batches(second, first, "ordered run 2 vs run 1: ")

    with make_loader(servers.three, seed=21, ordered=False) as unordered:
        unordered.set_epoch(4)
        loose = servers.epoch(unordered)
    # Whole batches of the plan, in any order, with the very same pixels per sample.
    assert sorted(map(tuple, ids_of(loose))) == sorted(map(tuple, plan))
    assert collections.Counter(flat(loose)) == collections.Counter(flat(first))
    expected, got = pixels_by_id(first), pixels_by_id(loose)
    assert got.keys() == expected.keys()
    differ = [i for i in expected if not np.array_equal(expected[i], got[i])]
    assert not differ, f"{len(differ)} sample(s) have other pixels when delivered unordered, e.g. {differ[:5]}"
    labels_first = {i: y for _, ys, ids in first for i, y in zip(ids.tolist(), ys.tolist())}
    labels_loose = {i: y for _, ys, ids in loose for i, y in zip(ids.tolist(), ys.tolist())}
    assert labels_first == labels_loose


def test_stats_count_what_was_delivered(servers):
    with make_loader(servers.three, seed=2) as loader:
        batches = servers.epoch(loader)
        stats = loader.stats()
    assert stats["batches"] == len(batches)
    assert stats["images"] == TOTAL
    assert stats["bytes"] == TOTAL * SIZE * SIZE * 3
    assert stats["elapsed_s"] > 0 and stats["images_per_s"] > 0 and stats["bytes_per_s"] > 0
    assert 0 <= stats["wait_s"] <= stats["elapsed_s"] and 0 <= stats["wait_fraction"] <= 1
    json.dumps(stats)  # plain numbers and strings, for logging
    per_server = stats["servers"]
    assert sorted(per_server) == sorted(servers.three.split(","))
    assert sum(s["samples"] for s in per_server.values()) == TOTAL
    for address, s in per_server.items():
        assert s["orders"] > 0 and s["failures"] == 0 and s["reconnects"] == 0 and s["state"] == "up", (address, s)


def test_each_epoch_is_one_line_of_stats_and_waiting_for_data_is_warned_of_once(servers, caplog, monkeypatch):
    def play(loader: RemoteLoader, epochs: int, work: float) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="remoteloader.client"):
            for epoch in range(epochs):
                loader.set_epoch(epoch)
                for _ in loader:
                    if work:  # (a loop that only reads batches does nothing else: no sleep(0), which yields the CPU)
                        time.sleep(work)  # the training step
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "waited for data" in
                r.getMessage()]

    # Epochs of a few seconds (SYNTHETIC images at SLOW_RATE): under WARN_AFTER_S, never warned of.
    with RemoteLoader(servers.fast, batch_size=8, image_size=SIZE, drop_last=False) as loader:
        assert play(loader, 1, 0.005) == []
    monkeypatch.setattr(throughput_module, "WARN_AFTER_S", 0.0)
    # A loop that only reads batches, and an eval pass, wait by design: not warned of either.
    with RemoteLoader(servers.fast, batch_size=8, image_size=SIZE, drop_last=False) as loader:
        assert play(loader, 1, 0.0) == []
    with RemoteLoader(servers.fast, batch_size=8, image_size=SIZE, drop_last=False, pipeline="eval") as loader:
        assert play(loader, 1, 0.005) == []
    # A training loop on the slow server waits for nearly every batch: one line per epoch, one warning.
    with RemoteLoader(servers.slow, batch_size=8, image_size=SIZE, drop_last=False) as loader:
        warned = play(loader, 2, 0.005)
        epochs = loader.stats()["epochs"]
    assert [e["epoch"] for e in epochs] == [0, 1]
    for e in epochs:
        assert e["images"] == SYNTHETIC + 1 and e["seconds"] > 0 and e["images_per_s"] > 0
        assert e["wait_fraction"] > 0.5, e
    lines = [r.getMessage() for r in caplog.records]
    assert sum("images/s); the loop waited for data" in m for m in lines) == 2, lines
    assert len(warned) == 1 and "epoch 0" in warned[0], lines


# ---- uneven servers ---------------------------------------------------------------------
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "unordered"])
def test_slow_replica_gets_proportionally_less_work(servers, ordered):
    # Two replicas of one shard, capped at 60 and 300 images/s: the ideal split gives the slow
    # one 60/360 = 17% of the samples and the epoch total/360 seconds. The slow one is listed
    # first: the listing order must not decide who gets the work.
    with RemoteLoader(f"{servers.slow},{servers.fast}", batch_size=8, image_size=SIZE, seed=1, drop_last=False,
                      return_ids=True, ordered=ordered, connect_timeout=20) as loader:
        total = loader.num_samples
        assert total == SYNTHETIC + 1 and len(loader.catalog.shards) == 2
        assert all(len(s.owners) == 2 for s in loader.catalog.shards), "the servers should be replicas"
        started = time.perf_counter()
        batches = servers.epoch(loader)
        elapsed = time.perf_counter() - started
        stats = loader.stats()["servers"]
    assert sorted(flat(batches)) == list(range(total))
    slow, fast = stats[servers.slow]["samples"], stats[servers.fast]["samples"]
    assert slow + fast == total
    ideal = total / (SLOW_RATE + FAST_RATE)
    bound = 1.5 * ideal + 0.5
    detail = (f"slow server (--max-rate {SLOW_RATE}) rendered {slow} of {total} samples ({slow / total:.0%}), "
              f"the faster one ({FAST_RATE}/s) {fast}; orders {stats[servers.slow]['orders']} vs "
              f"{stats[servers.fast]['orders']}; epoch {elapsed:.2f}s, ideal {ideal:.2f}s, bound {bound:.2f}s")
    assert slow / total < 0.40, detail
    assert elapsed < bound, detail


# ---- samplers ---------------------------------------------------------------------------
class Recording:
    """Wraps a sampler and keeps the ids of its last pass."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.passes: list[list[int]] = []

    def __iter__(self):
        ids = [int(i) for i in self.sampler]
        self.passes.append(ids)
        return iter(ids)

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name: str):  # set_epoch, where the sampler has it
        return getattr(self.sampler, name)


class EpochWeighted:
    """Weighted draws with replacement that are a function of the epoch (set_epoch)."""

    def __init__(self, weights, count: int, seed: int):
        self.weights, self.count, self.seed, self.epoch = torch.as_tensor(weights, dtype=torch.double), count, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def draw(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1000 + epoch)
        return torch.multinomial(self.weights, self.count, replacement=True, generator=g).tolist()

    def __iter__(self):
        return iter(self.draw(self.epoch))

    def __len__(self) -> int:
        return self.count


def test_weighted_sampler_with_replacement_is_followed_exactly(servers):
    weights = torch.ones(TOTAL, dtype=torch.double)
    weights[:5] = 40.0  # a few heavy samples: repeats are certain
    weights[30:] = 0.0  # and some that never come
    sampler = Recording(torch.utils.data.WeightedRandomSampler(
        weights, num_samples=30, replacement=True, generator=torch.Generator().manual_seed(4)))
    with make_loader(servers.three, sampler=sampler) as loader:
        assert len(loader) == -(-30 // BATCH)
        batches = servers.epoch(loader)
    delivered = flat(batches)
    assert delivered == sampler.passes[-1], "the loader did not deliver the sampler's ids in its order"
    assert len(delivered) == 30 and len(set(delivered)) < 30 and max(delivered) < 30
    labels = collections.defaultdict(set)
    for _, ys, ids in batches:
        for i, y in zip(ids.tolist(), ys.tolist()):
            labels[i].add(y)
    assert all(len(v) == 1 for v in labels.values()), "a repeated sample came with different labels"

    epoch_aware = EpochWeighted(weights, 18, seed=2)
    with make_loader(servers.two, sampler=epoch_aware, drop_last=True) as loader:
        loader.set_epoch(3)
        got = flat(servers.epoch(loader))
    assert got == epoch_aware.draw(3)[:18 - 18 % BATCH], "set_epoch was not passed to the sampler"


def test_resume_with_a_sampler_checks_that_it_gives_the_same_plan(servers):
    weights = torch.ones(TOTAL, dtype=torch.double)
    sampler = Recording(EpochWeighted(weights, 21, seed=2))
    with make_loader(servers.three, sampler=sampler) as loader:
        loader.set_epoch(2)
        before = loader.state_dict()
        assert before["plan"] is None and not sampler.passes, "state_dict() asked the sampler for a pass"
        whole = ids_of(servers.epoch(loader))
        loader.set_epoch(2)
        for k, _batch in enumerate(loader):
            if k == 1:
                state = json.loads(json.dumps(loader.state_dict()))
                break
    assert state["plan"] is not None and state["position"] == 2
    # shuffle means nothing with a sampler: the same plan, so the state is accepted.
    with make_loader(servers.two, sampler=EpochWeighted(weights, 21, seed=2), shuffle=False) as same:
        same.load_state_dict(state)
        assert same.state_dict() == {**state, "shuffle": False}, "a checkpoint right after loading lost the state"
        assert ids_of(servers.epoch(same)) == whole[2:]
    with make_loader(servers.three, sampler=EpochWeighted(weights, 21, seed=3)) as other:
        with pytest.raises(ValueError, match="another plan"):
            other.load_state_dict(state)


def test_seeds_span_uint64_without_aliasing():
    from remoteloader.client import plan as plan_module

    orders = {seed: plan_module.make_plan(64, 64, shuffle=True, seed=seed, epoch=0).batches[0].tolist()
              for seed in (5, 2**63 + 5, 2**64 - 1)}
    assert len({tuple(o) for o in orders.values()}) == 3, "two seeds gave the same order"
