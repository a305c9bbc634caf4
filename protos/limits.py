"""How large a chunk, a shared slot and a message may be: the one rule both sides size buffers by.

A server streams an order as chunks. A chunk holds as many whole samples as fit in
``chunk_bytes``, and at least one: a sample larger than ``chunk_bytes`` travels alone. A
sample is its pixels, and its mask when the stream asked for masks. A chunk's pixels are
therefore never more than ``max(chunk_bytes, sample_bytes)``, which is what one of the
server's shared slots holds for the largest sample it offers. A message is one chunk's
pixels plus its header (labels and per-sample errors, at most ``HEADER_BYTES``, 1 MiB) and,
when the stream asked for targets, the samples' targets: at most ``TARGET_BYTES`` each, for
at most ``TARGETS_PER_CHUNK`` samples per chunk. The server sends messages up to
``max_message_bytes`` for its largest sample; a client accepts messages up to
``max_message_bytes`` for the sample size it asked for.

A chunk holds at most ``MAX_CHUNK_SAMPLES`` samples. With a wire encoding (``protos.wire``),
a worker writes each sample's encoded image (and mask) over its raw place in the slot and
its size in the slot's last ``SIZES_BYTES``: a little-endian uint32 per image at
``sizes_offset + 4 * i`` and per mask ``4 * MAX_CHUNK_SAMPLES`` further. An encoded part is
never larger than its raw one, so a chunk's message never is either.

Orders go the other way: a sample takes at most ``_SAMPLE_BYTES`` of an order: its index and
its shard's position (varints), and its shard's id where every sample comes from another shard
(ids are at most ``MAX_SHARD_ID_BYTES``), plus a few hundred bytes of numbers; clients send and
servers accept orders of up to ``MAX_ORDER_MESSAGE_BYTES``, so a server's ``max_order_samples``
is at most ``most_order_samples()``.

Describe answers in pages: shards are added to a page while it stays under
``DESCRIBE_PAGE_BYTES``, and every page holds at least one shard with the class list it first
names. No page may pass ``MAX_DESCRIBE_BYTES`` (a server whose single shard and class list would
refuses to start, saying so); clients accept that much, and servers send it.
"""

from __future__ import annotations

MiB = 1 << 20
HEADER_BYTES = MiB  # most bytes of a chunk's header (ChunkHeader), beside its pixels
CHANNELS = 3  # samples are RGB uint8
BUSY_WINDOW = 5.0  # seconds ChunkHeader.workers_busy covers, before the chunk
MAX_ORDER_MESSAGE_BYTES = 16 * MiB  # the largest order message a client sends and a server accepts
TARGET_BYTES = 32 * 1024  # most bytes of one sample's serialized targets (loader_pb2.Targets)
TARGETS_PER_CHUNK = 32  # most samples in a chunk that carries targets
MAX_CHUNK_SAMPLES = 4096  # most samples in any chunk (a slot's size table holds this many)
SIZES_BYTES = 8 * MAX_CHUNK_SAMPLES  # a slot's size table: a uint32 per image and per mask
MAX_SHARD_ID_BYTES = 64  # the longest shard id (a format's name and a 24-digit fingerprint)
# A sample in an order: its index (a uint64 varint), its shard's position (a uint32 varint) and
# its shard's id with its framing (where each sample of the order is from another shard).
_SAMPLE_BYTES = 10 + 5 + 2 + MAX_SHARD_ID_BYTES
_ORDER_BYTES = 4096  # an order's numbers and framing
DESCRIBE_PAGE_BYTES = MiB  # what a page of Describe holds, past its first shard
MAX_DESCRIBE_BYTES = 4 * MiB  # the most any Describe response takes


def sample_bytes(height: int, width: int, mask: bool = False) -> int:
    """Bytes of one ``height`` x ``width`` RGB uint8 sample, and of its uint8 mask with ``mask``."""
    return height * width * (CHANNELS + mask)


def samples_per_chunk(chunk_bytes: int, sample_bytes: int, targets: bool = False) -> int:
    """Whole samples of ``sample_bytes`` in one chunk of ``chunk_bytes``: as many as fit, at least
    one, at most MAX_CHUNK_SAMPLES, and at most TARGETS_PER_CHUNK when the chunk carries targets."""
    fit = min(MAX_CHUNK_SAMPLES, max(1, chunk_bytes // sample_bytes))
    return min(fit, TARGETS_PER_CHUNK) if targets else fit


def slot_bytes(chunk_bytes: int, max_sample_bytes: int) -> int:
    """Bytes that hold any chunk of samples up to ``max_sample_bytes`` each: its pixels, then
    (at the slot's end) its size table; no header."""
    return max(chunk_bytes, max_sample_bytes) + SIZES_BYTES


def pixel_bytes(slot_bytes: int) -> int:
    """Bytes of a slot that hold pixels (and masks); its size table starts there."""
    return slot_bytes - SIZES_BYTES


def max_message_bytes(chunk_bytes: int, sample_bytes: int) -> int:
    """Largest message that carries chunks of samples up to ``sample_bytes``: one chunk's pixels
    plus its header and its samples' targets."""
    return slot_bytes(chunk_bytes, sample_bytes) + HEADER_BYTES + TARGETS_PER_CHUNK * TARGET_BYTES


def most_order_samples() -> int:
    """The most sample indices an order of at most ``MAX_ORDER_MESSAGE_BYTES`` can carry."""
    return (MAX_ORDER_MESSAGE_BYTES - _ORDER_BYTES) // _SAMPLE_BYTES
