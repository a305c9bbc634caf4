"""The epoch plan: which global sample ids form each batch, as a pure function.

``make_plan(n, batch_size, seed=..., epoch=..., rank=..., world_size=...)`` depends on
nothing else, which is what makes resume and failover exact: any process can recompute
the same batches. Global batches are dealt to ranks round-robin so every rank gets the
same number of batches (DDP hangs otherwise) and the ranks together cover every sample
once; with ``drop_last=False`` the remainder is split evenly across ranks, and a rank
left without any remainder sample repeats one (as DistributedSampler pads).

``EpochPlan`` is one rank's share of an epoch with a digest of every rank's: the same on
all ranks, so that a position saved on one rank is checked, and resumed, on any other.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

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


@dataclass
class EpochPlan:
    """An epoch's batches as rank ``rank`` of ``world_size`` plays them.

    ``digest`` fingerprints every rank's batches (their sample ids and boundaries), so it is
    the same on each rank and changes with anything that changes any rank's batches: the
    order (seed, shuffle, sampler, sample count) or the split (batch size, world size, and
    drop_last where a remainder exists).
    """

    epoch: int
    order: np.ndarray  # the epoch's global sequence of sample ids, before the split
    batch_size: int
    rank: int
    world_size: int
    drop_last: bool
    batches: list[np.ndarray]  # this rank's

    @functools.cached_property
    def digest(self) -> str:
        return batches_digest(
            self.batches
            if rank == self.rank
            else split_batches(
                self.order, self.batch_size, rank=rank, world_size=self.world_size, drop_last=self.drop_last
            )
            for rank in range(self.world_size)
        )


def batches_digest(ranks: Iterable[list[np.ndarray]]) -> str:
    """A fingerprint of ranks' batches: their sample ids and boundaries, rank after rank."""
    h = hashlib.blake2b(digest_size=8)
    for batches in ranks:
        for batch in batches:
            h.update(len(batch).to_bytes(8, "little"))
            h.update(np.ascontiguousarray(batch, dtype="<i8").tobytes())
    return h.hexdigest()


def make_plan(
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
) -> EpochPlan:
    """The epoch's plan for ``rank``: its batches, and the order they split."""
    order = epoch_order(num_samples, shuffle=shuffle, seed=seed, epoch=epoch, sampler=sampler)
    batches = split_batches(order, batch_size, rank=rank, world_size=world_size, drop_last=drop_last)
    return EpochPlan(epoch, order, batch_size, rank, world_size, drop_last, batches)
