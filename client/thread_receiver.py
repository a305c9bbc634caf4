"""``receiver="thread"``: the links and the engine on the process's I/O event loop.

``ThreadReceiver`` keeps the ``Receiver`` contract (``receiver.py``) from the consumer's
thread by running coroutines on one asyncio loop per process (``io_loop``) and waiting for
them. The receiver process (``receiver_service.py``) runs one of these too.
"""

from __future__ import annotations

import asyncio
import os
import queue
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Any, TypeVar

from remoteloader.client import cpu
from remoteloader.client.assembly import BatchBuffers, Order
from remoteloader.client.batches import Item, LoaderError
from remoteloader.client.discovery import discover
from remoteloader.client.engine import Engine
from remoteloader.client.epoch import Pass
from remoteloader.client.link import Link, LinkState
from remoteloader.client.option_groups import ConnectionOptions, FlowOptions, SecurityOptions
from remoteloader.protos import loader_pb2, malloc

T = TypeVar("T")

_shared: tuple[int, asyncio.AbstractEventLoop, threading.Thread] | None = None
_shared_lock = threading.Lock()
GRPC_THREADS = ("event_engine", "grpc_")  # the names grpc's C++ core gives its threads


def io_loop() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    """The process's one I/O event loop and its daemon thread ("remoteloader-io").

    Every RemoteLoader of a process runs on this loop, and it is never closed. grpc.aio ties
    all the loops that make calls to one process-wide completion queue, and one loop's
    callback may hand a completion to another loop: when a closed loader had closed its own
    loop, a late completion of its cancelled calls raised "Event loop is closed" inside a
    live loader's callback (a training loader beside short-lived evaluation loaders). A
    forked child gets a loop of its own.
    """
    global _shared
    with _shared_lock:
        if _shared is None or _shared[0] != os.getpid() or not _shared[2].is_alive():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="remoteloader-io", daemon=True)
            thread.start()
            _shared = (os.getpid(), loop, thread)
        return _shared[1], _shared[2]


def describe_servers(
    address: str | Iterable[str], connection: ConnectionOptions, security: SecurityOptions
) -> dict[str, loader_pb2.DescribeResponse]:
    """What the servers at ``address`` hold and offer, asked once on the process's I/O loop
    (their connections closed again): what a loader learns before it opens its receiver,
    whose batch memory depends on the fields the servers carry. Raises as ``discover()``."""
    links = [Link[Order](a, _NOT_STREAMING, connection, security) for a in discover(address)]

    async def describe_and_close() -> None:
        try:
            await _describe(links)
        finally:
            await asyncio.gather(*(link.close() for link in links), return_exceptions=True)

    loop, _ = io_loop()
    asyncio.run_coroutine_threadsafe(describe_and_close(), loop).result(timeout=connection.connect_timeout + 5)
    return {link.address: link.describe for link in links if link.describe is not None}


