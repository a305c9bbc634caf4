"""The epoch plan: which global sample ids form each batch, as a pure function.

``epoch_plan(n, batch_size, seed=..., epoch=..., rank=..., world_size=...)`` depends on
nothing else, which is what makes resume and failover exact: any process can recompute
the same batches. Global batches are dealt to ranks round-robin so every rank gets the
same number of batches (DDP hangs otherwise) and the ranks together cover every sample
once; with ``drop_last=False`` the remainder is split evenly across ranks, and a rank
left without any remainder sample repeats one (as DistributedSampler pads).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def epoch_order(
    num_samples: int, *, shuffle: bool, seed: int, epoch: int, sampler: Iterable[int] | None = None
) -> np.ndarray:
    """The epoch's sequence of global sample ids, before splitting into batches and ranks."""
    if sampler is not None:
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        ids = np.fromiter((int(i) for i in sampler), dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= num_samples):
            bad = ids[(ids < 0) | (ids >= num_samples)][0]
            raise ValueError(f"sampler yielded sample id {bad}; valid ids are 0..{num_samples - 1}")
        return ids
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, 0x52454D4F])))
    return rng.permutation(num_samples).astype(np.int64)


def split_batches(
    order: np.ndarray, batch_size: int, *, rank: int = 0, world_size: int = 1, drop_last: bool = True
) -> list[np.ndarray]:
    """Deals ``order`` into this rank's batches (equal batch counts on every rank)."""
    per_round = batch_size * world_size
    rounds = len(order) // per_round
    batches = [
        order[(k * world_size + rank) * batch_size : (k * world_size + rank + 1) * batch_size] for k in range(rounds)
    ]
    rest = order[rounds * per_round :]
    if drop_last or rest.size == 0:
        return batches
    if world_size == 1:
        return batches + [rest]
    part = np.array_split(rest, world_size)[rank]
    if part.size == 0:  # fewer leftover samples than ranks: pad so every rank steps equally often
        part = order[rank % len(order) : rank % len(order) + 1]
    return batches + [part]


def num_batches(num_samples: int, batch_size: int, world_size: int, drop_last: bool) -> int:
    rounds, rest = divmod(num_samples, batch_size * world_size)
    return rounds + (1 if rest and not drop_last else 0)


def epoch_plan(
    num_samples: int,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = True,
    sampler: Iterable[int] | None = None,
) -> list[np.ndarray]:
    order = epoch_order(num_samples, shuffle=shuffle, seed=seed, epoch=epoch, sampler=sampler)
    return split_batches(order, batch_size, rank=rank, world_size=world_size, drop_last=drop_last)
