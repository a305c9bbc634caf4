"""A rendered chunk's payload as it travels: the one place that knows its layout on the wire.

Raw (``Setup.wire`` RAW): the slot's pixels as they lie, every image then (when the stream asks
for masks) every mask, ``protos.limits.sample_bytes`` and height x width bytes each, with no
size table. Encoded: each sample's image (then each mask) as its worker encoded it, of the sizes
the worker wrote in the slot's size table (``protos.limits``), sent as ChunkHeader.encoded_sizes.
Invariants:
* A sample that failed travels as no bytes (size 0), whatever its task left in the table.
* A sample never rendered (a --synthetic one: no task writes its entry) travels raw.
* No encoded size is over the raw size (a worker that wrote one is a server bug).
The pieces are views into the slot, never copies.
"""

from __future__ import annotations

import numpy as np

from remoteloader.protos import limits
from remoteloader.protos.wire import RAW
from remoteloader.server.order_samples import Samples
from remoteloader.server.pipelines import PipelineSpec
from remoteloader.server.shared_memory import Arena
from remoteloader.server.targets import MASK


def chunk_payload(
    spec: PipelineSpec, samples: Samples, arena: Arena, slot: int, count: int, errors: list[tuple[int, str]]
) -> tuple[memoryview | list[memoryview], list[int]]:
    """A rendered chunk's pixels as they travel, and its ChunkHeader.encoded_sizes: the slot's
    raw pixels (and masks), or with a wire encoding each sample's encoded image (then mask)
    as its worker wrote it, of the sizes in the slot's size table (protos.limits)."""
    image = limits.sample_bytes(spec.height, spec.width)
    mask = spec.height * spec.width if MASK in spec.fields else 0
    if spec.wire == RAW:
        return arena.view(slot, count * (image + mask)), []
    sizes = _encoded_sizes(samples, arena, slot, count, errors, image, mask)
    assert all(size <= image for size in sizes[:count]) and all(size <= mask for size in sizes[count:]), (
        "a worker wrote an encoded size over its raw size"
    )
    view = arena.view(slot, count * (image + mask))
    pieces = [view[i * image : i * image + size] for i, size in enumerate(sizes[:count])]
    pieces += [view[count * image + i * mask : count * image + i * mask + size] for i, size in enumerate(sizes[count:])]
    return pieces, sizes


def _encoded_sizes(
    samples: Samples, arena: Arena, slot: int, count: int, errors: list[tuple[int, str]], image: int, mask: int
) -> list[int]:
    """Each sample's encoded image size, then (``mask``) each mask's: the slot's size table, 0 for
    a failed sample, raw for one never rendered."""
    generated = samples.generated()
    if generated.all():  # its pixels were never rendered, so never encoded: raw
        return [image] * count + [mask] * (count if mask else 0)
    table = np.frombuffer(
        arena.view(slot, arena.slot_bytes),
        "<u4",
        2 * limits.MAX_CHUNK_SAMPLES,
        limits.pixel_bytes(arena.slot_bytes),
    )
    sizes = table[:count].tolist() + (
        table[limits.MAX_CHUNK_SAMPLES : limits.MAX_CHUNK_SAMPLES + count].tolist() if mask else []
    )
    for pos, _ in errors:  # (a task that failed whole left its entries as they were)
        sizes[pos] = 0
        if mask:
            sizes[count + pos] = 0
    for pos in np.flatnonzero(generated).tolist():  # (no task wrote theirs: raw)
        sizes[pos] = image
        if mask:
            sizes[count + pos] = mask
    return sizes
