"""The global sample space: the union of every server's shards, deduplicated by shard id.

Global sample ids number the distinct shards sorted by id, so they depend only on which
data exists, not on which servers are up or in what order they were listed. Labels (the
class label, multi-labels, box labels and mask values) are remapped from each shard's own
class list onto the loader's: the shards' list itself when they all have the same one (a
COCO file's, whose label 0 is the background), else the sorted union of class names.

(Not to be confused with the server's catalog, which indexes the files of its own shards:
this is the client's map from every server's shards to global sample ids.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from remoteloader.protos import loader_pb2
from remoteloader.protos import targets as tg


@dataclass
class ShardInfo:
    id: str
    name: str
    num_samples: int
    class_names: list[str]
    offset: int = 0  # first global id
    owners: list[str] = field(default_factory=list)  # server addresses holding it
    label_map: np.ndarray | None = None  # shard-local label -> global label; None: the same
    fields: tuple[str, ...] = ()  # target fields its samples carry


class SampleSpace:
    """Every shard the servers describe, numbered: global ids, owners and a label map.

    Raises ValueError when two servers report one shard id with different sample counts,
    or when the servers hold no shards at all.
    """

    def __init__(self, describes: Mapping[str, loader_pb2.DescribeResponse]):
        shards: dict[str, ShardInfo] = {}
        for address, describe in describes.items():
            for s in describe.shards:
                info = shards.get(s.id)
                if info is None:
                    info = shards[s.id] = ShardInfo(
                        s.id, s.name, int(s.num_samples), list(s.class_names), fields=tuple(s.fields)
                    )
                elif info.num_samples != s.num_samples:
                    raise ValueError(
                        f"shard {s.id} ({s.name}) has {s.num_samples} samples on {address} "
                        f"but {info.num_samples} on {info.owners[0]}"
                    )
                info.owners.append(address)
        if not shards:
            raise ValueError(f"the servers {', '.join(describes)} hold no shards")
        self.shards = [shards[k] for k in sorted(shards)]
        self.shard_ids = tuple(s.id for s in self.shards)  # the order global sample ids follow
        lists = {tuple(s.class_names) for s in self.shards}
        shared = len(lists) == 1 and len(set(next(iter(lists)))) == len(next(iter(lists)))
        self.class_names = (
            list(next(iter(lists))) if shared else sorted({c for s in self.shards for c in s.class_names})
        )
        index = {c: i for i, c in enumerate(self.class_names)}
        offset = 0
        for s in self.shards:
            s.offset = offset
            offset += s.num_samples
            if s.class_names and not shared:
                s.label_map = np.asarray([index[c] for c in s.class_names], dtype=np.int64)
        # Fields in the order of protos.targets.FIELDS, then the extras by name.
        found = {f for s in self.shards for f in s.fields}
        self.fields = tg.in_order(found)
        self.num_samples = offset
        self._starts = np.asarray([s.offset for s in self.shards], dtype=np.int64)

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        """Index into ``self.shards`` of each global id."""
        return np.searchsorted(self._starts, ids, side="right") - 1

    def locate(self, global_id: int) -> tuple[ShardInfo, int]:
        """The shard holding ``global_id`` and the sample's index within it (IndexError if none)."""
        if not 0 <= global_id < self.num_samples:
            raise IndexError(f"sample id {global_id} out of range 0..{self.num_samples - 1}")
        s = self.shards[int(self.shard_of(np.asarray([global_id]))[0])]
        return s, global_id - s.offset

    def global_labels(self, shard: ShardInfo, local: np.ndarray) -> np.ndarray:
        """A shard's own labels as indices into ``class_names`` (-1 for a label it does not list)."""
        if shard.label_map is None:
            return local
        out = np.full(local.shape, -1, dtype=np.int64)
        ok = (local >= 0) & (local < len(shard.label_map))
        out[ok] = shard.label_map[local[ok]]
        return out

    def global_masks(self, shard: ShardInfo, masks: np.ndarray) -> None:
        """Remaps a shard's masks (class ids per pixel) in place onto ``class_names``; values it does
        not list as classes (255, the ignore index) stay as they are."""
        if shard.label_map is None:
            return
        table = np.arange(256, dtype=np.uint8)
        mapped = shard.label_map[:256]
        table[: len(mapped)] = np.where(mapped < 256, mapped, 255)
        masks[...] = table[masks]
