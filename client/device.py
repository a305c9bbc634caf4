"""Delivery to the training loop: host buffers, and the CUDA path.

On the CPU, each batch is received into its own buffer (huge-page backed) that is handed to
the user as is, and reused for a later batch once the user has dropped it. Normalization,
when asked for, runs in the consumer's thread, in one pass over cache-sized pieces into an
output buffer from a pool of its own (``normalize_host``).

On CUDA, batches are received into pinned host buffers from a fixed pool. A transfer
thread copies each finished batch to the GPU on its own stream, a few batches ahead of
the training loop, converts uint8 NHWC to the requested dtype in NCHW with channels_last
strides (the NHWC memory already is channels_last: no layout copy) and normalizes it
there, and records an event. A pinned buffer returns to the pool only after its copy's
event has completed; the consumer's stream waits on the batch's event and the tensors
are recorded on it, so the caching allocator never hands their memory out early.

Memory: pinned host memory = (prefetch + 2) x batch bytes; GPU memory for batches
ready ahead of the loop = GPU_AHEAD (2) x output batch bytes.
"""

from __future__ import annotations

import functools
import mmap
import queue
import threading
import warnings
import weakref
from dataclasses import dataclass

import numpy as np
import torch

GPU_AHEAD = 2  # batches converted on the GPU and waiting for the training loop


@dataclass
class Delivered:
    """A batch ready for the consumer (on the target device)."""

    seq: int
    images: torch.Tensor
    labels: torch.Tensor
    ids: torch.Tensor
    failures: list
    nbytes: int
    event: object = None  # torch.cuda.Event the consumer stream must wait on


def normalize_images(images: torch.Tensor, normalize, dtype: torch.dtype) -> torch.Tensor:
    """uint8 NHWC -> dtype NCHW (channels_last memory), (x / 255 - mean) / std."""
    if normalize is None:
        return images
    scale, shift = _affine(tuple(normalize[0]), tuple(normalize[1]), images.device)
    # permute is a view: NHWC memory read as NCHW has channels_last strides already.
    x = images.permute(0, 3, 1, 2).to(torch.float32)
    x = torch.addcmul(shift.view(1, 3, 1, 1), x, scale.view(1, 3, 1, 1))
    return x.to(dtype).contiguous(memory_format=torch.channels_last)


# Elements per piece: 96 KiB of float32 output, inside L2 with its input, and under torch's
# parallel grain (32768 elements), so the per-piece cast to bfloat16/float16 stays in this
# thread: above it, each cast woke torch's OpenMP threads (measured 7-20x slower).
HOST_CHUNK = 3 * 8192


def normalize_host(images: np.ndarray, out: torch.Tensor, normalize) -> torch.Tensor:
    """uint8 NHWC ``images`` -> ``out`` (same shape, floating dtype), (x / 255 - mean) / std.

    The CPU twin of ``normalize_images``: one thread, in pieces that stay in cache, with the
    per-channel factors laid out as long as a piece, so numpy's loops run over contiguous
    memory rather than broadcasting a 3-vector. Measured on a 256x224x224 batch: 0.1 CPU ms
    per image, against 0.73-0.87 for the torch expression (a fresh 154 MB tensor per step,
    and OpenMP threads that spin). Returns ``out`` viewed as NCHW (channels_last strides).
    """
    if not (images.flags.c_contiguous and out.is_contiguous() and out.shape == images.shape):
        raise ValueError(f"normalize_host: expected contiguous {images.shape} input and output, got "
                         f"{out.shape} {'' if out.is_contiguous() else 'non-'}contiguous output")
    dtype = np.float64 if out.dtype == torch.float64 else np.float32
    scale, shift = _host_affine(tuple(normalize[0]), tuple(normalize[1]), dtype)
    src = images.reshape(-1)
    if out.dtype in (torch.float32, torch.float64):
        dst, scratch = out.numpy().reshape(-1), None
    else:  # bfloat16/float16: computed in float32, then cast piece by piece (small: one thread)
        dst, scratch = out.view(-1), np.empty(HOST_CHUNK, np.float32)
    for start in range(0, src.size, HOST_CHUNK):
        piece = src[start:start + HOST_CHUNK]
        n = piece.size
        target = dst[start:start + n] if scratch is None else scratch[:n]
        np.multiply(piece, scale[:n], out=target, dtype=target.dtype)
        np.add(target, shift[:n], out=target)
        if scratch is not None:
            dst[start:start + n].copy_(torch.from_numpy(target))
    return out.permute(0, 3, 1, 2)


