"""Iteration edge cases: stale iterators, resuming unordered epochs, set_epoch after a resume."""

from __future__ import annotations

import numpy as np
import pytest

from remoteloader.client import RemoteLoader
from remoteloader.tools.textures import make_imagefolder


@pytest.fixture(scope="module")
def two(module_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("iteration")
    fast = module_cluster.add(make_imagefolder(root / "fast", ["a", "b"], 30, size=(40, 48), seed=1))
    slow = module_cluster.add(make_imagefolder(root / "slow", ["c"], 30, size=(40, 48), seed=2), "--max-rate", "150")
    return [module_cluster.address(fast), module_cluster.address(slow)]


def loader(addresses, **kwargs):
    options = dict(batch_size=6, image_size=24, pipeline="eval", shuffle=True, seed=3, drop_last=False,
                   return_ids=True, connect_timeout=30)
    options.update(kwargs)
    return RemoteLoader(addresses, **options)


def test_a_stale_iterator_does_not_cancel_the_current_epoch(two):
    with loader(two) as L:
        L.set_epoch(0)
        old = iter(L)
        next(old)
        L.set_epoch(0)
        current = iter(L)
        del old  # its clean-up must leave the new iteration alone
        ids = [i for _, _, batch in current for i in batch.tolist()]
        assert sorted(ids) == list(range(L.num_samples))


def test_a_superseded_iterator_says_so(two):
    with loader(two) as L:
        first = iter(L)
        next(first)
        second = iter(L)
        next(second)
        with pytest.raises(RuntimeError, match="superseded"):
            for _ in first:
                pass


def test_unordered_resume_delivers_the_rest_exactly_once(two):
    with loader(two, ordered=False) as L:
        L.set_epoch(1)
        it = iter(L)
        seen = [next(it)[2].tolist() for _ in range(5)]
        state = L.state_dict()
        del it
    with loader(two, ordered=False) as R:
        R.load_state_dict(state)
        R.set_epoch(1)  # the usual loop calls set_epoch: the loaded position must survive it
        rest = [batch.tolist() for _, _, batch in R]
    everything = [i for batch in seen + rest for i in batch]
    assert sorted(everything) == list(range(R.num_samples)), (state, len(everything))


def test_ordered_resume_after_set_epoch_equals_the_uninterrupted_run(two):
    with loader(two) as L:
        L.set_epoch(2)
        full = [(x.numpy().copy(), ids.tolist()) for x, _, ids in L]
        L.set_epoch(2)
        it = iter(L)
        for _ in range(3):
            next(it)
        state = L.state_dict()
        del it
    with loader(two) as R:
        R.load_state_dict(state)
        R.set_epoch(2)
        rest = [(x.numpy(), ids.tolist()) for x, _, ids in R]
    assert len(rest) == len(full) - 3
    for (xa, ia), (xb, ib) in zip(full[3:], rest):
        assert ia == ib and np.array_equal(xa, xb)


def ids_of(batches) -> list[list[int]]:
    return [b[2].tolist() for b in batches]


def plan_of(L, epoch) -> list[list[int]]:
    return [b.tolist() for b in L.plan(epoch)]


def test_a_loop_without_set_epoch_plays_a_new_epoch_each_pass(two):
    with loader(two) as L:
        passes = [ids_of(list(L)) for _ in range(3)]
        assert passes == [plan_of(L, e) for e in range(3)]
        assert passes[0] != passes[1] != passes[2]


def test_a_loop_that_stops_at_len_or_breaks_moves_on_to_the_next_epoch(two):
    with loader(two) as L:
        it = iter(L)
        first = [ids_of([next(it)])[0] for _ in range(len(L))]  # as Lightning does: no request past len()
        assert first == plan_of(L, 0)
        assert (L.state_dict()["epoch"], L.state_dict()["position"]) == (1, 0), "the epoch did not end"
        assert [e["epoch"] for e in L.stats()["epochs"]] == [0]
        for k, _batch in enumerate(L):
            if k == 1:
                break
        assert (L.state_dict()["epoch"], L.state_dict()["position"]) == (1, 2)  # where it stopped, for a checkpoint
        assert ids_of(list(L)) == plan_of(L, 2)


def test_set_epoch_between_iter_and_the_first_batch_counts(two):
    with loader(two) as L:
        probe = iter(L)  # Lightning's iterability check: never started, it plays nothing
        del probe
        it = iter(L)
        L.set_epoch(5)  # as a hook between iter() and the first batch would
        assert ids_of(list(it)) == plan_of(L, 5)
        assert L.epoch == 6
