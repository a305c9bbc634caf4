"""Dropping files from the page cache, so that the next read of them reads the disk: what the
read-ahead test and the benchmarks of epochs read from disk do (no root needed)."""

from __future__ import annotations

import os


def evict(paths) -> None:
    """Drops each file of ``paths`` from the page cache (written back first). Where the file
    system keeps files only in memory (tmpfs), nothing is dropped."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
