"""client/plan.py: the shuffled order is a keyed permutation computed batch by batch, checked as
one checks any pseudo-random permutation (every id once, deterministic, keyed by seed and epoch,
displacements and neighbours as numpy's random permutations have them), dealt to ranks by the
same rules as ever, resumable, and held in memory that does not grow with the sample count."""

from __future__ import annotations

import json
import pickle
import time
import tracemalloc

import numpy as np
import pytest

from remoteloader.client import plan
from remoteloader.client.epoch import EpochPosition
from remoteloader.client.plan import Shuffle, make_plan
from remoteloader.client.ranks import Partition

SIZES = [1, 2, 3, 4, 5, 7, 8, 9, 13, 15, 16, 17, 31, 32, 33, 63, 64, 65, 97, 127, 128, 129, 255, 256, 257, 1000,
         1009, 1023, 1024, 1025, 4093, 4096, 65535, 65536, 65537, 100_003, 2**20 - 1, 2**20 + 1]


def every_id(p: plan.EpochPlan) -> np.ndarray:
    return np.concatenate(list(p.batches) or [np.zeros(0, np.int64)])


# ---- the permutation ---------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_the_shuffle_is_a_permutation_of_every_size(n):
    for seed, epoch in ((0, 0), (2**64 - 1, 2**64 - 1)):
        ids = Shuffle(n, seed, epoch)(np.arange(n))
        assert ids.dtype == np.int64 and np.array_equal(np.sort(ids), np.arange(n)), "an id twice, or none"


def test_the_shuffle_is_deterministic_and_keyed_by_seed_and_epoch():
    n, pos = 10_007, np.arange(10_007)
    first = Shuffle(n, 5, 2)(pos)
    assert np.array_equal(Shuffle(n, 5, 2)(pos), first)
    assert np.array_equal(Shuffle(n, 5, 2)(pos[::-1]), first[::-1]), "a position's id depends on it alone"
    orders = [Shuffle(n, seed, epoch)(pos) for seed in (5, 6, 2**63 + 5, 2**64 - 1) for epoch in (2, 3, 2**64 - 1)]
    assert len({o.tobytes() for o in orders}) == len(orders)
    for a, b in zip(orders, orders[1:]):  # not merely different: unrelated (Spearman's rho of two orders)
        assert abs(np.corrcoef(a, b)[0, 1]) < 4.5 / np.sqrt(n)


def test_the_order_is_pinned():
    """The ids a seed gives are part of every saved position's meaning: a change to the permutation
    must change plan.PERMUTATION (and so the digest), and this test with it."""
    p = make_plan(1000, 8, shuffle=True, seed=7, epoch=3)
    assert p.batches[0].tolist() == [747, 942, 201, 510, 340, 735, 461, 463]
    assert p.batches[-1].tolist() == [986, 341, 650, 293, 42, 685, 722, 511]
    assert make_plan(10**9, 4, shuffle=True, seed=7, epoch=3).batches[0].tolist() == [
        89691796, 61996401, 806805850, 873729663]
    assert plan.PERMUTATION == "feistel6-splitmix64-walk/1" and p.digest == "66a158c6d240f771"


def _ks(sample: np.ndarray, cdf) -> float:
    x = np.sort(sample)
    m = x.size
    f = cdf(x)
    return float(max(np.max(np.arange(1, m + 1) / m - f), np.max(f - np.arange(m) / m)))


