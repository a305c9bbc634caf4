"""A sample's key names one sample of the server's data: the rule, checked once at start-up.

Each format gives its samples names (``Shard.name_of``): a path under a folder, a tar's member
key, a TFRecord file's ``image/filename`` (or a record's number), a Parquet ``path`` (or a row's
number), a RecordIO ``.idx`` key. Within one file a format keeps them unique where it can (it
numbers the records of a file whose own names repeat); across files the same name may well
recur (``record-00000000`` in every file of a set, Hugging Face's ``path`` in every Parquet file).
So, once all the shards are open, ``make_unique`` finds the names that recur across shards, and
each shard that holds one has its keys carry its file: ``<file>/<name>`` (``Shard.key_prefix``).
A shard's keys therefore depend on its own names and on which other shards of the server share
one: the same on every start with the same data, and the same on replicas of the same data.

It costs one 64-bit hash per sample (numpy, a block of names at a time) and a sort of the hashes:
0.2 to 0.7 s of CPU for a million keys in 100 to 20,000 shards, up to twice that where names recur
(the keys are checked again with their files): ``benchmarks/sample_keys.py``.
"""

from __future__ import annotations

import logging

import numpy as np

from remoteloader.server.catalog import Shard

log = logging.getLogger(__name__)

_BLOCK_BYTES = 1 << 20  # bytes of names hashed at once (bounds the temporary arrays: ~24 bytes a byte, 24 MB)
_MULTIPLIER = np.uint64(0x100000001B3)  # FNV's prime: any odd multiplier of this size will do
_INVERSE = np.uint64(pow(int(_MULTIPLIER), -1, 1 << 64))
_EXAMPLES = 3


def make_unique(shards: list[Shard]) -> None:
    """Sets ``key_prefix`` of the shards whose names recur in another shard, so that every key of
    the server names one sample; warns, with examples, about keys that still name two samples (a
    name repeated within one shard, or two files of the same name)."""
    named = [s for s in shards if type(s).key is Shard.key and len(s)]
    met = _meetings(named)
    if met is None:
        return
    owners, runs = met
    # a run (the samples of one name) whose owners differ: each of its shards carries its file
    across = np.minimum.reduceat(owners, runs) != np.maximum.reduceat(owners, runs)
    which = np.unique(owners[np.repeat(across, np.diff(np.append(runs, len(owners))))])
    for position in which.tolist():
        named[position].key_prefix = f"{named[position].name}/"
    if len(which):
        log.info(
            "%d shard(s) share sample names with another: their keys carry the file (e.g. %r)",
            len(which),
            named[int(which[0])].key(0),
        )
    still = _meetings(named, prefixed=True, examples=True)
    if still is not None:
        owners, runs, examples = still
        log.warning(
            "%d key(s) each name more than one sample (e.g. %s): sample_key() and failures then cannot "
            "say which; give the files unique names, or their samples names unique within each file",
            len(runs),
            ", ".join(repr(e) for e in examples),
        )


def _meetings(shards: list[Shard], prefixed: bool = False, examples: bool = False):
    """The samples whose names (keys where ``prefixed``) another sample has too: None if none,
    else their shards' positions, grouped in runs of one name each, the runs' starts, and with
    ``examples`` the first few such keys. (Two different names whose 64-bit hashes meet, one
    chance in 10**7 for a million names, count as one: that only adds files to keys.)"""
    if not shards:
        return None
    lengths = np.fromiter((len(s) for s in shards), np.int64, len(shards))
    firsts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    sums, sizes = _sums(shards)
    if prefixed:  # prefix + name: the name's sum times M**len(prefix), plus the prefix's own sum
        heads, scales, grown = _prefix_sums(shards)
        sums = np.repeat(heads, lengths) + sums * np.repeat(scales, lengths)
        sizes = sizes + np.repeat(grown, lengths)
    hashes = sums ^ (sizes.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    order = np.argsort(hashes)
    ordered = hashes[order]
    same = ordered[1:] == ordered[:-1]
    if not same.any():
        return None
    shared = np.concatenate([same, [False]]) | np.concatenate([[False], same])
    kept = order[shared]
    owners = np.repeat(np.arange(len(shards)), lengths)[kept]
    runs = np.flatnonzero(np.concatenate([[True], ordered[shared][1:] != ordered[shared][:-1]]))
    if not examples:
        return owners, runs
    shown = []
    for at in runs[:_EXAMPLES].tolist():
        shard = shards[int(owners[at])]
        shown.append(shard.key(int(kept[at] - firsts[owners[at]])))
    return owners, runs, shown


def _prefix_sums(shards: list[Shard]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per shard: its key prefix's sum (as ``_sums`` weighs bytes), M ** its length, its length."""
    mask = (1 << 64) - 1
    heads, scales, grown = [], [], []
    for shard in shards:
        head, scale = 0, 1
        for byte in shard.key_prefix.encode():
            head = (head + byte * scale) & mask
            scale = (scale * int(_MULTIPLIER)) & mask
        heads.append(head)
        scales.append(scale)
        grown.append(len(shard.key_prefix.encode()))
    return np.array(heads, np.uint64), np.array(scales, np.uint64), np.array(grown, np.int64)


def _sums(shards: list[Shard]) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's name as a 64-bit polynomial sum of its bytes (byte j times M**j), and its
    length: all the shards' names as one blob, one numpy pass whatever the number of shards, a
    block of whole names at a time. Each byte is weighed by M to its place in the block, and each
    name's sum then divided by M to the place where it starts (M is odd: it has an inverse
    modulo 2**64)."""
    parts = [s.index_arrays() for s in shards]
    blob = np.concatenate([p["blob"] for p in parts])
    shifts = np.cumsum([0] + [len(p["blob"]) for p in parts[:-1]])
    ends = np.concatenate([np.asarray(p["ends"], np.int64) + shift for p, shift in zip(parts, shifts.tolist())])
    sums = np.empty(len(ends), np.uint64)
    powers, inverses = _powers(min(len(blob), _BLOCK_BYTES))
    first = 0
    while first < len(ends):
        start = int(ends[first - 1]) if first else 0
        stop = max(first + 1, int(np.searchsorted(ends, start + _BLOCK_BYTES, side="right")))
        data = blob[start : int(ends[stop - 1])]
        if len(data) > len(powers):  # (a name longer than a block)
            powers, inverses = _powers(len(data))
        block_starts = np.concatenate([[0], ends[first : stop - 1] - start])
        weighed = np.add.reduceat(data * powers[: len(data)], block_starts)
        sums[first:stop] = weighed * inverses[block_starts]
        first = stop
    return sums, np.diff(ends, prepend=0)


def _powers(count: int) -> tuple[np.ndarray, np.ndarray]:
    """M ** (0 ... count - 1) and the inverses, modulo 2**64 (by doubling: a few multiplications
    of whole arrays)."""
    out = []
    for base in (int(_MULTIPLIER), int(_INVERSE)):
        powers = np.ones(max(count, 1), np.uint64)
        done, step = 1, base
        while done < len(powers):
            more = min(done, len(powers) - done)
            powers[done : done + more] = powers[:more] * np.uint64(step)
            done += more
            step = step * step % (1 << 64)
        out.append(powers)
    return out[0], out[1]
