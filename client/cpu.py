"""CPU seconds of processes and threads: the one reader of /proc's counters (Linux; elsewhere,
and for a process or thread that cannot be read, 0.0).

A process's figure is its own user and system time plus that of its children it has reaped
(a restarted worker's time is not lost); a live child is counted by ``tree_cpu``, once.
"""

from __future__ import annotations

import os
import threading
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int | str, reaped: bool = True) -> tuple[int, float] | None:
    """(ppid, CPU seconds) of a process, or None where it cannot be read; ``reaped``: with its
    reaped children's time. A thread's stat (``self/task/TID``) carries its whole process's reaped
    children's time, so a thread's figure is read without it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
        fields = raw[raw.rfind(")") + 2 :].split()
        # fields[1] is the ppid; [11:15] utime, stime and the reaped children's cutime, cstime.
        return int(fields[1]), sum(int(v) for v in fields[11 : 15 if reaped else 13]) / _TICK
    except (OSError, IndexError, ValueError):
        return None


def processes() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, CPU seconds) of every process this one can read."""
    table: dict[int, tuple[int, float]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if entry.isdigit():
            stat = _stat(entry)
            if stat is not None:
                table[int(entry)] = stat
    return table


def process_cpu(pid: int) -> float:
    """CPU seconds of one live process (all its threads, and its reaped children)."""
    stat = _stat(pid)
    return stat[1] if stat is not None else 0.0


def tree_cpu(pid: int, table: dict[int, tuple[int, float]] | None = None) -> float:
    """CPU seconds of a process and all its live descendants (``table``: a ``processes()`` reading)."""
    table = processes() if table is None else table
    children: dict[int, list[int]] = {}
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    total, frontier = 0.0, [pid]
    while frontier:
        current = frontier.pop()
        total += table.get(current, (0, 0.0))[1]
        frontier.extend(children.get(current, ()))
    return total


def named_threads_cpu(prefixes: tuple[str, ...]) -> float:
    """CPU seconds of this process's threads whose name (``comm``: a native thread's, e.g.
    grpc's "event_engine") starts with one of ``prefixes``."""
    total = 0.0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return total
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if not f.read().startswith(prefixes):
                    continue
        except OSError:
            continue
        stat = _stat(f"self/task/{task}", reaped=False)
        total += stat[1] if stat is not None else 0.0
    return total


def thread_cpu(thread: threading.Thread) -> float:
    """CPU seconds of a live thread of this process."""
    try:
        assert thread.ident is not None
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AssertionError, AttributeError, OSError):
        return 0.0
