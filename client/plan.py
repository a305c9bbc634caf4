"""The epoch plan: which global sample ids form each batch, as a pure function.

``make_plan(n, batch_size, seed=..., epoch=..., rank=..., world_size=...)`` depends on
nothing else, which is what makes resume and failover exact: any process can recompute
the same batches. Global batches are dealt to ranks round-robin so every rank gets the
same number of batches (DDP hangs otherwise) and the ranks together cover every sample
once; with ``drop_last=False`` the remainder is split evenly across ranks, and a rank
left without any remainder sample repeats one (as DistributedSampler pads).

The epoch's order is never held whole: batch ``k`` is computed when it is asked for, from
(seed, epoch, rank, world_size, n, batch_size, drop_last) alone. Shuffled, position ``p``
of the epoch holds sample ``Shuffle(n, seed, epoch)(p)``, a keyed pseudo-random permutation
of ``0..n-1`` (a Feistel network over the next power of two, cycle-walking back into
``0..n-1``, as Grain's ``index_shuffle``); unshuffled, sample ``p``. So a rank's memory for
its plan is the same at a thousand samples and at a billion: a few blocks of ids. Only a
user's own sampler, whose ids are theirs, is held as the list it yields.

``EpochPlan`` is one rank's share of an epoch with a digest of every rank's: the same on
all ranks, so that a position saved on one rank is checked, and resumed, on any other.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

# Names the permutation in the plan's digest: a state saved under another one is refused
# (client/epoch.py), never resumed into another order. Change it with the permutation.
PERMUTATION = "feistel6-splitmix64-walk/1"

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's finalizer
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_BLOCK_IDS = 8192  # ids computed at once (and kept: the last block), for consecutive batches


class Shuffle:
    """A keyed pseudo-random permutation of ``0..n-1``, evaluated at any positions.

    A Feistel network of ``ROUNDS`` rounds over ``bits = ceil(log2 n)`` bits (halves of
    ``ceil(bits/2)`` and ``floor(bits/2)`` bits, so the domain is under ``2n``), each round
    keyed from (seed, epoch, n) and mixed by splitmix64's finalizer; a value that lands at
    ``n`` or beyond is run through the network again until it lands inside (cycle-walking),
    which keeps it a permutation of ``0..n-1``. Its memory is its keys.
    """

    ROUNDS = 6

    def __init__(self, n: int, seed: int, epoch: int):
        if n < 1:
            raise ValueError(f"a permutation of {n} samples")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self._high, self._low = (bits + 1) // 2, bits // 2  # the left half's bits, the right half's
        self._keys = [
            np.uint64(k)
            for k in np.random.SeedSequence([seed, epoch, n, 0x52454D4F]).generate_state(self.ROUNDS, np.uint64)
        ]

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The samples at ``positions`` (int64, each in ``0..n-1``)."""
        n = np.uint64(self.n)
        x = self._network(np.asarray(positions, dtype=np.uint64))
        outside = np.flatnonzero(x >= n)
        while outside.size:
            walked = self._network(x[outside])
            x[outside] = walked
            outside = outside[walked >= n]
        return x.astype(np.int64)

    def _network(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(self._low), x & np.uint64((1 << self._low) - 1)
        left_bits, right_bits = self._high, self._low
        for key in self._keys:  # (left, right) -> (right, left ^ F(right)); the halves swap widths
            z = right + key
            z ^= z >> _S30
            z *= _M1
            z ^= z >> _S27
            z *= _M2
            z ^= z >> _S31
            z &= np.uint64((1 << left_bits) - 1)
            z ^= left
            left, right = right, z
            left_bits, right_bits = right_bits, left_bits
        return (left << np.uint64(self._low)) | right  # an even number of rounds: the widths are back


def _sequential(positions: np.ndarray) -> np.ndarray:
    return positions


@dataclass(frozen=True)
class _Given:
    """A user's sampler's order: the ids it yielded, by position."""

    ids: np.ndarray

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        return self.ids[positions]


class Batches(Sequence[np.ndarray]):
    """A rank's batches of an epoch, each computed when asked for (int64 arrays of sample ids).

    ``len()``, ``batches[k]`` (negative too; a slice is another ``Batches``) and iteration,
    as a list of arrays; ``size(k)``: batch ``k``'s length without computing it. It keeps the
    last block of consecutive batches it computed (about 8192 ids), nothing more.
    """

    def __init__(
        self,
        order: Callable[[np.ndarray], np.ndarray],
        length: int,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        drop_last: bool,
        indices: range | None = None,
    ):
        self._order, self._length = order, length  # the epoch's position -> sample id, over 0..length-1
        self.batch_size, self.rank, self.world_size, self.drop_last = batch_size, rank, world_size, drop_last
        self._rounds, self._rest = divmod(length, batch_size * world_size)
        whole = self._rounds + (1 if self._rest and not drop_last else 0)
        self._indices = range(whole) if indices is None else indices
        self._per_block = max(1, _BLOCK_IDS // batch_size)
        self._block: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self._indices)

    @overload
    def __getitem__(self, k: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, k: slice) -> Batches: ...

    def __getitem__(self, k: int | slice) -> np.ndarray | Batches:
        if isinstance(k, slice):
            return Batches(
                self._order,
                self._length,
                self.batch_size,
                rank=self.rank,
                world_size=self.world_size,
                drop_last=self.drop_last,
                indices=self._indices[k],
            )
        return self._batch(self._indices[k])  # IndexError past either end, as a list

    def __iter__(self) -> Iterator[np.ndarray]:
        for k in self._indices:
            yield self._batch(k)

    def size(self, k: int) -> int:
        """The number of ids in batch ``k``, without computing them."""
        return self.batch_size if self._indices[k] < self._rounds else self._remainder_size()

    def _remainder_size(self) -> int:
        if self.world_size == 1:
            return self._rest
        share, extra = divmod(self._rest, self.world_size)
        return max(1, share + (1 if self.rank < extra else 0))  # 1: a rank left without one repeats one

    def samples_from(self, k: int) -> int:
        """The number of ids in batches ``k`` to the last (0 past the end), without computing them."""
        later = self._indices[max(0, k) :]
        total = len(later) * self.batch_size
        if self._rounds in later:  # the remainder batch (drop_last=False), of its own size
            total += self._remainder_size() - self.batch_size
        return total

    def __repr__(self) -> str:
        return (
            f"Batches({len(self)} batches of {self.batch_size}, rank {self.rank} of {self.world_size}, "
            f"{self._length} positions)"
        )

    def __getstate__(self) -> dict:  # pickled (to a receiver process) without the block it keeps
        return {**self.__dict__, "_block": None}

    def _batch(self, k: int) -> np.ndarray:
        if k >= self._rounds:
            return self._remainder()
        first = k - k % self._per_block
        block = self._block
        if block is None or block[0] != first:
            block = (first, self._compute(first, min(first + self._per_block, self._rounds)))
            self._block = block
        return block[1][k - first].copy()

    def _compute(self, first: int, stop: int) -> np.ndarray:
        """Batches ``first..stop-1`` (whole rounds) as rows: batch k is global batch k*world_size+rank."""
        starts = (np.arange(first, stop, dtype=np.int64) * self.world_size + self.rank) * self.batch_size
        positions = (starts[:, None] + np.arange(self.batch_size, dtype=np.int64)).ravel()
        return self._order(positions).reshape(stop - first, self.batch_size)

    def _remainder(self) -> np.ndarray:
        """The last batch with drop_last=False: this rank's even share of what the rounds leave (as
        np.array_split), or, with none left for it, one sample repeated (as DistributedSampler)."""
        done = self._rounds * self.batch_size * self.world_size
        if self.world_size == 1:
            start, stop = done, self._length
        else:
            share, extra = divmod(self._rest, self.world_size)
            start = done + self.rank * share + min(self.rank, extra)
            stop = start + share + (1 if self.rank < extra else 0)
            if stop == start:
                start = self.rank % self._length
                stop = start + 1
        return self._order(np.arange(start, stop, dtype=np.int64))


def num_batches(num_samples: int, batch_size: int, world_size: int, drop_last: bool) -> int:
    rounds, rest = divmod(num_samples, batch_size * world_size)
    return rounds + (1 if rest and not drop_last else 0)


@dataclass
class EpochPlan:
    """An epoch's batches as rank ``rank`` of ``world_size`` plays them (``batches``: lazy).

    ``digest`` fingerprints every rank's batches, so it is the same on each rank and changes
    with anything that changes any rank's batches: the order (the permutation, seed, epoch,
    shuffle, sample count) or the split (batch size, world size, and drop_last where a
    remainder exists). It is made from those parameters, not from the ids, except with a
    user's sampler, whose ids are hashed (they are its order).
    """

    epoch: int
    num_samples: int
    batch_size: int
    rank: int
    world_size: int
    drop_last: bool
    shuffle: bool
    seed: int
    batches: Batches  # this rank's
    sampled: np.ndarray | None = None  # a user's sampler's ids, in its order (None: the plan's own order)

    @functools.cached_property
    def digest(self) -> str:
        if self.sampled is not None:
            return self.ids_digest()
        remainder = self.num_samples % (self.batch_size * self.world_size) != 0
        order = f"{PERMUTATION} seed={self.seed} epoch={self.epoch}" if self.shuffle else "sequential"
        split = f"batch_size={self.batch_size} world_size={self.world_size} drop_last={self.drop_last and remainder}"
        h = hashlib.blake2b(f"plan/2 {order} n={self.num_samples} {split}".encode(), digest_size=8)
        return h.hexdigest()

    def ids_digest(self, every_rank: bool = True) -> str:
        """A fingerprint of the ids themselves: every rank's batches (or this rank's), as
        states of version 2 (1) carry it. Reads the whole epoch: for a sampler's plan and for
        checking an older state, never on the way of an epoch."""
        return batches_digest(self._of_rank(rank) for rank in (range(self.world_size) if every_rank else [self.rank]))

    def _of_rank(self, rank: int) -> Batches:
        if rank == self.rank:
            return self.batches
        b = self.batches
        return Batches(b._order, b._length, b.batch_size, rank=rank, world_size=b.world_size, drop_last=b.drop_last)


def batches_digest(ranks: Iterable[Iterable[np.ndarray]]) -> str:
    """A fingerprint of ranks' batches: their sample ids and boundaries, rank after rank."""
    h = hashlib.blake2b(digest_size=8)
    for batches in ranks:
        for batch in batches:
            h.update(len(batch).to_bytes(8, "little"))
            h.update(np.ascontiguousarray(batch, dtype="<i8").tobytes())
    return h.hexdigest()


def sampler_ids(num_samples: int, epoch: int, sampler: Iterable[int]) -> np.ndarray:
    """A user's sampler's ids for ``epoch`` (its ``set_epoch`` called first, if it has one)."""
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    ids = np.fromiter((int(i) for i in sampler), dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= num_samples):
        bad = ids[(ids < 0) | (ids >= num_samples)][0]
        raise ValueError(f"sampler yielded sample id {bad}; valid ids are 0..{num_samples - 1}")
    return ids


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
    """The epoch's plan for ``rank``: its batches, computed as they are asked for."""
    sampled = None
    order: Callable[[np.ndarray], np.ndarray]
    if sampler is not None:
        sampled = sampler_ids(num_samples, epoch, sampler)
        order, length = _Given(sampled), len(sampled)
    elif shuffle and num_samples:
        order, length = Shuffle(num_samples, seed, epoch), num_samples
    else:
        order, length = _sequential, num_samples
    batches = Batches(order, length, batch_size, rank=rank, world_size=world_size, drop_last=drop_last)
    return EpochPlan(epoch, num_samples, batch_size, rank, world_size, drop_last, shuffle, seed, batches, sampled)
