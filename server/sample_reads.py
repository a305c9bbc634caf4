"""A sample's bytes from a file on this machine: what the decode workers, the server's mask
reads and ``remoteloader pack`` read, the same way (kept apart from the workers' module, which
loads albumentations, so that pack starts without it).
"""

from __future__ import annotations

import os

from remoteloader.server.decode import DecodeError

MAX_SAMPLE_BYTES = 256 << 20  # a sample larger than this is a per-sample failure, not a read


def read_sample(path: str, offset: int, length: int) -> tuple[bytes, int]:
    """Reads ``length`` bytes at ``offset`` (a whole file when offset is 0 and it has that size).

    Returns them with the file's modification time (ns). (os.pread on a bare descriptor:
    a Python file object costs more than reading a sample from the page cache.)
    """
    if length > MAX_SAMPLE_BYTES:
        raise DecodeError(f"sample is {length} bytes, over the limit of {MAX_SAMPLE_BYTES}")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        mtime_ns = os.fstat(fd).st_mtime_ns
        want = length + 1 if offset == 0 else length
        data = os.pread(fd, want, offset)
        while 0 < len(data) < length:  # a short read (some network file systems): read on
            more = os.pread(fd, want - len(data), offset + len(data))
            if not more:
                break
            data += more
    finally:
        os.close(fd)
    if len(data) != length:
        raise DecodeError(f"file changed since the server indexed it: read {len(data)} bytes, expected {length}")
    return data, mtime_ns
