"""The contract between a RemoteLoader and its I/O side, which RemoteLoader calls its receiver.

Two receivers keep it: ``ThreadReceiver`` (``receiver="thread"``: links, engine and their
event loop on a thread of the training process) and ``ProcessReceiver``
(``receiver="process"``: the same ThreadReceiver in a child process, served by
``ReceiverService``, with batches in shared memory). The loader sees only this protocol.
"""

from __future__ import annotations

import queue
from typing import Protocol

from remoteloader.client.batches import Item
from remoteloader.client.epoch import Pass
from remoteloader.protos import loader_pb2


class Receiver(Protocol):
    """What a RemoteLoader needs of its I/O side. Blocking calls come from the consumer's thread."""

    def discover(self) -> tuple[dict[str, loader_pb2.DescribeResponse], list[str]]:
        """Resolves the address again and describes servers not seen before.

        Returns every known server's Describe and the addresses that are new. Raises
        ConnectionError/OSError (name resolution, a server that does not answer) and
        PermissionError (refused).
        """

    def forget(self, addresses: list[str]) -> None:
        """Drops servers the loader refused (they are described anew if they show up again)."""

    def get_keys(self, owners: list[str], shard_id: str, start: int, count: int) -> list[str]:
        """Keys of a shard's samples, asked of an owner that is up, else of any owner that was
        described (its stream may be down while it still answers); LoaderError when no owner
        is known."""

    def server_stats(self, timeout: float | None = None) -> dict[str, dict]:
        """Each server's counters (``Link.counters``), by address; ``timeout`` bounds a wait for
        another process (TimeoutError), where the receiver has to ask one."""

    def start_epoch(self, played: Pass) -> queue.Queue[Item]:
        """Starts the pass ``played`` (``epoch.Pass``: its plan from its start, less what was
        done, over its sample space); returns the queue its Batches, then END (or an error),
        arrive on."""

    @property
    def playing(self) -> Pass | None:
        """The pass running (None when none runs)."""

    def cancel_epoch(self, played: Pass) -> None:
        """Stops the pass ``played`` if it still runs (its buffers return to the delivery)."""

    def consumed(self, played: Pass) -> None:
        """The consumer took one batch of the pass ``played`` (one more may be requested); never blocks."""

    def cpu_seconds(self) -> float:
        """CPU seconds spent receiving so far: the I/O thread's, or the receiver process's."""

    def stopped(self) -> str | None:
        """Why the receiver stopped working while the loader is open, or None while it works."""

    def close(self) -> None:
        """Ends its streams and channels (and its process); idempotent."""
