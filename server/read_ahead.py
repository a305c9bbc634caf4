"""Read-ahead: the kernel asked to read upcoming samples' bytes from the local disk.

An order arrives well before its chunks render (a client keeps ``prefetch`` batches of orders in
flight), so the kernel is asked then (``posix_fadvise(WILLNEED)``) to start reading each sample's
byte range from its file into the page cache: in an epoch whose data is not cached (a dataset
larger than the memory, or the first read of it) the disk works while earlier chunks decode,
instead of each worker stalling on each sample's read. Invariants:
* The asking happens on one thread of its own: on a busy disk the call may wait for a slot in
  the disk's queue, and the event loop must not.
* Nothing is read into this process; the kernel fills its page cache, which it may also drop.
  Bytes cached already cost a look-up.
* A file that cannot be opened (gone, or not a file: an LMDB's record) is passed over: the
  worker's own read reports it, as without read-ahead.
* At most ``OPEN_FILES`` files are held open (a tar's samples share one).
"""

from __future__ import annotations

import concurrent.futures
import os

from remoteloader.server.catalog import Location
from remoteloader.server.sample_reads import SampleFiles

OPEN_FILES = 64


class ReadAhead:
    """Asks the kernel, off the event loop, to read samples' byte ranges into the page cache."""

    def __init__(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="read-ahead")
        self._files = SampleFiles(keep=OPEN_FILES)  # (the thread's alone)

    def ask(self, located: list[Location]) -> concurrent.futures.Future[None]:
        """Starts reading ``located``'s ranges; the future is done once every range was asked for."""
        return self._executor.submit(self._advise, located)

    def close(self) -> None:
        """Drops what is still to be asked, waits for the order being asked (a bounded list of
        calls), then closes the files it held open."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._files.close()

    def _advise(self, located: list[Location]) -> None:
        for location in located:
            try:
                fd, _ = self._files.opened(location.path)
                os.posix_fadvise(fd, location.offset, location.length, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass


def available() -> bool:
    """Whether this system can ask for read-ahead (Linux and most Unixes: posix_fadvise)."""
    return hasattr(os, "posix_fadvise")