def _ks2(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.sort(a), np.sort(b)
    both = np.concatenate([a, b])
    below_a, below_b = np.searchsorted(a, both, "right") / a.size, np.searchsorted(b, both, "right") / b.size
    return float(np.max(np.abs(below_a - below_b)))


def triangular(x):  # the CDF of |pos - id| / n in a uniform random permutation (large n): density 2(1 - x)
    return 2 * x - x * x


@pytest.mark.parametrize("n", [100_003, 2**17, 2**17 + 1])
def test_displacements_are_those_of_a_random_permutation(n):
    pos = np.arange(n)
    for seed, epoch in ((0, 0), (1, 0), (0, 1), (2**64 - 1, 7)):
        shift = np.abs(pos - Shuffle(n, seed, epoch)(pos)) / n
        numpys = np.abs(pos - np.random.default_rng([seed % 2**32, epoch]).permutation(n)) / n
        # Kolmogorov-Smirnov at alpha = 0.001: against numpy's permutation and against the exact law
        assert _ks2(shift, numpys) < 1.95 * np.sqrt(2 / n)
        assert _ks(shift, triangular) < 1.95 / np.sqrt(n)
        assert abs(shift.mean() - 1 / 3) < 0.005
        quantiles = np.array([0.1, 0.25, 0.5, 0.75, 0.9])
        assert np.allclose(np.quantile(shift, quantiles), 1 - np.sqrt(1 - quantiles), atol=0.01)


@pytest.mark.parametrize("n", [100_003, 2**17, 2**17 + 1])
def test_neighbours_are_not_kept_together(n):
    pos = np.arange(n)
    for seed, epoch in ((0, 0), (1, 0), (0, 1), (2**64 - 1, 7)):
        ids = Shuffle(n, seed, epoch)(pos)
        where = np.empty(n, np.int64)
        where[ids] = pos
        for seq in (ids, where):  # adjacent positions' ids, and adjacent ids' positions
            # a random permutation keeps about 2 neighbours side by side (Poisson(2): 13 or more, p < 1e-6)
            assert np.count_nonzero(np.abs(np.diff(seq)) == 1) <= 12
            assert _ks(np.abs(np.diff(seq)) / n, triangular) < 1.95 / np.sqrt(n)  # steps as far as anywhere
            assert abs(np.corrcoef(seq[:-1], seq[1:])[0, 1]) < 4.5 / np.sqrt(n)


@pytest.mark.parametrize("n", [2, 3, 8, 10])
def test_each_position_holds_each_id_as_often_over_seeds(n):
    seeds, pos = 2000, np.arange(n)
    counts = np.zeros((n, n))
    for seed in range(seeds):
        counts[pos, Shuffle(n, seed, 0)(pos)] += 1
    expected = seeds / n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < {2: 10.8, 3: 18.5, 8: 85.4, 10: 124.8}[n]  # the chi-square's 0.999 quantile for (n-1)^2 dof


# ---- the plan ---------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 3, 8])
@pytest.mark.parametrize("drop_last", [True, False])
def test_ranks_deal_the_permutation_round_robin_and_cover_every_sample_once(world_size, drop_last):
    n, batch_size, seed, epoch = 10_007, 32, 11, 4
    order = Shuffle(n, seed, epoch)(np.arange(n))
    ranks = [make_plan(n, batch_size, shuffle=True, seed=seed, epoch=epoch, rank=r, world_size=world_size,
                       drop_last=drop_last) for r in range(world_size)]
    assert len({len(p.batches) for p in ranks}) == 1, "ranks with unequal batch counts hang DDP"
    assert len({p.digest for p in ranks}) == 1, "the digest is every rank's"
    for r, p in enumerate(ranks):
        for k in range(n // (batch_size * world_size)):
            start = (k * world_size + r) * batch_size
            assert np.array_equal(p.batches[k], order[start:start + batch_size])
    ids = np.concatenate([every_id(p) for p in ranks])
    rounds = n // (batch_size * world_size) * batch_size * world_size
    if drop_last:
        assert np.array_equal(np.sort(ids), np.sort(order[:rounds]))
    else:
        assert np.array_equal(np.unique(ids), np.arange(n)) and ids.size == n  # 10007 - rounds >= world_size


def test_without_shuffle_the_order_is_the_ids():
    p = make_plan(1000, 64, shuffle=False, seed=3, epoch=9, rank=1, world_size=2, drop_last=False)
    assert p.batches[0].tolist() == list(range(64, 128)) and p.batches[-1].tolist() == list(range(948, 1000))
    assert p.digest == make_plan(1000, 64, shuffle=False, seed=4, epoch=1, rank=0, world_size=2,
                                 drop_last=False).digest, "an unshuffled plan does not depend on seed or epoch"


def test_batches_behave_as_a_list_of_arrays():
    p = make_plan(103, 10, shuffle=True, seed=1, epoch=0, rank=1, world_size=2, drop_last=False)
    listed = list(p.batches)
    assert len(p.batches) == len(listed) == 6 and [len(b) for b in listed] == [10] * 5 + [1]
    assert all(np.array_equal(p.batches[k], listed[k]) for k in range(-6, 6))
    for bad in (6, -7):
        with pytest.raises(IndexError):
            p.batches[bad]
    for part in (slice(2, None), slice(None, None, -2), slice(4, 1, -1), slice(9, 20)):
        assert [b.tolist() for b in p.batches[part]] == [b.tolist() for b in listed[part]]
    assert [p.batches.size(k) for k in range(6)] == [len(b) for b in listed]
    assert [p.batches.samples_from(k) for k in range(8)] == [sum(map(len, listed[k:])) for k in range(8)]
    p.batches[0][:] = -1  # a batch is the caller's own copy
    assert np.array_equal(p.batches[0], listed[0])
    again = pickle.loads(pickle.dumps(p.batches))  # as it travels to a receiver process
    assert [b.tolist() for b in again] == [b.tolist() for b in listed]
    assert len(pickle.dumps(p.batches)) < 2000, "pickled with the ids it computed"


def test_a_samplers_ids_are_its_order_and_its_digest():
    ids = [5, 3, 3, 9, 0, 1, 2]
    p = make_plan(10, 3, shuffle=True, seed=0, epoch=0, sampler=ids, drop_last=False)
    assert [b.tolist() for b in p.batches] == [[5, 3, 3], [9, 0, 1], [2]]
    same = make_plan(10, 3, shuffle=False, seed=1, epoch=0, sampler=ids, drop_last=False)
    assert p.digest == same.digest, "shuffle and seed mean nothing with a sampler: its ids are the plan"
    assert p.digest != make_plan(10, 3, shuffle=True, seed=0, epoch=0, sampler=ids[::-1], drop_last=False).digest


def test_the_digest_is_made_of_what_changes_the_batches():
    base = dict(shuffle=True, seed=1, epoch=2, rank=0, world_size=2, drop_last=True)
    digest = make_plan(1000, 10, **base).digest
    changed = [make_plan(1000, 10, **{**base, key: value}).digest
               for key, value in (("seed", 2), ("epoch", 3), ("world_size", 3), ("shuffle", False))]
    changed += [make_plan(1001, 10, **base).digest, make_plan(1000, 11, **base).digest,
                make_plan(1001, 10, **{**base, "drop_last": False}).digest]
    assert digest not in changed and len(set(changed)) == len(changed)
    assert make_plan(1000, 10, **{**base, "rank": 1}).digest == digest
    assert make_plan(1000, 10, **{**base, "drop_last": False}).digest == digest, "an even split drops nothing"


def test_the_digest_names_the_permutation(monkeypatch):
    digest = make_plan(1000, 10, shuffle=True, seed=1, epoch=2).digest
    monkeypatch.setattr(plan, "PERMUTATION", "another/1")
    assert make_plan(1000, 10, shuffle=True, seed=1, epoch=2).digest != digest


# ---- a billion samples ------------------------------------------------------------------


def test_a_billion_sample_plan_is_made_and_played_in_constant_memory():
    n, batch_size, world_size = 10**9, 256, 8
    tracemalloc.start()
    try:
        started = time.perf_counter()
        p = make_plan(n, batch_size, shuffle=True, seed=3, epoch=1, rank=5, world_size=world_size, drop_last=False)
        first = p.batches[0]
        to_first = time.perf_counter() - started
        taken = [p.batches[k] for k in range(1, 100)] + [p.batches[-1], p.batches[len(p.batches) // 2]]
        digest = p.digest
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"{peak / 2**20:.1f} MiB for a plan of a billion samples"
    assert to_first < 2.0, f"{to_first:.2f} s to the first batch"
    assert len(p.batches) == -(-n // (batch_size * world_size)) and len(first) == batch_size
    assert len(taken[-2]) == p.batches.size(-1) == (n % (batch_size * world_size)) // world_size
    ids = np.concatenate([first, *taken[:-2]])
    assert ids.min() >= 0 and ids.max() < n and np.unique(ids).size == ids.size
    assert digest == make_plan(n, batch_size, shuffle=True, seed=3, epoch=1, rank=0, world_size=world_size,
                               drop_last=False).digest


def test_a_billion_sample_position_resumes_on_another_rank():
    n, batch_size, world_size = 10**9, 256, 4
    identity = {"seed": 3, "num_samples": n, "batch_size": batch_size, "shuffle": True, "drop_last": True,
                "ordered": True}

    def plan_of(epoch: int, part: Partition) -> plan.EpochPlan:
        return make_plan(n, batch_size, shuffle=True, seed=3, epoch=epoch, rank=part.rank,
                         world_size=part.world_size, drop_last=True)

    playing = EpochPosition(plan_of, replayable=True)
    played = playing.next_pass(Partition(1, world_size))
    playing.begin(played)
    for seq in range(5):
        playing.delivered(played, seq)
    state = json.loads(json.dumps(playing.state_dict(identity, Partition(1, world_size))))
    fresh = EpochPosition(plan_of, replayable=True)
    fresh.load(state, identity, None, Partition(2, world_size))
    resumed = fresh.next_pass(Partition(2, world_size))
    assert (resumed.epoch, resumed.start) == (0, 5)
    assert np.array_equal(resumed.plan.batches[5], plan_of(0, Partition(2, world_size)).batches[5])