@functools.lru_cache(maxsize=16)
def _host_affine(mean: tuple, std: tuple, dtype) -> tuple[np.ndarray, np.ndarray]:
    scale, shift = _affine_terms(mean, std)
    return np.tile(np.array(scale, dtype), HOST_CHUNK // 3), np.tile(np.array(shift, dtype), HOST_CHUNK // 3)


@functools.lru_cache(maxsize=16)
def _affine(mean: tuple, std: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / 255 - mean) / std as x * scale + shift, built once per device (no copy per batch)."""
    scale, shift = _affine_terms(mean, std)
    return (torch.tensor(scale, dtype=torch.float32, device=device),
            torch.tensor(shift, dtype=torch.float32, device=device))


def _affine_terms(mean: tuple, std: tuple) -> tuple[list[float], list[float]]:
    """The per-channel scale and shift of (x / 255 - mean) / std = x * scale + shift."""
    return [1.0 / (255.0 * s) for s in std], [-m / s for m, s in zip(mean, std)]


class HostPool:
    """Batches handed to the user, their memory reused once the user drops them.

    Each batch of 4 MiB or more lives in its own anonymous mapping backed by transparent
    huge pages. A fresh mapping costs the kernel a page fault and a zeroed page for every
    byte received into it: measured in ``benchmarks/wire.py``, zeroing fresh huge pages was
    a fifth of the receiving process's CPU. So when the last tensor using a batch's memory
    is gone (tracked on the numpy array that the tensor keeps alive), the mapping goes back
    to a free list and the next batch of that size is received into memory already mapped.

    Dropping a batch runs no code: the pool holds a plain weak reference to each batch it
    handed out and takes back, whenever it is asked for memory, the mappings whose batch
    is gone. (A finalizer would run inside whatever the dropping thread was doing: a
    garbage collection under this pool's lock, which deadlocked, or a Ctrl-C, which Python
    then swallows.)

    Memory: at most ``keep`` free batches are held; the batches the user still holds, and
    those being received (``prefetch``), are the user's and in flight. A dropped batch's
    mapping stays until the pool is next asked for memory (or cleared).
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
        nbytes = n * h * w * 3 * size
        if nbytes < (4 << 20) or not hasattr(mmap, "MADV_HUGEPAGE"):
            return torch.empty((n, h, w, 3), dtype=dtype)
        with self._lock:
            self._collect()
            spare = self._free.get(nbytes)
            region = spare.pop() if spare else None
        if region is None:
            region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            try:
                region.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        else:
            self.reused += 1
        array = np.frombuffer(region, dtype=np.uint8).reshape(n, h, w, 3 * size)
        # The tensor holds the array until its storage is freed (views and .numpy() included).
        with self._lock:
            self._lent.append((weakref.ref(array), region, nbytes))
        return torch.from_numpy(array).view(dtype)

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


class HostDelivery:
    """CPU: batches handed to the user as received; optional normalization in the consumer thread.

    With a receiver process (``receiver``), batches arrive in its shared slots: each is
    copied out once (or normalized straight out of it) and its slot is given back.

    Normalized batches come from a pool of their own that keeps at most two free: a
    training loop holds one or two at a time, and each is 2-8x the bytes of a uint8 batch.
    """

    def __init__(self, normalize, dtype: torch.dtype, prefetch: int, receiver=None):
        self.normalize = normalize
        self.dtype = dtype
        self.pool = HostPool(keep=prefetch + 2)
        self.out_pool = HostPool(keep=2)
        self.receiver = receiver

    def allocate(self, n: int, h: int, w: int):
        return self.pool.take(n, h, w)

    def release(self, buffer) -> None:
        pass  # once the last reference to it is gone, the pool takes the memory back

    def start(self, source: queue.Queue) -> queue.Queue:
        return source

    @staticmethod
    def hand_over(delivered: Delivered) -> None:
        pass

    def convert(self, batch) -> Delivered:
        images = batch.images
        if self.receiver is not None:
            if self.normalize is None:
                images = self.pool.take(*batch.images.shape[:3])
                # numpy's copy: one thread; torch's copy_ woke OpenMP threads that then spun,
                # which tripled the training process's CPU per GB (perf, benchmarks/wire.py).
                np.copyto(images.numpy(), batch.images)
            else:
                images = self._normalize(batch.images)
            self.receiver.free(batch.images)
        elif self.normalize is not None:
            images = self._normalize(images.numpy())
        return Delivered(batch.seq, images, torch.from_numpy(batch.labels), torch.from_numpy(batch.ids),
                         batch.failures, batch.nbytes)

    def _normalize(self, images: np.ndarray) -> torch.Tensor:
        out = self.out_pool.take(*images.shape[:3], dtype=self.dtype)
        return normalize_host(images, out, self.normalize)

    def close(self, final: bool = False) -> None:
        self.pool.clear()
        self.out_pool.clear()


class PinnedPool:
    """A fixed set of pinned host buffers of ``nbytes`` each, allocated once, reused."""

    def __init__(self, count: int, nbytes: int):
        self.nbytes = nbytes
        self._free = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
        self.count = count
        self._lock = threading.Lock()

    def take(self) -> torch.Tensor | None:
        with self._lock:
            return self._free.pop() if self._free else None

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            assert len(self._free) < self.count, "pinned buffer returned twice"
            self._free.append(buffer)


class CudaDelivery:
    """CUDA: pinned pool, side-stream copies a few batches ahead, GPU normalize.

    Args:
        device: The CUDA device.
        normalize / dtype: As in RemoteLoader.
        batch_bytes: Largest batch in bytes (uint8 NHWC).
        prefetch: Batches in flight from the servers (each holds a pinned buffer).
        on_free: Called (from the transfer thread) when a pinned buffer is back in the pool.
        receiver: A ProcessReceiver: batches arrive in its shared slots, which are pinned
            here (cudaHostRegister) in place of the pool, and go back to it after the copy.
    """

    def __init__(self, device: torch.device, normalize, dtype: torch.dtype, batch_bytes: int, prefetch: int,
                 on_free, receiver=None):
        self.device = device
        self.normalize = normalize
        self.dtype = dtype
        self.receiver = receiver
        self.pool = PinnedPool(prefetch + 2, batch_bytes) if receiver is None else None
        self._registered = register_pinned(receiver.slots.array, device) if receiver is not None else None
        self.on_free = on_free
        self.prefetch = prefetch
        self._stream = torch.cuda.Stream(device)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._owner: dict[int, torch.Tensor] = {}

    def allocate(self, n: int, h: int, w: int):
        base = self.pool.take()
        if base is None:
            return None  # the engine waits for on_free
        view = base[:n * h * w * 3].view(n, h, w, 3)
        self._owner[view.data_ptr()] = base
        return view

    def release(self, view: torch.Tensor) -> None:
        if self.receiver is not None:
            self.receiver.free(view)
            return
        base = self._owner.pop(view.data_ptr(), None)
        if base is not None:
            self.pool.give(base)
            self.on_free()

    def start(self, source: queue.Queue) -> queue.Queue:
        """Starts a transfer thread for one epoch's batches (stopping the previous one)."""
        self.close()
        self._stop = threading.Event()
        out: queue.Queue = queue.Queue(maxsize=GPU_AHEAD)
        self._thread = threading.Thread(target=self._run, args=(source, out, self._stop),
                                        name="remoteloader-cuda", daemon=True)
        self._thread.start()
        return out

    def _run(self, source: queue.Queue, out: queue.Queue, stop: threading.Event) -> None:
        torch.cuda.set_device(self.device)
        torch.set_num_threads(1)
        while not stop.is_set():
            try:
                item = source.get(timeout=0.5)
            except queue.Empty:
                continue
            if not hasattr(item, "images"):  # END or an exception: pass it on and finish
                self._put(out, item, stop)
                return
            try:
                delivered = self._transfer(item)
            except BaseException as exc:  # hand it to the training thread
                self.release(item.images)
                self._put(out, exc, stop)
                return
            self._put(out, delivered, stop)

    def _transfer(self, batch) -> Delivered:
        host = batch.images if isinstance(batch.images, torch.Tensor) else torch.from_numpy(batch.images)
        with torch.cuda.stream(self._stream):
            images = host.to(self.device, non_blocking=True)
            labels = torch.from_numpy(batch.labels).pin_memory().to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
            images = normalize_images(images, self.normalize, self.dtype)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        # The pinned buffer may be refilled only once the copy out of it has finished.
        copied.synchronize()
        self.release(host)
        return Delivered(batch.seq, images, labels, torch.from_numpy(batch.ids), batch.failures, batch.nbytes,
                         ready)

    @staticmethod
    def _put(out: queue.Queue, item, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    @staticmethod
    def hand_over(delivered: Delivered) -> None:
        """In the consumer thread: order its stream after the copy and protect the memory."""
        if delivered.event is None:
            return
        stream = torch.cuda.current_stream(delivered.images.device)
        stream.wait_event(delivered.event)
        delivered.images.record_stream(stream)
        delivered.labels.record_stream(stream)

    def close(self, final: bool = False) -> None:
        """Stops the transfer thread; ``final``: the loader is closing, unpin the slots too."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():  # (a finalizer there)
            self._thread.join(timeout=5)
            if not self._thread.is_alive():
                self._thread = None
        if final and self._registered is not None and self._thread is None:  # no copy can still read it
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None


def register_pinned(array: np.ndarray, device: torch.device) -> int | None:
    """Page-locks memory we did not allocate (the receiver's shared slots) for async copies.

    Registered in ``device``'s context and portable (visible to every context), as torch's
    own pinned memory is. Runs in a short-lived thread: CUDA keeps a failed call as the
    calling thread's "last error", which would otherwise surface at some unrelated kernel
    launch in the training thread. Returns the address to unregister, or None with a
    warning where CUDA refuses (copies then work, staged and synchronous).
    """
    address, nbytes = array.ctypes.data, array.nbytes
    result: list = []

    def register() -> None:
        cuda_host_register_portable = 1
        with torch.cuda.device(device):
            result.append(torch.cuda.cudart().cudaHostRegister(address, nbytes, cuda_host_register_portable))

    thread = threading.Thread(target=register, name="remoteloader-pin")
    thread.start()
    thread.join()
    error = result[0] if result else "no answer"
    if int(getattr(error, "value", error if isinstance(error, int) else -1)) != 0:
        warnings.warn(f"cudaHostRegister of the receiver's {nbytes / 2**20:.0f} MiB of batch slots failed ({error}): "
                      f"host-to-device copies will not overlap compute; receiver='thread' uses torch's own "
                      f"pinned memory instead", stacklevel=3)
        return None
    return address
