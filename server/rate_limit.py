"""The server-wide rate limit (``--max-rate``): at most ``rate`` samples rendered per second.

Every stream takes its chunk's samples from one shared budget before the chunk is rendered,
so the limit holds however many streams are open. Work is spaced out evenly, without
bursts: the budget never accumulates while the server is idle.
"""

from __future__ import annotations

import asyncio


class RateLimiter:
    """Spaces out work so that at most ``rate`` samples per second are rendered, server-wide.

    Args:
        rate: Samples per second (positive).
    """

    def __init__(self, rate: float):
        self.rate = rate
        self._next = 0.0  # loop time at which the budget is free again

    async def take(self, count: int) -> None:
        """Waits until ``count`` samples fit in the budget, the first ones included."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._next = max(now, self._next) + count / self.rate
        await asyncio.sleep(self._next - now)
