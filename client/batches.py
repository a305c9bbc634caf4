"""What the engine hands to the consumer: received batches, the end of an epoch, and errors.

An epoch's output queue carries ``Batch`` objects (pixels already in their buffer), then
``END``, or an exception instead of ``END`` when the epoch cannot be finished. These types
cross from the receiver process to the training process, so this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import numpy as np

if TYPE_CHECKING:
    import torch


class _End:
    def __repr__(self) -> str:
        return "END"


END: Final = _End()  # end of an epoch, in the output queue


class LoaderError(RuntimeError):
    """A batch cannot be delivered; the message names the server(s) and samples."""


@dataclass(frozen=True)
class SampleFailure:
    """A sample a server could not decode or augment."""

    sample_id: int
    key: str
    reason: str
    server: str


@dataclass
class Batch:
    """One plan batch as received: uint8 NHWC pixels in a buffer the consumer's delivery lent,
    and, when the loader asked for targets, the masks (uint8 NHW, in the same lent memory) and
    each row's other targets (``targets[field][row]``: an array, or None until it arrives or
    when its sample has none)."""

    seq: int  # its index in the epoch's plan
    ids: np.ndarray  # global sample ids, one per row
    images: torch.Tensor | np.ndarray  # the lent buffer, filled in place
    pixels: np.ndarray  # numpy view of images
    labels: np.ndarray
    remaining: int  # samples not yet received
    failures: list[SampleFailure] = field(default_factory=list)
    nbytes: int = 0
    masks: np.ndarray | None = None
    targets: dict[str, list[np.ndarray | None]] = field(default_factory=dict)


# What an epoch's output queue carries.
Item = Batch | _End | BaseException
