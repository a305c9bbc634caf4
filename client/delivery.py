"""The contract between a RemoteLoader and its delivery, which turns received batches into tensors.

Two deliveries keep it: ``HostDelivery`` (the CPU: ``host_delivery.py``) and
``CudaDelivery`` (pinned memory and a side stream: ``cuda_delivery.py``). Each lends the
engine the buffers batches are received into (``allocate``/``release``, the engine's
``BatchBuffers``); the loader passes each epoch's queue through ``start`` and every item it
takes through ``finish``, in the consumer's thread. With a receiver process, batches arrive
in its shared slots instead, and a delivery gives each slot back through the receiver
(``SlotReceiver``) once it has copied the batch out.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from remoteloader.client.assembly import BatchBuffers
from remoteloader.client.batches import Batch, Item, SampleFailure
from remoteloader.protos import targets as tg


@dataclass
class Delivered:
    """A batch ready for the consumer (on the target device)."""

    seq: int
    images: torch.Tensor
    labels: torch.Tensor
    ids: torch.Tensor
    failures: list[SampleFailure]
    nbytes: int
    event: torch.cuda.Event | None = None  # the copy's; the consumer stream must wait on it
    # The batch's targets: "mask" a uint8 [B, H, W] tensor, the others a list of one tensor per
    # row (None for an extra field a row's sample does not have), on the images' device.
    targets: dict[str, Any] = field(default_factory=dict)


# What a delivery's output queue carries: received batches (converted by finish), batches
# delivered already (a transfer thread's), END, or an exception.
Output = Item | Delivered

_T_co = TypeVar("_T_co", covariant=True)


class Readable(Protocol[_T_co]):
    """The reading end of a queue (a ``queue.Queue[Item]`` is a ``Readable[Output]``)."""

    def get(self, block: bool = True, timeout: float | None = None) -> _T_co: ...


class SlotReceiver(Protocol):
    """What a delivery needs of a receiver whose batches arrive in its shared slots
    (``ProcessReceiver``)."""

    @property
    def slot_memory(self) -> np.ndarray:
        """Every batch slot, as one uint8 array (the CUDA delivery pins it in place)."""

    def free(self, images: Any) -> None:
        """Gives the slot a batch's ``images`` view is in back to the receiver."""


def row_targets(batch: Batch, device: torch.device | None = None) -> dict[str, list[torch.Tensor | None]]:
    """Each row's targets as tensors (an empty one where a sample has none of a known field);
    on ``device``, each field copied in one transfer from pinned memory (call it on the copy's stream)."""
    out: dict[str, list[torch.Tensor | None]] = {}
    for name, column in batch.targets.items():
        empty = tg.EMPTY.get(name)
        arrays = [a if a is not None or empty is None else np.zeros(empty[0], empty[1]) for a in column]
        if device is None:
            out[name] = [torch.from_numpy(a) if a is not None else None for a in arrays]
            continue
        present = [a for a in arrays if a is not None]
        if not present or len({a.dtype for a in present}) > 1:  # (rows of one extra field with two dtypes)
            out[name] = [torch.from_numpy(a).to(device) if a is not None else None for a in arrays]
            continue
        flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in present])).pin_memory()
        pieces = iter(flat.to(device, non_blocking=True).split([a.size for a in present]))
        out[name] = [next(pieces).view(a.shape) if a is not None else None for a in arrays]
    return out


class Delivery(BatchBuffers, Protocol):
    """What RemoteLoader needs of its delivery: the engine's ``BatchBuffers`` (``assembly.py``:
    ``allocate``, ``masks_for``, ``release``, ``listen``), and the consumer's side below."""

    def start(self, source: queue.Queue[Item]) -> Readable[Output]:
        """The queue the consumer reads one epoch from: ``source`` itself, or a transfer
        thread's output (stopping the previous epoch's)."""

    def finish(self, item: Batch | Delivered) -> Delivered:
        """In the consumer's thread: the batch as the user gets it."""

    def close(self, final: bool = False) -> None:
        """Stops the epoch's work; ``final``: the loader is closing, free everything."""
