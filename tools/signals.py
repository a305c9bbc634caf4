"""Ctrl-C and SIGTERM as exceptions, for the commands that must clean up on the way out.

The demo (its servers and temporary dataset) and pack (the shards it had written) remove what
they made when a user presses Ctrl-C or ``docker stop`` sends SIGTERM. Python turns only SIGINT
into an exception, and it swallows (prints) an exception raised while a finalizer runs, any
library's: a stop could be lost there. So ``StopSignals`` raises on either signal *and*
remembers it, and ``raise_if_stopped()``, called at each step of the command's loop, raises it
again.

SIGTERM raises ``Terminated``, never ``KeyboardInterrupt``, even where a command ends both the
same way: under ``python -m``, a KeyboardInterrupt that ends any string ``exec``/``eval``
(dataclasses, namedtuple and torch's imports run many) marks the interpreter, and it then dies
by SIGINT on exit, whatever exit code the command returned after catching it (CPython's
``unhandled_keyboard_interrupt``). For Ctrl-C that death is the shell's convention (it reads
130 either way); for SIGTERM it would be a wrong signal.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# Loaded here, in the parent: a child forked from a threaded process should not dlopen before it execs.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


class Terminated(BaseException):
    """SIGTERM, raised where the command is (as Ctrl-C raises KeyboardInterrupt)."""


_active: StopSignals | None = None  # the StopSignals entered (only one at a time: signal handlers are global)


class StopSignals:
    """While entered, SIGINT raises ``KeyboardInterrupt`` and SIGTERM raises ``Terminated`` in
    the main thread; on exit the previous handlers come back.
    Outside the main thread, where Python cannot set handlers, it does nothing.

    Args:
        once: The first signal stops the command and both are ignored from then on, for good
            (not restored on exit): no second Ctrl-C can cut the clean-up short, not even one
            that comes before the clean-up begins (pack).
        keep_ignored: A signal the parent made this process ignore (a background job's SIGINT)
            stays ignored.
    """

    def __init__(self, *, once: bool = False, keep_ignored: bool = False):
        self.once = once
        self.keep_ignored = keep_ignored
        self.received: int | None = None  # the first signal that came, if one did
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        global _active
        if threading.current_thread() is not threading.main_thread():
            return self
        self.received = None
        for signum in STOP_SIGNALS:
            if not (self.keep_ignored and signal.getsignal(signum) is signal.SIG_IGN):
                self._previous[signum] = signal.signal(signum, self._handle)
        _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        if _active is self:
            _active = None
        if not (self.once and self.received is not None):  # after a stop there is nothing left to stop
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)  # type: ignore[arg-type]  # what getsignal gave back
        self._previous.clear()

    def _handle(self, signum: int, _frame) -> None:
        if self.once:
            for s in STOP_SIGNALS:
                signal.signal(s, signal.SIG_IGN)
        if self.received is None:
            self.received = signum
        self.raise_if_stopped()

    def raise_if_stopped(self) -> None:
        if self.received is not None:
            raise KeyboardInterrupt() if self.received == signal.SIGINT else Terminated()


def raise_if_stopped() -> None:
    """Raises again the signal that stopped the command in progress, if one did (no-op outside one)."""
    if _active is not None:
        _active.raise_if_stopped()


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored for a while: clean-up that a second Ctrl-C must not cut short,
    and the start of worker processes, which are born ignoring them (the parent stops them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def die_with_parent(signum: int = signal.SIGTERM, parent: int | None = None) -> None:
    """In a child process: ``signum`` when the parent dies, even by SIGKILL (Linux; elsewhere a
    no-op). Given the ``parent``'s pid, exits at once if it died already."""
    if _PRCTL is not None:
        _PRCTL(1, signum)  # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:
        os._exit(1)