async def _describe(links: list[Link[Order]]) -> None:
    """Describes every link (a refused connection is tried again until connect_timeout); the first
    error closes them all."""
    results = await asyncio.gather(*(link.fetch_describe(starting=True) for link in links), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await asyncio.gather(*(link.close() for link in links), return_exceptions=True)
        raise errors[0]


class _NotStreaming:
    """The events of links that only describe their servers: they never open a stream."""

    def on_chunk(self, link: Link[Any], chunk: Any) -> None:
        raise AssertionError("a describing link received a chunk")

    def on_link_down(self, link: Link[Any], orders: list[Any], exc: BaseException) -> None:
        pass

    def on_link_up(self, link: Link[Any]) -> None:
        pass

    def on_link_lost(self, link: Link[Any]) -> None:
        pass


_NOT_STREAMING = _NotStreaming()


class ThreadReceiver:
    """Links, engine and the asyncio thread they run on, in this process (a ``Receiver``).

    It owns the links (``links``, by address): it makes them in ``discover``, drops and
    closes them in ``forget`` and closes the rest in ``close``; its engine only uses them.

    Args:
        address: As RemoteLoader's; resolved again by every ``discover()``.
        setup: The stream's Setup message.
        buffers: Where batches are received (the consumer's delivery, or the receiver
            process's shared slots).
        flow: The engine's options.
        connection, security: The links' options.
        seed: The loader's seed (the engine's orders carry it).
        described: What the servers said when the loader described them (``describe_servers``):
            their links start with it, and the first ``discover`` reports them without asking again.
    """

    def __init__(
        self,
        address: str | Iterable[str],
        setup: loader_pb2.Setup,
        buffers: BatchBuffers,
        flow: FlowOptions,
        connection: ConnectionOptions,
        security: SecurityOptions,
        seed: int,
        described: Mapping[str, loader_pb2.DescribeResponse] | None = None,
    ):
        malloc.tune_malloc()  # multi-MB messages: see its docstring for the measured effect
        self._address = address
        self._connection, self._security = connection, security
        self.links: dict[str, Link[Order]] = {}
        self._loop, self._thread = io_loop()
        self._pid = os.getpid()
        self._closed = False
        self.engine = Engine(self.links, setup, flow, buffers, seed)
        for address, describe in (described or {}).items():
            link = Link[Order](address, self.engine, connection=connection, security=security)
            link.adopt(describe)
            self.links[address] = link
        self._unreported = list(self.links)  # described before: the first discover() reports them as new
        buffers.listen(self._buffer_freed)  # (told by the buffers themselves: nothing relays it)

    # ---- servers ------------------------------------------------------------------------
    def discover(self) -> tuple[dict[str, loader_pb2.DescribeResponse], list[str]]:
        new = [a for a in discover(self._address) if a not in self.links]
        if new:
            links = [Link[Order](a, self.engine, connection=self._connection, security=self._security) for a in new]
            self._call(self._describe_all(links), timeout=self._connection.connect_timeout + 5)
        reported, self._unreported = self._unreported, []
        return {a: link.describe for a, link in self.links.items() if link.describe is not None}, reported + new

    async def _describe_all(self, links: list[Link[Order]]) -> None:
        await _describe(links)
        self.links.update((link.address, link) for link in links)  # on the loop thread, which reads it

    def forget(self, addresses: list[str]) -> None:
        self._call(self._forget(addresses), timeout=10)

    async def _forget(self, addresses: list[str]) -> None:
        for address in addresses:
            link = self.links.pop(address, None)
            if link is not None:
                await link.close()

    def get_keys(self, owners: list[str], shard_id: str, start: int, count: int) -> list[str]:
        """Asks the first owner that is up, else the first one described (its control channel
        may answer while its stream is down)."""
        links = [self.links[o] for o in owners if o in self.links]
        live = [link for link in links if link.state is LinkState.UP] or [
            link for link in links if link.describe is not None
        ]
        if not live:
            raise LoaderError(f"no server holding shard {shard_id} is reachable to look up keys")
        return self._call(live[0].get_keys(shard_id, start, count), timeout=30)

    def server_stats(self, timeout: float | None = None) -> dict[str, dict]:
        """Reads the links' counters in place, without waiting on anything: ``timeout`` (the
        contract's, for a receiver in another process) has nothing to bound here."""
        return {a: link.counters() for a, link in self.links.items()}

    # ---- epochs -------------------------------------------------------------------------
    def start_epoch(self, played: Pass) -> queue.Queue[Item]:
        self._call(self.engine.start_epoch(played), timeout=None)
        return self.engine.out

    @property
    def playing(self) -> Pass | None:
        return self.engine.playing

    def cancel_epoch(self, played: Pass) -> None:
        if self._on_loop_thread():  # a generator finalized by a collection on the I/O thread
            self._loop.call_soon(self.engine.cancel_epoch, played)
            return
        self._call(_run(self.engine.cancel_epoch, played), timeout=10)

    def consumed(self, played: Pass) -> None:
        self._soon(self.engine.consumed, played)

    def _buffer_freed(self) -> None:
        """A buffer came back (any thread): dispatch goes on, on the I/O loop."""
        self._soon(self.engine.buffer_freed)

    def cpu_seconds(self) -> float:
        # The I/O thread (the process's: other loaders share it) and grpc's own native threads,
        # which read the sockets (for the receiver process, its whole CPU time counts).
        return cpu.thread_cpu(self._thread) + cpu.named_threads_cpu(GRPC_THREADS)

    def stopped(self) -> str | None:
        # It stops only when closed; its thread ends only with the interpreter.
        return None if not self._closed and self._thread.is_alive() else "the RemoteLoader's receiver stopped"

    def close(self) -> None:
        """Ends this loader's epoch, tasks, streams and channels (its links); the shared loop runs on."""
        if self._closed or sys.is_finalizing() or os.getpid() != self._pid:  # at exit the loop is frozen
            return
        if self._on_loop_thread():
            # Garbage collection of a loader in a reference cycle can run on the I/O thread
            # itself, which must not wait for work only it can do: schedule it.
            self._closed = True
            self._loop.create_task(self._close())
            return
        try:
            self._call(self._close(), timeout=10)
        except Exception:
            pass
        self._closed = True

    async def _close(self) -> None:
        self.engine.close()  # first: no order goes to a link being closed
        for link in list(self.links.values()):  # discovery may add or drop links meanwhile
            await link.close()

    def _on_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Runs a coroutine on the loop and waits for it (RuntimeError once closed)."""
        if self._closed or self._loop.is_closed():
            coro.close()
            raise RuntimeError("RemoteLoader is closed")
        if os.getpid() != self._pid:
            coro.close()
            raise RuntimeError(
                f"this RemoteLoader was made in process {self._pid}; its connections do not "
                f"survive fork (gRPC is not fork-safe): use it in the process that made it"
            )
        if self._on_loop_thread():
            coro.close()
            raise RuntimeError("RemoteLoader: a blocking call on its own I/O thread would wait forever")
        return asyncio.run_coroutine_threadsafe(_wrap(coro), self._loop).result(timeout)

    def _soon(self, function: Callable[..., object], *args: object) -> None:
        if self._closed or os.getpid() != self._pid:
            return
        try:
            self._loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # the loop closed meanwhile (interpreter shutdown): nothing to do
            pass


async def _wrap(coro: Awaitable[T]) -> T:
    return await coro


async def _run(function: Callable[..., T], *args: object) -> T:
    return function(*args)
