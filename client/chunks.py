"""Checking a received chunk against its stream and its order, before any of it is read.

A chunk is a server's answer to part of an order (``protos/loader.proto``, ChunkHeader). The
engine passes every one through ``check`` first: a chunk that does not fit the order it names
(its place in it, its sample count), the stream's shape (height, width, channels, payload size)
or its wire (each sample's encoded part, ``protos/wire.py``), or whose targets do not parse
(``protos/targets.py``), raises ``BadChunk``, and the engine fails that server's link: its orders
go elsewhere, and nothing of the chunk reaches a batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from remoteloader.protos import limits, loader_pb2, wire
from remoteloader.protos import targets as tg


class BadChunk(ValueError):
    """A chunk that does not fit its stream or its order (the message names the server)."""


class Placed(Protocol):
    """What ``check`` reads of the order a chunk names (``assembly.Order``)."""

    received: int

    @property
    def samples(self) -> int: ...


@dataclass(frozen=True)
class StreamShape:
    """What every chunk of a stream must match: the Setup's output size, masks and wire."""

    height: int
    width: int
    masks: bool  # the payload carries a mask after each image's pixels
    fields: bool  # each sample comes with its Targets
    kept: bool  # and they hold fields other than the mask (kept per row)
    wire: str

    @classmethod
    def of(cls, setup: loader_pb2.Setup) -> StreamShape:
        fields = tuple(setup.fields)
        masks = tg.MASK in fields
        return cls(setup.height, setup.width, masks, bool(fields), len(fields) > masks, setup.wire or wire.RAW)

    @property
    def encoded(self) -> bool:
        """Whether chunks carry encoded parts (``protos/wire.py``) rather than raw pixels."""
        return self.wire != wire.RAW

    @property
    def sample_bytes(self) -> int:
        """A sample's raw payload: its pixels, and its mask."""
        return limits.sample_bytes(self.height, self.width, self.masks)


@dataclass(frozen=True)
class Checked:
    """A chunk that passed: where each sample's encoded parts are (None on the raw wire) and
    each sample's targets (None when not read)."""

    parts: list[tuple[int, int]] | None
    targets: list[dict[str, np.ndarray]] | None


def check(
    header: loader_pb2.ChunkHeader,
    payload: int,
    order: Placed | None,
    shape: StreamShape,
    server: str,
    read_targets: bool = True,
) -> Checked:
    """Checks a chunk of ``payload`` bytes against ``order`` (None: an order this link does
    not hold) and ``shape``; raises BadChunk. ``read_targets``: parse the targets (not for
    an order already cancelled, whose rows nobody reads)."""
    expected = header.count * shape.sample_bytes
    if (
        order is None
        or header.start != order.received
        or header.start + header.count > order.samples
        or header.count == 0
        or header.height != shape.height
        or header.width != shape.width
        or header.channels != limits.CHANNELS
        or (payload > expected if shape.encoded else payload != expected)
        or len(header.labels) != header.count
        or len(header.targets) != (header.count if shape.fields else 0)
    ):
        raise BadChunk(
            f"malformed chunk from {server} (order {header.order_id}, start {header.start}, "
            f"count {header.count}, {payload} pixel bytes, expected {expected})"
        )
    parts = None
    if shape.encoded:  # each sample's part of the payload, checked before any is read
        image, mask = limits.sample_bytes(shape.height, shape.width), shape.height * shape.width if shape.masks else 0
        try:
            parts = wire.parts(list(header.encoded_sizes), header.count, image, mask, payload)
        except ValueError as exc:
            raise BadChunk(f"malformed chunk from {server} (order {header.order_id}): {exc}") from None
    targets = None
    if shape.kept and read_targets:
        try:
            targets = [tg.arrays_of(t) for t in header.targets]
        except tg.TargetError as exc:
            raise BadChunk(f"malformed targets from {server} (order {header.order_id}): {exc}") from None
    return Checked(parts, targets)
