"""An order's samples, from any of the server's shards: each one's shard and its index there.

A client sends one order per batch to each server, holding that server's samples of the batch
whichever of its shards they come from (``loader.proto``, Order): ``Samples.of_order`` checks
one against the shards the server holds, and a chunk is a slice of its order's samples.
Everything a sample's rendering depends on is its shard and index (``server.seeds``), so the
same sample renders the same in any order, chunk or server.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from remoteloader.protos import loader_pb2
from remoteloader.server.catalog import Catalog, Shard
from remoteloader.server.seeds import sample_seeds


class OrderError(ValueError):
    """An order that names what this server does not hold, or is not well formed."""


class Samples:
    """Samples in the order they travel: the catalog's shard ``which[k]``, its sample ``indices[k]``.

    Args:
        catalog: The server's shards.
        which: Each sample's shard, as a position in the catalog.
        indices: Each sample's index in its shard.
    """

    __slots__ = ("catalog", "which", "indices")

    def __init__(self, catalog: Catalog, which: np.ndarray, indices: np.ndarray):
        self.catalog = catalog
        self.which = which
        self.indices = indices

    @classmethod
    def of_shard(cls, catalog: Catalog, shard: Shard, indices: np.ndarray) -> Samples:
        """Samples of one of the catalog's shards."""
        indices = np.asarray(indices, np.int64)
        return cls(catalog, np.full(len(indices), catalog.positions[shard.id], np.int64), indices)

    @classmethod
    def of_order(cls, order: loader_pb2.Order, catalog: Catalog) -> Samples:
        """The samples ``order`` asks for, of the shards in ``catalog``; OrderError names what is wrong."""
        positions = catalog.positions
        try:
            named = np.fromiter((positions[shard_id] for shard_id in order.shard_ids), np.int64, len(order.shard_ids))
        except KeyError as exc:
            raise OrderError(
                f"no shard {exc.args[0]!r} on this server; it holds {_abbrev(list(catalog.ids))}"
            ) from None
        if not len(named):
            raise OrderError("it names no shard (Order.shard_ids)")
        ordered = np.sort(named)
        if bool((ordered[1:] == ordered[:-1]).any()):
            raise OrderError("it names a shard twice in shard_ids")
        n = len(order.indices)
        indices = np.array(order.indices, np.uint64)  # (any uint64 may come: checked below)
        if order.shards:
            if len(order.shards) != n:
                raise OrderError(f"it has {n} indices but {len(order.shards)} shard positions")
            which = np.array(order.shards, np.int64)
            if int(which.max()) >= len(named):
                raise OrderError(f"shard position {int(which.max())} is past its {len(named)} shard_ids")
            which = named[which]
        elif len(named) == 1:
            which = np.full(n, named[0], np.int64)
        else:
            raise OrderError(f"it names {len(named)} shards but not which sample is of which (Order.shards)")
        bad = np.flatnonzero(indices >= catalog.lengths[which].astype(np.uint64))
        if bad.size:
            k = int(bad[0])
            shard = catalog.shards[which[k]]
            raise OrderError(f"index {int(indices[k])} is out of range for shard {shard.id} of {len(shard)} samples")
        return cls(catalog, which, indices.astype(np.int64))

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, part: slice) -> Samples:
        return Samples(self.catalog, self.which[part], self.indices[part])

    def pairs(self) -> Iterator[tuple[Shard, int]]:
        """Each sample's shard and index, in order."""
        shards = self.catalog.shards
        return ((shards[w], i) for w, i in zip(self.which.tolist(), self.indices.tolist()))

    def ids(self) -> np.ndarray:
        """Each sample's server-wide id (``Catalog``)."""
        return self.catalog.starts[self.which] + self.indices

    def shard_ids(self) -> tuple[str, ...]:
        """Each sample's shard id."""
        ids = self.catalog.ids
        return tuple(ids[w] for w in self.which.tolist())

    def shard(self, position: int) -> Shard:
        return self.catalog.shards[int(self.which[position])]

    def key(self, position: int) -> str:
        """The sample's key in its shard (e.g. ``dog/0001.jpg``)."""
        return self.shard(position).key(int(self.indices[position]))

    def labels(self) -> list[int]:
        """Each sample's label, in its own shard's class list."""
        return self.catalog.labels[self.ids()].tolist()

    def seeds(self, seed: int, epoch: int) -> list[int]:
        """Each sample's 64-bit seed (``server.seeds``): a function of (seed, epoch, its shard, its index)."""
        return sample_seeds(seed, epoch, self.catalog.seed_keys[self.which], self.indices)

    def generated(self) -> np.ndarray:
        """Whether each sample is the transport benchmark's (``--synthetic``): never decoded, its
        pixels whatever its slot holds."""
        return self.catalog.generated[self.which]

    @property
    def synthetic(self) -> bool:
        """Whether they are all the transport benchmark's."""
        return bool(self.generated().all())

    @property
    def remote(self) -> bool:
        """Whether any of them is in an object store."""
        return bool(self.catalog.remote[self.which].any())


def _abbrev(items: list[str], limit: int = 5) -> str:
    return ", ".join(items) if len(items) <= limit else f"{', '.join(items[:limit])}... ({len(items)} in all)"
