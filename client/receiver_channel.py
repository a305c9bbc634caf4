"""What the training process and its receiver process share (``receiver="process"``).

``process_receiver.py`` (the training process's side) starts the child, which runs
``receiver_service.py``; neither imports the other. They share:

* ``SharedSlots``: the batch slots, in one shared memory file (memfd) both map; the child
  receives pixels straight into them, the parent copies (or lends) them out.
* Errors, which cross as (type name, message): ``portable_error`` in the child,
  ``rebuild_error`` in the parent, for the types in ``_ERRORS``.
* The messages (``receiver_messages.py``: one NamedTuple a message), over a socketpair with
  ``multiprocessing.connection``: pickled plain values, numpy arrays, option groups and the
  pass (``epoch.Pass``, with its plan and sample space), which is safe here because both ends
  are this library in processes it started; nothing from the network is ever unpickled. The
  child exits when its parent is gone (it watches its parent pid, and EOF on the socket).
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from remoteloader.client.batches import LoaderError
from remoteloader.protos import limits


class SharedSlots:
    """Batch slots in one shared memory file (memfd) that both processes map."""

    def __init__(self, count: int, slot_bytes: int, fd: int | None = None):
        self.count = count
        self.slot_bytes = slot_bytes
        if fd is None:
            fd = os.memfd_create("remoteloader-batches", getattr(os, "MFD_CLOEXEC", 1))
            try:
                os.posix_fallocate(fd, 0, count * slot_bytes)  # fail here, not with SIGBUS later
            except OSError as exc:
                os.close(fd)
                raise OSError(
                    f"cannot reserve {count * slot_bytes / 2**20:.0f} MiB of shared memory for {count} batches: {exc}"
                ) from None
        self.fd = fd
        self.memory = mmap.mmap(fd, count * slot_bytes)
        try:
            self.memory.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass
        self.array = np.frombuffer(self.memory, dtype=np.uint8)

    def view(self, slot: int, n: int, h: int, w: int) -> np.ndarray:
        start = slot * self.slot_bytes
        return self.array[start : start + n * limits.sample_bytes(h, w)].reshape(n, h, w, limits.CHANNELS)

    def mask_view(self, slot: int, n: int, h: int, w: int) -> np.ndarray:
        """The masks of the batch in ``slot``: after its images."""
        start = slot * self.slot_bytes + n * limits.sample_bytes(h, w)
        return self.array[start : start + n * h * w].reshape(n, h, w)

    def slot_of(self, address: int) -> int:
        return (address - self.array.ctypes.data) // self.slot_bytes


_ERRORS = {
    c.__name__: c
    for c in (LoaderError, ConnectionError, PermissionError, TimeoutError, ValueError, RuntimeError, OSError)
}


def portable_error(exc: BaseException) -> tuple[str, str]:
    """(type name, message) of an error to send to the parent; see rebuild_error."""
    for cls in type(exc).__mro__:
        if cls.__name__ in _ERRORS and _ERRORS[cls.__name__] is cls:
            return cls.__name__, str(exc)
    return "LoaderError", f"{type(exc).__name__}: {exc}"


def rebuild_error(error: tuple[str, str]) -> BaseException:
    """The parent's copy of an error the child sent with portable_error."""
    name, text = error
    return _ERRORS[name](text)
