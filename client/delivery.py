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
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from remoteloader.client.batches import Batch, Item, SampleFailure


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


class Delivery(Protocol):
    """What RemoteLoader needs of its delivery (and the engine of its buffers)."""

    def allocate(self, n: int, h: int, w: int) -> Any:
        """A uint8 (n, h, w, 3) buffer to receive a batch into, or None when none is free."""

    def release(self, images: Any) -> None:
        """Takes back a buffer from ``allocate`` (a batch dropped, or copied out)."""

    def start(self, source: queue.Queue[Item]) -> Readable[Output]:
        """The queue the consumer reads one epoch from: ``source`` itself, or a transfer
        thread's output (stopping the previous epoch's)."""

    def finish(self, item: Batch | Delivered) -> Delivered:
        """In the consumer's thread: the batch as the user gets it."""

    def close(self, final: bool = False) -> None:
        """Stops the epoch's work; ``final``: the loader is closing, free everything."""
