"""The global sample space: the union of every server's shards, deduplicated by shard id.

Global sample ids number the distinct shards sorted by id, so they depend only on which
data exists, not on which servers are up or in what order they were listed. Labels (the
class label, multi-labels, box labels and mask values) are remapped from each shard's own
class list onto the loader's: the shards' list itself when they all have the same one (a
COCO file's, whose label 0 is the background), else the sorted union of class names. A class
list is held once however many shards name it (servers describe each list once, too).

Shards that the same servers hold form an owner group (``groups``): a batch's samples of one
group go to one of those servers as one order, whichever of its shards they come from.

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
    class_names: list[str]  # its own label order (one list object for every shard that names the same)
    offset: int = 0  # first global id
    owners: list[str] = field(default_factory=list)  # server addresses holding it
    label_map: np.ndarray | None = None  # shard-local label -> global label; None: the same
    fields: tuple[str, ...] = ()  # target fields its samples carry
    group: int = 0  # its owner group: the shards the same servers hold (SampleSpace.groups)


@dataclass(frozen=True)
class OwnerGroup:
    """Shards that the same servers hold: a batch's samples of them go to one server as one order."""

    owners: tuple[str, ...]  # the servers, in the order they were described


class SampleSpace:
    """Every shard the servers describe, numbered: global ids, owners and a label map.

    Raises ValueError when two servers report one shard id with different sample counts,
    or when the servers hold no shards at all.
    """

    def __init__(self, describes: Mapping[str, loader_pb2.DescribeResponse]):
        shards: dict[str, ShardInfo] = {}
        lists: dict[tuple[str, ...], list[str]] = {(): []}  # each distinct class list once
        for address, describe in describes.items():
            named = [lists.setdefault(tuple(c.names), list(c.names)) for c in describe.class_lists]
            for s in describe.shards:
                info = shards.get(s.id)
                if info is None:
                    names = named[s.class_list - 1] if 0 < s.class_list <= len(named) else lists[()]
                    info = shards[s.id] = ShardInfo(s.id, s.name, int(s.num_samples), names, fields=tuple(s.fields))
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
        used = list({id(s.class_names): s.class_names for s in self.shards}.values())
        shared = len(used) == 1 and len(set(used[0])) == len(used[0])
        self.class_names = list(used[0]) if shared else sorted({c for names in used for c in names})
        index = {c: i for i, c in enumerate(self.class_names)}
        maps = {} if shared else {id(names): np.asarray([index[c] for c in names], np.int64) for names in used if names}
        self.remapped = bool(maps)  # whether any shard's labels are remapped
        groups: dict[tuple[str, ...], int] = {}
        offset = 0
        for s in self.shards:
            s.offset = offset
            offset += s.num_samples
            s.label_map = maps.get(id(s.class_names))
            s.group = groups.setdefault(tuple(s.owners), len(groups))
        self.groups = [OwnerGroup(owners) for owners in groups]
        # Fields in the order of protos.targets.FIELDS, then the extras by name.
        found = {f for s in self.shards for f in s.fields}
        self.fields = tg.in_order(found)
        self.num_samples = offset
        self._starts = np.asarray([s.offset for s in self.shards], dtype=np.int64)
        self.group_of = np.asarray([s.group for s in self.shards], dtype=np.int64)  # per shard

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        """Index into ``self.shards`` of each global id."""
        return np.searchsorted(self._starts, ids, side="right") - 1

    def locate(self, global_id: int) -> tuple[ShardInfo, int]:
        """The shard holding ``global_id`` and the sample's index within it (IndexError if none)."""
        if not 0 <= global_id < self.num_samples:
            raise IndexError(f"sample id {global_id} out of range 0..{self.num_samples - 1}")
        s = self.shards[int(self.shard_of(np.asarray([global_id]))[0])]
        return s, global_id - s.offset

    def offsets(self, shards: np.ndarray) -> np.ndarray:
        """The first global id of each of ``shards`` (indices into ``self.shards``)."""
        return self._starts[shards]

    def global_labels(self, shards: np.ndarray, local: np.ndarray) -> np.ndarray:
        """Samples' labels in their own shard's class list (``shards``: each sample's, an index into
        ``self.shards``) as indices into ``class_names`` (-1 for a label its shard does not list)."""
        out = local
        if not self.remapped:
            return out
        for k in np.unique(shards).tolist():
            label_map = self.shards[k].label_map
            if label_map is None:
                continue
            if out is local:
                out = local.copy()
            mine = shards == k
            values = local[mine]
            ok = (values >= 0) & (values < len(label_map))
            out[mine] = np.where(ok, label_map[np.where(ok, values, 0)], -1)
        return out

    def global_masks(self, shard: int, masks: np.ndarray) -> None:
        """Remaps masks of ``self.shards[shard]`` (class ids per pixel) in place onto ``class_names``;
        values it does not list as classes (255, the ignore index) stay as they are."""
        label_map = self.shards[shard].label_map
        if label_map is None:
            return
        table = np.arange(256, dtype=np.uint8)
        mapped = label_map[:256]
        table[: len(mapped)] = np.where(mapped < 256, mapped, 255)
        masks[...] = table[masks]
