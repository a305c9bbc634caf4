"""A sample's bytes from a file on this machine: what the decode workers, the server's mask
reads and ``remoteloader pack`` read, the same way (kept apart from the workers' module, which
loads albumentations, so that pack starts without it).
"""

from __future__ import annotations

import os
from collections import OrderedDict

from remoteloader.server.decode import DecodeError

MAX_SAMPLE_BYTES = 256 << 20  # a sample larger than this is a per-sample failure, not a read


def read_sample(path: str, offset: int, length: int) -> tuple[bytes, int]:
    """Reads ``length`` bytes at ``offset`` (a whole file when offset is 0 and it has that size).

    Returns them with the file's modification time (ns). (os.pread on a bare descriptor:
    a Python file object costs more than reading a sample from the page cache.)
    """
    with SampleFiles() as files:
        return files.read(path, offset, length)


class SampleFiles:
    """Reads samples as ``read_sample`` does, keeping the files last used open (at most ``keep``):
    a decode worker's task reads most of its samples from one or two shards, and opening (and
    fstat-ing) the shard once per sample was a third of reading a sample from the page cache.
    Each file is opened, and its modification time read, once for as long as it stays open (a
    task, at most, in a worker; the read-ahead's thread keeps its own)."""

    KEEP = 4  # files held open at once, by default

    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self._open: OrderedDict[str, tuple[int, int]] = OrderedDict()  # path -> (fd, mtime_ns), least recent first

    def read(self, path: str, offset: int, length: int) -> tuple[bytes, int]:
        """``read_sample(path, offset, length)``."""
        if length > MAX_SAMPLE_BYTES:
            raise DecodeError(f"sample is {length} bytes, over the limit of {MAX_SAMPLE_BYTES}")
        fd, mtime_ns = self.opened(path)
        want = length + 1 if offset == 0 else length
        data = os.pread(fd, want, offset)
        while 0 < len(data) < length:  # a short read (some network file systems): read on
            more = os.pread(fd, want - len(data), offset + len(data))
            if not more:
                break
            data += more
        if len(data) != length:
            raise DecodeError(f"file changed since the server indexed it: read {len(data)} bytes, expected {length}")
        return data, mtime_ns

    def opened(self, path: str) -> tuple[int, int]:
        """The file's descriptor, open, and its modification time (ns) when it was opened; the
        least recently used file is closed past ``keep``. Raises OSError where it cannot open."""
        held = self._open.get(path)
        if held is not None:
            self._open.move_to_end(path)
            return held
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            held = self._open[path] = (fd, os.fstat(fd).st_mtime_ns)
        except OSError:
            os.close(fd)
            raise
        while len(self._open) > self.keep:
            os.close(self._open.popitem(last=False)[1][0])
        return held

    def close(self) -> None:
        for fd, _ in self._open.values():
            os.close(fd)
        self._open.clear()

    def __enter__(self) -> SampleFiles:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
