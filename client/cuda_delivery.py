"""Delivery on CUDA: pinned host buffers, copies on a side stream, normalization on the GPU.

Batches are received into pinned host buffers from a fixed pool (``PinnedPool``), or into
the receiver process's shared slots, pinned in place (``register_pinned``). A transfer
thread copies each finished batch to the GPU on its own stream, a few batches ahead of
the training loop, converts uint8 NHWC to the requested dtype in NCHW with channels_last
strides (the NHWC memory already is channels_last: no layout copy) and normalizes it
there, and records an event. A pinned buffer returns to the pool only after its copy's
event has completed; the consumer's stream waits on the batch's event and the tensors
are recorded on it, so the caching allocator never hands their memory out early.

Memory: pinned host memory = ``LoaderOptions.batch_buffers`` x batch bytes; GPU memory for batches
ready ahead of the loop = GPU_AHEAD (2) x output batch bytes.
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable

import numpy as np
import torch

from remoteloader.client.batches import Batch, Item
from remoteloader.client.delivery import Delivered, Output, Readable, SlotReceiver, row_targets
from remoteloader.client.normalize import Normalize, normalize_images
from remoteloader.protos import limits

GPU_AHEAD = 2  # batches converted on the GPU and waiting for the training loop


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
        buffers: Pinned buffers in the pool, one per batch received, waiting or being copied
            (``LoaderOptions.batch_buffers``).
        receiver: A receiver process's slots (``SlotReceiver``): batches arrive there, which
            are pinned here (cudaHostRegister) in place of the pool, and go back after the copy.
    """

    def __init__(
        self,
        device: torch.device,
        normalize: Normalize | None,
        dtype: torch.dtype,
        batch_bytes: int,
        buffers: int,
        receiver: SlotReceiver | None = None,
    ):
        self.device = device
        self.normalize = normalize
        self.dtype = dtype
        self.receiver = receiver
        self.pool = PinnedPool(buffers, batch_bytes) if receiver is None else None
        self._registered = register_pinned(receiver.slot_memory, device) if receiver is not None else None
        self._freed: Callable[[], None] = lambda: None
        self._stream = torch.cuda.Stream(device)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._owner: dict[int, torch.Tensor] = {}

    def allocate(self, n: int, h: int, w: int) -> torch.Tensor | None:
        assert self.pool is not None, "with a receiver process, batches are received into its slots"
        base = self.pool.take()
        if base is None:
            return None  # the engine waits to hear of a freed one (listen)
        images = base[: n * limits.sample_bytes(h, w)].view(n, h, w, limits.CHANNELS)
        self._owner[images.data_ptr()] = base
        return images

    def masks_for(self, images: torch.Tensor | np.ndarray, n: int, h: int, w: int) -> np.ndarray:
        """The masks' place in the pinned buffer, after the images (batch_bytes counts them)."""
        assert isinstance(images, torch.Tensor), "allocate() lends tensors"
        base = self._owner[images.data_ptr()]
        start = n * limits.sample_bytes(h, w)
        return base[start : start + n * h * w].view(n, h, w).numpy()

    def release(self, images: torch.Tensor | np.ndarray) -> None:
        if self.receiver is not None:
            self.receiver.free(images)
            return
        assert isinstance(images, torch.Tensor), "allocate() lends tensors"
        base = self._owner.pop(images.data_ptr(), None)
        if base is not None and self.pool is not None:
            self.pool.give(base)
            self._freed()

    def listen(self, freed: Callable[[], None]) -> None:
        """``freed`` is called (from the transfer thread) when a pinned buffer is back in the pool."""
        self._freed = freed

    def start(self, source: queue.Queue[Item]) -> Readable[Output]:
        """Starts a transfer thread for one epoch's batches (stopping the previous one)."""
        self.close()
        self._stop = threading.Event()
        out: queue.Queue[Output] = queue.Queue(maxsize=GPU_AHEAD)
        self._thread = threading.Thread(
            target=self._run, args=(source, out, self._stop), name="remoteloader-cuda", daemon=True
        )
        self._thread.start()
        return out

    def _run(self, source: queue.Queue[Item], out: queue.Queue[Output], stop: threading.Event) -> None:
        torch.cuda.set_device(self.device)
        torch.set_num_threads(1)
        while not stop.is_set():
            try:
                item = source.get(timeout=0.5)
            except queue.Empty:
                continue
            if not isinstance(item, Batch):  # END or an exception: pass it on and finish
                self._put(out, item, stop)
                return
            try:
                delivered = self._transfer(item)
            except BaseException as exc:  # hand it to the training thread
                self.release(item.images)
                self._put(out, exc, stop)
                return
            self._put(out, delivered, stop)

    def _transfer(self, batch: Batch) -> Delivered:
        host = batch.images if isinstance(batch.images, torch.Tensor) else torch.from_numpy(batch.images)
        with torch.cuda.stream(self._stream):
            images = host.to(self.device, non_blocking=True)
            labels = torch.from_numpy(batch.labels).pin_memory().to(self.device, non_blocking=True)
            targets: dict = row_targets(batch, self.device)
            if batch.masks is not None:  # pinned with the images
                targets["mask"] = torch.from_numpy(batch.masks).to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
            images = normalize_images(images, self.normalize, self.dtype)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        # The pinned buffer may be refilled only once the copy out of it has finished.
        copied.synchronize()
        self.release(host)
        return Delivered(
            batch.seq, images, labels, torch.from_numpy(batch.ids), batch.failures, batch.nbytes, ready, targets
        )

    @staticmethod
    def _put(out: queue.Queue[Output], item: Output, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def finish(self, item: Batch | Delivered) -> Delivered:
        """In the consumer thread: order its stream after the copy and protect the memory."""
        assert isinstance(item, Delivered), "the transfer thread delivers every batch"
        delivered = item
        if delivered.event is None:
            return delivered
        stream = torch.cuda.current_stream(delivered.images.device)
        stream.wait_event(delivered.event)
        delivered.images.record_stream(stream)
        delivered.labels.record_stream(stream)
        for value in delivered.targets.values():
            for tensor in value if isinstance(value, list) else [value]:
                if tensor is not None:
                    tensor.record_stream(stream)
        return delivered

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
        warnings.warn(
            f"cudaHostRegister of the receiver's {nbytes / 2**20:.0f} MiB of batch slots failed ({error}): "
            f"host-to-device copies will not overlap compute; receiver='thread' uses torch's own "
            f"pinned memory instead",
            stacklevel=3,
        )
        return None
    return address
