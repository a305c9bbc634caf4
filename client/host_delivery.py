"""Delivery on the CPU: batches handed to the user in the memory they were received into.

Each batch is received into its own buffer (huge-page backed, ``HostPool``) that is handed
to the user as is, and reused for a later batch once the user has dropped it. A receiver
process's batches are lent to the user in its slots (``LentSlots``), up to two at a time,
and copied out beyond that.
Normalization, when asked for, runs in the consumer's thread, in one pass over cache-sized
pieces into an output buffer from a pool of its own (``normalize.normalize_host``).
"""

from __future__ import annotations

import mmap
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from remoteloader.client.batches import Batch, Item
from remoteloader.client.delivery import Delivered, Output, Readable, SlotReceiver, row_targets
from remoteloader.client.normalize import Normalize, normalize_host
from remoteloader.protos import limits


class HostPool:
    """Batches handed to the user, their memory reused once the user drops them.

    Each batch of 4 MiB or more lives in its own anonymous mapping, backed by transparent
    huge pages once recycled (``_huge_pages_later``). A fresh mapping costs the kernel a page
    fault and a zeroed page for every byte received into it: measured in
    ``benchmarks/wire.py``, zeroing fresh huge pages was a fifth of the receiving process's
    CPU. So when the last tensor using a batch's memory is gone (tracked on the numpy array
    that the tensor keeps alive), the mapping goes back to a free list and the next batch of
    that size is received into memory already mapped.

    Dropping a batch runs no code: the pool holds a plain weak reference to each batch it
    handed out and takes back, whenever it is asked for memory, the mappings whose batch
    is gone. (A finalizer would run inside whatever the dropping thread was doing: a
    garbage collection under this pool's lock, which deadlocked, or a Ctrl-C, which Python
    then swallows.)

    Memory: at most ``keep`` free batches are held; the batches the user still holds, and
    those being received (``prefetch``), are the user's and in flight. A dropped batch's
    mapping stays until the pool is next asked for memory (or cleared). ``reserve`` maps
    them ahead, faulted in at once (``MAP_POPULATE``), before the first epoch needs them.
    """

    def __init__(self, keep: int):
        self.keep = keep
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lent: list[tuple[weakref.ref, mmap.mmap, int]] = []  # (batch array, its mapping, bytes)
        self._lock = threading.Lock()
        self.reused = 0  # batches received into recycled memory (for tests and stats)

    def take(self, n: int, h: int, w: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """An (n, h, w, 3) tensor of ``dtype``: recycled memory when a batch of its size is free."""
        size = torch.empty((), dtype=dtype).element_size()
        nbytes = n * limits.sample_bytes(h, w) * size
        if not _pooled(nbytes):
            return torch.empty((n, h, w, limits.CHANNELS), dtype=dtype)
        with self._lock:
            self._collect()
            spare = self._free.get(nbytes)
            region = spare.pop() if spare else None
        if region is None:
            region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            self.reused += 1
        array = np.frombuffer(region, dtype=np.uint8).reshape(n, h, w, limits.CHANNELS * size)
        # The tensor holds the array until its storage is freed (views and .numpy() included).
        with self._lock:
            self._lent.append((weakref.ref(array), region, nbytes))
        return torch.from_numpy(array).view(dtype)

    def reserve(self, count: int, n: int, h: int, w: int) -> None:
        """Maps ``count`` free batches of (n, h, w) uint8 now, their pages faulted in by the kernel
        in one call: a first epoch received into fresh mappings paid a page fault per 4 KiB
        of each of them in the training process, while the servers' decoders wanted the same
        cores (measured: 0.22 -> 0.08 CPU-s of the training process over a first epoch of 2,000
        224-px images, and that epoch 0.83x -> 0.86-0.92x the later ones, on 2 cores;
        ``benchmarks/throughput.py --warmup 0``). A loader reserves what its first epoch maps
        anyway (its ``prefetch`` + 2 buffers), when it is made and the servers are idle."""
        nbytes = n * limits.sample_bytes(h, w)
        if not _pooled(nbytes):
            return  # (take() gives such batches from torch's allocator)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        with self._lock:
            free = self._free.setdefault(nbytes, [])
            while len(free) < min(count, self.keep):
                free.append(mmap.mmap(-1, nbytes, flags=flags))

    def _collect(self) -> None:
        """Takes back the mappings of dropped batches, up to ``keep`` free; under _lock."""
        count = sum(len(v) for v in self._free.values())
        lent = []
        for entry in self._lent:
            ref, region, nbytes = entry
            if ref() is not None:
                lent.append(entry)
            elif count < self.keep:
                self._free.setdefault(nbytes, []).append(region)
                count += 1
                _huge_pages_later(region)
            # otherwise the mapping is unmapped when its last reference (region) goes
        self._lent = lent

    def free_batches(self) -> int:
        with self._lock:
            self._collect()
            return sum(len(v) for v in self._free.values())

    def clear(self) -> None:
        with self._lock:
            self._collect()
            self._free.clear()


def _pooled(nbytes: int) -> bool:
    """Whether a batch of ``nbytes`` gets a mapping of its own from the pool (4 MiB or more, where
    huge pages can back it); smaller ones come from torch's allocator."""
    return nbytes >= (4 << 20) and hasattr(mmap, "MADV_HUGEPAGE")


def _huge_pages_later(region: mmap.mmap) -> None:
    """Lets the kernel back a recycled mapping with huge pages from now on (khugepaged merges
    its 4 KiB pages in the background). Not on a fresh one: faulting in zeroed huge pages cost
    5x the 4 KiB ones (145 vs 26 ms per 38.5 MB batch on the 2-core test machine), paid for every
    new batch of the first epoch, while reusing huge pages saves about 1 ms per such batch."""
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass


class LentSlots:
    """A receiver process's slots lent to the user as the batch itself: no copy out of them.

    A training loop holds one or two batches at a time, so at most ``most`` slots are lent;
    a batch beyond those (a loop that keeps its batches) is copied out as before, and the
    receiver always keeps the rest of its slots to receive into. A slot goes back to the
    receiver once every array lent from it is gone (tracked, as in ``HostPool``, by weak
    references checked whenever a batch is delivered: dropping a batch runs no code).
    """

    def __init__(self, receiver: SlotReceiver, most: int = 2):
        self.receiver = receiver
        self.most = most
        self._lent: list[tuple[list[weakref.ref], np.ndarray]] = []  # (the arrays lent, the slot's view)

    def lend(self, pixels: np.ndarray, masks: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None] | None:
        """Arrays of the batch in its slot, for the user; None when ``most`` are lent already."""
        self.collect()
        if len(self._lent) >= self.most:
            return None
        images = pixels.view()  # arrays of their own, alive exactly as long as the user's tensors
        lent_masks = masks.view() if masks is not None else None
        refs = [weakref.ref(a) for a in (images, lent_masks) if a is not None]
        self._lent.append((refs, pixels))
        return images, lent_masks

    def collect(self) -> None:
        """Gives back to the receiver the slots whose lent arrays are all gone."""
        still = []
        for refs, pixels in self._lent:
            if any(ref() is not None for ref in refs):
                still.append((refs, pixels))
            else:
                self.receiver.free(pixels)
        self._lent = still


class HostDelivery:
    """CPU: batches handed to the user as received; optional normalization in the consumer thread.

    Args:
        normalize / dtype: As in RemoteLoader.
        buffers: Free received batches its pool keeps for reuse (``LoaderOptions.batch_buffers``).
        receiver: A receiver process's slots (``SlotReceiver``): batches arrive there, and each
            is lent to the user in its slot (``LentSlots``), or copied out once (or normalized
            straight out of it) and its slot given back.
        batch: (batch_size, height, width): the pool reserves ``buffers`` batches of it at once
            (``HostPool.reserve``); None reserves nothing.

    Normalized batches come from a pool of their own that keeps at most two free: a
    training loop holds one or two at a time, and each is 2-8x the bytes of a uint8 batch.
    """

    def __init__(
        self,
        normalize: Normalize | None,
        dtype: torch.dtype,
        buffers: int,
        receiver: SlotReceiver | None = None,
        batch: tuple[int, int, int] | None = None,
    ):
        self.normalize = normalize
        self.dtype = dtype
        self.pool = HostPool(keep=buffers)
        if batch is not None and receiver is None:  # (a receiver process's batches arrive in its slots)
            self.pool.reserve(buffers, *batch)
        self.out_pool = HostPool(keep=2)
        self.receiver = receiver
        self.lent = LentSlots(receiver) if receiver is not None else None

    def allocate(self, n: int, h: int, w: int) -> torch.Tensor:
        return self.pool.take(n, h, w)

    def masks_for(self, images: Any, n: int, h: int, w: int) -> np.ndarray:
        return np.empty((n, h, w), np.uint8)  # handed to the user as is, like the images

    def release(self, images: Any) -> None:
        pass  # once the last reference to it is gone, the pool takes the memory back

    def listen(self, freed: Callable[[], None]) -> None:
        pass  # allocate always has a buffer (a new one when none is free): nobody waits for one

    def start(self, source: queue.Queue[Item]) -> Readable[Output]:
        return source  # no transfer thread: the consumer converts each batch in finish()

    def finish(self, item: Batch | Delivered) -> Delivered:
        """The batch for the user, in the consumer's thread: lent in the receiver's slot, or
        copied (or normalized) out of it, or as received."""
        assert isinstance(item, Batch), "the host delivery has no transfer thread"
        batch = item
        images: torch.Tensor
        targets: dict = row_targets(batch)
        lent = self.lent.lend(batch.pixels, batch.masks) if self.lent is not None and self.normalize is None else None
        if lent is not None:  # the batch stays in the receiver's slot until the user drops it
            images = torch.from_numpy(lent[0])
            if lent[1] is not None:
                targets["mask"] = torch.from_numpy(lent[1])
        elif self.receiver is not None:  # batch.pixels is the receiver's slot: copy out, give back
            if batch.masks is not None:
                targets["mask"] = torch.from_numpy(batch.masks.copy())
            if self.normalize is None:
                images = self.pool.take(*batch.pixels.shape[:3])
                # numpy's copy: one thread; torch's copy_ woke OpenMP threads that then spun,
                # which tripled the training process's CPU per GB (perf, benchmarks/wire.py).
                np.copyto(images.numpy(), batch.pixels)
            else:
                images = self._normalize(batch.pixels, self.normalize)
            self.receiver.free(batch.pixels)
        else:
            if batch.masks is not None:
                targets["mask"] = torch.from_numpy(batch.masks)
            if self.normalize is not None:
                images = self._normalize(batch.pixels, self.normalize)
            else:
                assert isinstance(batch.images, torch.Tensor), "allocate() lends tensors"
                images = batch.images
        return Delivered(
            batch.seq,
            images,
            torch.from_numpy(batch.labels),
            torch.from_numpy(batch.ids),
            batch.failures,
            batch.nbytes,
            targets=targets,
        )

    def _normalize(self, images: np.ndarray, normalize: Normalize) -> torch.Tensor:
        n, h, w = images.shape[:3]
        out = self.out_pool.take(n, h, w, dtype=self.dtype)
        return normalize_host(images, out, normalize)

    def close(self, final: bool = False) -> None:
        self.pool.clear()
        self.out_pool.clear()
