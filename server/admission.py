"""Which streams a server admits: at most ``max_streams`` open in all and ``max_streams_per_client``
per client host.

A stream counts from the moment it is admitted until its handler returns, whatever it does
in between (waiting for its Setup included), so the counts are exactly the streams holding
a place; the ``remoteloader_active_streams`` gauge reads ``active``. (The slots' fair shares
count the streams past their Setup, by job: server.slots.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class StreamAdmission:
    """Counts open streams, in all and per client host, against the server's two limits.

    Args:
        max_streams: Most streams open at once in all.
        max_per_client: Most streams open at once from one client host.
    """

    def __init__(self, max_streams: int, max_per_client: int):
        self.max_streams = max_streams
        self.max_per_client = max_per_client
        self._by_client: dict[str, int] = {}

    @property
    def active(self) -> int:
        """Streams open now."""
        return sum(self._by_client.values())

    def refusal(self, client: str) -> str | None:
        """The limit a new stream from ``client`` would exceed (as the error names it), or None."""
        if self.active >= self.max_streams:
            return f"max_streams={self.max_streams}"
        if self._by_client.get(client, 0) >= self.max_per_client:
            return f"max_streams_per_client={self.max_per_client} (client {client})"
        return None

    @contextlib.contextmanager
    def hold(self, client: str) -> Iterator[None]:
        """Counts a stream from ``client`` as open for the duration of the block."""
        self._by_client[client] = self._by_client.get(client, 0) + 1
        try:
            yield
        finally:
            self._by_client[client] -= 1
            if not self._by_client[client]:
                del self._by_client[client]


def client_address(peer: str) -> str:
    """'ipv4:10.0.0.5:41234' -> 'ipv4:10.0.0.5' (streams are counted per client host)."""
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer
