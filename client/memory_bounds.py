"""Whether this machine has the host memory a loader's batch buffers take, before any is allocated.

A loader receives into ``prefetch + 2`` batch buffers (host memory, pinned on CUDA, or the
receiver process's shared slots, which replace them), and with ``normalize`` on the CPU it
keeps up to two normalized batches besides. ``check`` refuses options whose buffers would
not fit in what the machine has free for this process (``/proc/meminfo`` MemAvailable, and a
container's cgroup limit less what it uses) times ``SHARE``: a size the kernel's OOM killer
would end the process for (or another process on a shared training host) is a ValueError
naming the arguments to change, in milliseconds, instead.
"""

from __future__ import annotations

from remoteloader.client.options import LoaderOptions
from remoteloader.protos import limits

SHARE = 0.9  # of the memory available: the most a loader's buffers may take (docs: RemoteLoader's prefetch)
_GiB = 1 << 30


def buffer_bytes(options: LoaderOptions) -> int:
    """Host (or pinned, or shared) bytes a loader's batch buffers take, as RemoteLoader's
    docstring counts them: ``(prefetch + 2)`` received batches, and two normalized ones when
    the CPU normalizes."""
    total = options.batch_buffers * options.batch_bytes
    out = options.output
    if out.normalize is not None and out.device.type == "cpu":
        h, w = options.batches.image_size
        itemsize = out.dtype.itemsize
        total += 2 * options.batches.batch_size * h * w * 3 * itemsize
    return total


def available_bytes() -> int | None:
    """Memory this process may still take: MemAvailable, bounded by its cgroup's limit (None:
    not known here, e.g. not Linux)."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    limit = _cgroup_room()
    if limit is not None:
        found.append(limit)
    return min(found) if found else None


def _cgroup_room() -> int | None:
    """A cgroup v2 memory limit less what the group uses (None: no limit, or not cgroup v2)."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        return max(0, int(limit) - used)
    except (OSError, ValueError):
        return None


def check(options: LoaderOptions, available: int | None = None) -> None:
    """ValueError, naming the arguments to change, when the buffers would not fit."""
    available = available_bytes() if available is None else available
    need = buffer_bytes(options)
    if available is None or need <= SHARE * available:
        return
    b, flow = options.batches, options.flow
    h, w = b.image_size
    per_batch = options.batch_bytes
    raise ValueError(
        f"batch_size={b.batch_size}, image_size={h}x{w}, prefetch={flow.prefetch}: the loader's batch buffers "
        f"would take {need / _GiB:.1f} GiB of host memory ((prefetch + 2) x {per_batch / limits.MiB:.1f} MiB "
        f"a batch{', and two normalized batches' if need > options.batch_buffers * per_batch else ''}), more than "
        f"{SHARE:.0%} of the {available / _GiB:.1f} GiB this machine has available: pass a smaller batch_size, "
        f"image_size or prefetch"
    )


__all__ = ["SHARE", "available_bytes", "buffer_bytes", "check"]
