"""An order's samples, from any of the server's shards: each one's shard and its index there.

A client sends one order per batch to each server, holding that server's samples of the batch
whichever of its shards they come from (``loader.proto``, Order): ``Samples.of_order`` checks
one against the shards the server holds, and a chunk is a slice of its order's samples.
Everything a sample's rendering depends on is its shard and index (``server.seeds``), so the
same sample renders the same in any order, chunk or server.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from remoteloader.protos import loader_pb2
from remoteloader.server.catalog import Shard, SyntheticShard
from remoteloader.server.seeds import sample_seeds, shard_key


class OrderError(ValueError):
    """An order that names what this server does not hold, or is not well formed."""


class Samples:
    """Samples in the order they travel: ``shards[which[k]]``'s sample ``indices[k]`` for each k.

    Args:
        shards: The shards the samples come from.
        which: Each sample's shard, as a position in ``shards``.
        indices: Each sample's index in its shard.
    """

    __slots__ = ("shards", "which", "indices", "_ids", "_generated", "_remote")

    def __init__(self, shards: tuple[Shard, ...], which: np.ndarray, indices: np.ndarray):
        self.shards = shards
        self.which = which
        self.indices = indices
        # Per shard, looked up once for an order and shared by its chunks (its slices).
        self._ids = [s.id for s in shards]
        self._generated = np.fromiter((isinstance(s, SyntheticShard) for s in shards), np.bool_, len(shards))
        self._remote = np.fromiter((s.remote for s in shards), np.bool_, len(shards))

    @classmethod
    def of_shard(cls, shard: Shard, indices: np.ndarray) -> Samples:
        """Samples of one shard."""
        indices = np.asarray(indices, np.int64)
        return cls((shard,), np.zeros(len(indices), np.int64), indices)

    @classmethod
    def of_order(cls, order: loader_pb2.Order, held: Mapping[str, Shard]) -> Samples:
        """The samples ``order`` asks for, of the shards ``held`` (by id); OrderError names what is wrong."""
        try:
            shards = tuple(held[shard_id] for shard_id in order.shard_ids)
        except KeyError as exc:
            raise OrderError(f"no shard {exc.args[0]!r} on this server; it holds {_abbrev(list(held))}") from None
        if not shards:
            raise OrderError("it names no shard (Order.shard_ids)")
        if len(set(order.shard_ids)) != len(shards):
            raise OrderError("it names a shard twice in shard_ids")
        n = len(order.indices)
        indices = np.fromiter(order.indices, np.uint64, n)  # (any uint64 may come: checked below)
        if order.shards:
            if len(order.shards) != n:
                raise OrderError(f"it has {n} indices but {len(order.shards)} shard positions")
            which = np.fromiter(order.shards, np.int64, n)
            if int(which.max()) >= len(shards):
                raise OrderError(f"shard position {int(which.max())} is past its {len(shards)} shard_ids")
        elif len(shards) == 1:
            which = np.zeros(n, np.int64)
        else:
            raise OrderError(f"it names {len(shards)} shards but not which sample is of which (Order.shards)")
        sizes = np.fromiter((len(s) for s in shards), np.uint64, len(shards))[which]
        bad = np.flatnonzero(indices >= sizes)
        if bad.size:
            k = int(bad[0])
            shard = shards[which[k]]
            raise OrderError(f"index {int(indices[k])} is out of range for shard {shard.id} of {len(shard)} samples")
        return cls(shards, which, indices.astype(np.int64))

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, part: slice) -> Samples:
        sliced = Samples.__new__(Samples)
        sliced.shards, sliced.which, sliced.indices = self.shards, self.which[part], self.indices[part]
        sliced._ids, sliced._generated, sliced._remote = self._ids, self._generated, self._remote
        return sliced

    def pairs(self) -> Iterator[tuple[Shard, int]]:
        """Each sample's shard and index, in order."""
        shards = self.shards
        return ((shards[w], i) for w, i in zip(self.which.tolist(), self.indices.tolist()))

    def shard(self, position: int) -> Shard:
        return self.shards[int(self.which[position])]

    def key(self, position: int) -> str:
        """The sample's key in its shard (e.g. ``dog/0001.jpg``)."""
        return self.shard(position).key(int(self.indices[position]))

    def labels(self) -> list[int]:
        """Each sample's label, in its own shard's class list."""
        return [int(shard.labels[index]) for shard, index in self.pairs()]

    def shard_ids(self) -> tuple[str, ...]:
        """Each sample's shard id."""
        ids = self._ids
        return tuple(ids[w] for w in self.which.tolist())

    def seeds(self, seed: int, epoch: int) -> list[int]:
        """Each sample's 64-bit seed (``server.seeds``): a function of (seed, epoch, its shard, its index)."""
        keys = np.fromiter((shard_key(s.id) for s in self.shards), np.uint64, len(self.shards))
        return sample_seeds(seed, epoch, keys[self.which], self.indices)

    def generated(self) -> np.ndarray:
        """Whether each sample is the transport benchmark's (``--synthetic``): never decoded, its
        pixels whatever its slot holds."""
        return self._generated[self.which]

    @property
    def synthetic(self) -> bool:
        """Whether they are all the transport benchmark's."""
        return bool(self.generated().all())

    @property
    def remote(self) -> bool:
        """Whether any of them is in an object store."""
        return bool(self._remote[self.which].any())


def _abbrev(items: list[str], limit: int = 5) -> str:
    return ", ".join(items) if len(items) <= limit else f"{', '.join(items[:limit])}... ({len(items)} in all)"
