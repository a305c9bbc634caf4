"""Per-sample and per-transform random seeds: every one comes from splitmix64, defined here once.

A sample's pixels depend only on (seed, epoch, shard, index) and the pipeline, so the same
order gives the same pixels on any server, in any epoch it is replayed, and when a failed
order is re-sent elsewhere. ``sample_seeds`` turns those four numbers into one 64-bit seed
per sample; ``stream_seeds`` turns a sample's seed into independent seeds for each of a
pipeline's transforms. Both are pure functions of their arguments: changing either changes
every image a client has ever been served.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment (2^64 / golden ratio)
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finalizer multipliers
_MASK = (1 << 64) - 1


def _finalize(x):
    """splitmix64's finalizer, on a Python int or on a uint64 array (the same arithmetic on both)."""
    x = ((x ^ (x >> 30)) * _M1) & _MASK
    x = ((x ^ (x >> 27)) * _M2) & _MASK
    return x ^ (x >> 31)


def splitmix64(states):
    """The next splitmix64 output of each state (a Python int, or a uint64 array): the finalizer of
    ``state + GOLDEN``, modulo 2^64."""
    with np.errstate(over="ignore"):
        return _finalize((states + GOLDEN) & _MASK)


@functools.cache  # asked for every order; the ids are the server's own shards (orders naming others are refused)
def shard_key(shard_id: str) -> int:
    """A shard's 64-bit part of its samples' seeds: from its id, so any server agrees on it."""
    return int(hashlib.sha256(shard_id.encode()).hexdigest()[:16], 16)


def sample_seeds(seed: int, epoch: int, shard_key: int | np.ndarray, indices: np.ndarray) -> list[int]:
    """64-bit per-sample seeds from (seed, epoch, shard, index): two splitmix64 rounds over a mix.
    ``shard_key``: the samples' shard's, or each sample's (a uint64 array beside ``indices``)."""
    with np.errstate(over="ignore"):
        x = np.uint64(seed) * np.uint64(GOLDEN) ^ np.uint64(epoch) * np.uint64(_M1)
        x = indices.astype(np.uint64) * np.uint64(_M2) ^ x ^ np.uint64(shard_key)
    return splitmix64(splitmix64(x)).tolist()


def stream_seeds(seed: int, count: int) -> list[int]:
    """The first ``count`` outputs of splitmix64 seeded with ``seed`` (any int, taken modulo 2^64):
    independent 64-bit streams (one per transform generator) from one sample seed.

    Called for every sample with a handful of transforms: Python ints, which cost a
    microsecond here where numpy's per-call overhead costs tens.
    """
    state = seed & _MASK
    out = []
    for _ in range(count):
        state = (state + GOLDEN) & _MASK
        out.append(_finalize(state))
    return out
