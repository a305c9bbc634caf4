"""The I/O side of a RemoteLoader: links to the servers, the engine, and their event loop.

``Receiver`` runs them on an asyncio thread inside the training process. ``ProcessReceiver``
runs the same ``Receiver`` in a child process (a fresh interpreter running ``receiver.main``)
that receives the pixels straight into batch slots of shared memory; the training process
then only exchanges small messages with it (which slot holds which batch, which slot is
free again) and copies each batch out of its slot once, to the GPU when on CUDA. Receiving
costs gRPC about 0.5 CPU-seconds per GB (Python grpcio copies every message twice before we
see it), which in the training process would be ~0.1 core-s per 1000 224-px images and
would contend for its GIL; in the receiver process it costs the training process nothing.

The two processes talk over a socketpair with ``multiprocessing.connection`` (pickled tuples
of plain values, numpy arrays and the catalog; errors as (type name, message)), which is
safe here because both ends are this library in processes it started; nothing from the
network is ever unpickled. The child exits when its parent is gone (it watches its parent
pid, and EOF on the socket).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import mmap
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection

import numpy as np

from remoteloader.client.catalog import Catalog
from remoteloader.client.discovery import discover
from remoteloader.client.engine import END, Batch, Engine, LoaderError
from remoteloader.client.link import Link
from remoteloader.protos import codec, loader_pb2

log = logging.getLogger("remoteloader.client")

_shared: tuple[int, asyncio.AbstractEventLoop, threading.Thread] | None = None
_shared_lock = threading.Lock()


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


class Receiver:
    """Links, engine and the asyncio thread they run on, in this process.

    Args:
        address: As RemoteLoader's; resolved again by every ``discover()``.
        setup: The stream's Setup message.
        delivery: ``allocate(n, h, w)`` -> uint8 NHWC array/tensor or None (none free yet),
            ``release(buffer)`` for batches dropped before they were handed out.
        engine_options: seed, prefetch, ordered, reconnect_timeout, progress_timeout.
        link_options: connect_timeout, max_inflight, tls, metadata.
    """

    def __init__(self, address, setup: loader_pb2.Setup, delivery, engine_options: dict, link_options: dict):
        codec.tune_malloc()  # multi-MB messages: see its docstring for the measured effect
        self._address = address
        self._link_options = link_options
        self.links: dict[str, Link] = {}
        self._loop, self._thread = io_loop()
        self._pid = os.getpid()
        self._closed = False
        self.engine = Engine(self.links, None, setup, delivery=delivery, **engine_options)

    # ---- servers ------------------------------------------------------------------------
    def discover(self) -> tuple[dict[str, loader_pb2.DescribeResponse], list[str]]:
        """Resolves the address again and describes servers not seen before.

        Returns every known server's Describe and the addresses that are new. Raises
        ConnectionError/OSError (name resolution, a server that does not answer) and
        PermissionError (refused).
        """
        new = [a for a in discover(self._address) if a not in self.links]
        if new:
            links = [Link(a, self.engine, **self._link_options) for a in new]
            self._call(self._describe_all(links), timeout=self._link_options["connect_timeout"] + 5)
        return {a: l.describe for a, l in self.links.items()}, new

    async def _describe_all(self, links: list[Link]) -> None:
        results = await asyncio.gather(*(l.fetch_describe() for l in links), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(l.close() for l in links), return_exceptions=True)
            raise errors[0]
        self.links.update((l.address, l) for l in links)  # on the loop thread, which reads it

    def forget(self, addresses: list[str]) -> None:
        """Drops servers the loader refused (they are described anew if they show up again)."""
        self._call(self._forget(addresses), timeout=10)

    async def _forget(self, addresses: list[str]) -> None:
        for address in addresses:
            link = self.links.pop(address, None)
            if link is not None:
                await link.close()

    def get_keys(self, owners: list[str], shard_id: str, start: int, count: int) -> list[str]:
        """Keys of a shard's samples, from a live server among ``owners``."""
        links = [self.links[o] for o in owners if o in self.links]
        live = [l for l in links if l.state == "up"] or [l for l in links if l.describe is not None]
        if not live:
            raise LoaderError(f"no server holding shard {shard_id} is reachable to look up keys")
        return self._call(live[0].get_keys(shard_id, start, count), timeout=30)

    def server_stats(self, timeout: float | None = None) -> dict[str, dict]:
        return {a: {"orders": l.orders_sent, "samples": l.samples_received, "bytes": l.bytes_received,
                    "failures": l.failures, "reconnects": l.reconnects, "state": l.state}
                for a, l in self.links.items()}

    # ---- epochs -------------------------------------------------------------------------
    def start_epoch(self, epoch: int, batches: list[np.ndarray], first_seq: int, skip: frozenset,
                    catalog: Catalog) -> tuple[int, queue.Queue]:
        """Starts an epoch over ``catalog`` (the one its plan was made from); returns its token
        and the queue its Batches, then END, arrive on."""
        token = self._call(self.engine.start_epoch(epoch, batches, first_seq, catalog, skip), timeout=None)
        return token, self.engine.out

    @property
    def token(self) -> int | None:
        return self.engine.token

    def cancel_epoch(self, token: int) -> None:
        """Stops the epoch ``token`` if it still runs (its buffers return to the delivery)."""
        if self._on_loop_thread():  # a generator finalized by a collection on the I/O thread
            self._loop.call_soon(self.engine.cancel_epoch, token)
            return
        self._call(_run(self.engine.cancel_epoch, token), timeout=10)

    def consumed(self, token: int) -> None:
        self._soon(self.engine.consumed, token)

    def buffer_freed(self) -> None:
        self._soon(self.engine.buffer_freed)

    def alive(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def failure(self) -> str | None:
        return None  # it stops only when closed

    def close(self) -> None:
        """Ends this loader's streams, tasks and channels; the shared loop runs on."""
        if self._closed or sys.is_finalizing() or os.getpid() != self._pid:  # at exit the loop is frozen
            return
        if self._on_loop_thread():
            # Garbage collection of a loader in a reference cycle can run on the I/O thread
            # itself, which must not wait for work only it can do: schedule it.
            self._closed = True
            self._loop.create_task(self.engine.close())
            return
        try:
            self._call(self.engine.close(), timeout=10)
        except Exception:
            pass
        self._closed = True

    def _on_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def _call(self, coro, timeout: float | None):
        """Runs a coroutine on the loop and waits for it (RuntimeError once closed)."""
        if self._closed or self._loop.is_closed():
            coro.close()
            raise RuntimeError("RemoteLoader is closed")
        if os.getpid() != self._pid:
            coro.close()
            raise RuntimeError(f"this RemoteLoader was made in process {self._pid}; its connections do not "
                               f"survive fork (gRPC is not fork-safe): use it in the process that made it")
        if self._on_loop_thread():
            coro.close()
            raise RuntimeError("RemoteLoader: a blocking call on its own I/O thread would wait forever")
        return asyncio.run_coroutine_threadsafe(_wrap(coro), self._loop).result(timeout)

    def _soon(self, function, *args) -> None:
        if self._closed or os.getpid() != self._pid:
            return
        try:
            self._loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # the loop closed meanwhile (interpreter shutdown): nothing to do
            pass


async def _wrap(coro):
    return await coro


async def _run(function, *args):
    return function(*args)


# ---- the receiver process -----------------------------------------------------------------
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
                raise OSError(f"cannot reserve {count * slot_bytes / 2**20:.0f} MiB of shared memory for "
                              f"{count} batches: {exc}") from None
        self.fd = fd
        self.memory = mmap.mmap(fd, count * slot_bytes)
        try:
            self.memory.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass
        self.array = np.frombuffer(self.memory, dtype=np.uint8)

    def view(self, slot: int, n: int, h: int, w: int) -> np.ndarray:
        start = slot * self.slot_bytes
        return self.array[start:start + n * h * w * 3].reshape(n, h, w, 3)

    def slot_of(self, address: int) -> int:
        return (address - self.array.ctypes.data) // self.slot_bytes


class _SlotDelivery:
    """The child's delivery: batches are received into free slots; the parent frees them."""

    def __init__(self, slots: SharedSlots):
        self.slots = slots
        self._free = list(range(slots.count))[::-1]
        self._lock = threading.Lock()

    def allocate(self, n: int, h: int, w: int):
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        return self.slots.view(slot, n, h, w)

    def release(self, images: np.ndarray) -> None:
        self.give(self.slots.slot_of(images.ctypes.data))

    def give(self, slot: int) -> None:
        with self._lock:
            if slot in self._free:  # a bug: the parent may still be reading it while it is refilled
                log.error("batch slot %d was given back twice; ignoring the second time", slot)
                return
            self._free.append(slot)


class ProcessReceiver:
    """The Receiver's API, with the Receiver in a child process writing into shared slots.

    Batches come out of ``start_epoch``'s queue as engine Batches whose ``images`` is the
    uint8 NHWC view of their slot in this process; ``free(images)`` gives the slot back
    once the batch has been copied out (the consumer's delivery decides when).
    """

    def __init__(self, address, setup: loader_pb2.Setup, slots: int, slot_bytes: int, engine_options: dict,
                 link_options: dict):
        self._setup_hw = (setup.height, setup.width)
        self._pid = os.getpid()
        self.slots = SharedSlots(slots, slot_bytes)
        parent, child = socket.socketpair()
        self._socket = parent  # kept to wake the reader with shutdown() before its fd is closed
        self._conn = Connection(os.dup(parent.fileno()))
        # The parent's import path goes after the child's own, never ahead of the stdlib: the
        # child finds remoteloader as the parent did (also when it came from PYTHONPATH or a
        # folder added at run time) and a training script's folder cannot shadow a module.
        paths = [os.path.abspath(p) for p in sys.path if isinstance(p, str)]
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOTSTRAP, json.dumps(paths), str(child.fileno()), str(self.slots.fd),
                 str(os.getpid())],
                pass_fds=(child.fileno(), self.slots.fd), stdin=subprocess.DEVNULL)
        finally:
            child.close()
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._replies: dict[int, Future] = {}
        self._queues: dict[int, queue.Queue] = {}  # the running epoch's, by token
        self._queues_lock = threading.Lock()  # a batch is either put where cancel drains it, or freed
        self._current: int | None = None
        self._dead: str | None = None
        self._close_when_read = False
        self._send(("init", address, setup.SerializeToString(), slots, slot_bytes, engine_options, link_options))
        self._reader = threading.Thread(target=self._read, name="remoteloader-receiver", daemon=True)
        self._reader.start()

    # ---- the Receiver API -----------------------------------------------------------------
    def discover(self):
        describes, new = self._request("discover")
        return {a: loader_pb2.DescribeResponse.FromString(d) for a, d in describes.items()}, new

    def forget(self, addresses: list[str]) -> None:
        self._request("forget", addresses)

    def get_keys(self, owners: list[str], shard_id: str, start: int, count: int) -> list[str]:
        return self._request("get_keys", owners, shard_id, start, count)

    def server_stats(self, timeout: float | None = None) -> dict[str, dict]:
        return self._request("server_stats", timeout=timeout)

    def start_epoch(self, epoch: int, batches: list[np.ndarray], first_seq: int, skip: frozenset,
                    catalog: Catalog) -> tuple[int, queue.Queue]:
        token = self._request("start_epoch", epoch, batches, first_seq, skip, catalog)
        return token, self._queues[token]  # made by the reader before any of the epoch's batches

    @property
    def token(self) -> int | None:
        return self._current

    def cancel_epoch(self, token: int) -> None:
        if self._dead is None:
            self._request("cancel_epoch", token, timeout=30)
        with self._queues_lock:
            out = self._queues.pop(token, None)
        if self._current == token:
            self._current = None
        if out is not None:
            self._drain(out)

    def _drain(self, out: queue.Queue) -> None:
        """Frees the slots of batches that reached this process but not the consumer."""
        while True:
            try:
                item = out.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Batch):
                self.free(item.images)

    def consumed(self, token: int) -> None:
        self._post(("consumed", token))

    def free(self, images) -> None:
        """Gives a batch's slot back to the receiver (``images`` is the slot's view or tensor)."""
        address = images.data_ptr() if hasattr(images, "data_ptr") else images.ctypes.data
        self._post(("free", self.slots.slot_of(address)))

    def buffer_freed(self) -> None:
        pass  # slots come back through free()

    def alive(self) -> bool:
        return self._dead is None

    def failure(self) -> str | None:
        """Why the receiver stopped, if it did."""
        return self._dead

    def close(self) -> None:
        if os.getpid() != self._pid:  # a forked copy: the child and the link are the parent's
            return
        if sys.is_finalizing() or threading.current_thread() is self._reader:
            # At exit no thread runs any more; on the reader itself (a finalizer that ran
            # there) nothing would answer: stop the child; the reader reads EOF and closes.
            self._close_when_read = True
            if self.process.poll() is None:
                self.process.kill()
            return
        if self.process.poll() is None:
            try:
                self._request("close", timeout=15)
            except Exception:
                pass
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with self._queues_lock:
            self._queues = {}
        # The link's fd is closed only once the reader has stopped reading it: closed under a
        # blocked read, its number would be reused by the next file or socket this process
        # opens (another loader's link), which the old reader would then read from.
        try:
            self._socket.shutdown(socket.SHUT_RDWR)  # the reader's read returns EOF
        except OSError:
            pass
        self._reader.join(timeout=15)
        if self._reader.is_alive():
            log.warning("the RemoteLoader's receiver thread did not stop; its socket is left open")
            return
        self._close_fds()

    def _close_fds(self) -> None:
        with self._send_lock:  # never under a send
            self._conn.close()
        self._socket.close()
        fd, self.slots.fd = self.slots.fd, -1
        if fd >= 0:
            os.close(fd)

    # ---- messages ---------------------------------------------------------------------------
    def _request(self, *message, timeout: float | None = None):
        if os.getpid() != self._pid:  # its reader thread did not survive fork; the parent's reads the link
            raise RuntimeError(f"this RemoteLoader was made in process {self._pid}; after a fork its receiver "
                               f"process still serves that one only: use the loader in the process that made it")
        if self._dead is not None:
            raise LoaderError(self._dead)
        if threading.current_thread() is self._reader:  # a finalizer that ran there: nothing would answer
            raise RuntimeError("RemoteLoader: a call on its own receiver thread would wait forever")
        request_id = next(self._ids)
        future: Future = Future()
        self._replies[request_id] = future
        try:
            self._send(("call", request_id, *message))
        except OSError:  # the child is gone; the reader says why
            self._replies.pop(request_id, None)
            self._reader.join(timeout=5)
            raise LoaderError(self._dead or "the RemoteLoader's receiver process is gone") from None
        return future.result(timeout)

    def _post(self, message) -> None:
        if self._dead is None and os.getpid() == self._pid:
            try:
                self._send(message)
            except OSError:
                pass  # the reader reports the death

    def _send(self, message) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        h, w = self._setup_hw
        try:
            while True:
                kind, *rest = self._conn.recv()
                if kind == "reply":
                    request_id, ok, value = rest
                    future = self._replies.pop(request_id)
                    future.set_result(value) if ok else future.set_exception(_rebuild(value))
                elif kind == "started":  # before any of the epoch's batches, on this same thread
                    request_id, token = rest
                    with self._queues_lock:
                        superseded = list(self._queues.values())
                        self._queues = {token: queue.Queue()}  # one epoch at a time
                    self._current = token
                    for out in superseded:  # as the engine drains its own queue on a new epoch
                        self._drain(out)
                    self._replies.pop(request_id).set_result(token)
                elif kind == "batch":
                    token, seq, slot, ids, labels, failures, nbytes = rest
                    images = self.slots.view(slot, len(ids), h, w)
                    with self._queues_lock:
                        out = self._queues.get(token)
                        if out is not None:
                            out.put(Batch(seq, ids, images, images, labels, 0, failures, nbytes))
                    if out is None:  # an epoch that was cancelled meanwhile
                        self._post(("free", slot))
                elif kind in ("end", "error"):
                    token, item = rest
                    with self._queues_lock:
                        out = self._queues.get(token)
                        if out is not None:
                            out.put(END if kind == "end" else _rebuild(item))
                elif kind == "log":
                    level, name, text = rest
                    logging.getLogger(name).log(level, "%s", text)
        except (EOFError, OSError):
            reason = None
        except BaseException as exc:  # a bug here must not leave requests waiting forever
            reason = f"the RemoteLoader's receiver link failed: {type(exc).__name__}: {exc}"
            self.process.kill()
        try:  # the child closes its end only by exiting; a link that ended under a live child broke
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
            reason = reason or "the RemoteLoader's receiver link broke; its process was stopped"
        self._dead = reason or f"the RemoteLoader's receiver process exited (code {code})"
        for future in list(self._replies.values()):
            future.set_exception(LoaderError(self._dead))
        self._replies.clear()
        with self._queues_lock:
            for out in self._queues.values():
                out.put(LoaderError(self._dead))
        if self._close_when_read:  # close() ran on this thread, which alone reads the link
            self._close_fds()


class _Child:
    """The receiver process: a Receiver serving the parent's requests over the socket."""

    def __init__(self, conn: Connection, slots_fd: int):
        self.conn = conn
        self.slots_fd = slots_fd
        self.lock = threading.Lock()
        self.receiver: Receiver | None = None
        self.delivery: _SlotDelivery | None = None
        self._forwarder: threading.Thread | None = None
        self._stop = threading.Event()

    def send(self, message) -> None:
        with self.lock:
            self.conn.send(message)

    def serve(self) -> None:
        """Reads the parent's messages: "free" and "consumed" at once, calls on a worker thread
        (so a slow call, e.g. GetKeys, never holds back the slots coming back)."""
        try:
            _, address, setup, slots, slot_bytes, engine_options, link_options = self.conn.recv()
        except (EOFError, OSError):
            return
        self.delivery = _SlotDelivery(SharedSlots(slots, slot_bytes, self.slots_fd))
        self.receiver = Receiver(address, loader_pb2.Setup.FromString(setup), self.delivery, engine_options,
                                 link_options)
        calls: queue.Queue = queue.Queue()
        worker = threading.Thread(target=self._calls, args=(calls,), name="remoteloader-calls", daemon=True)
        worker.start()
        try:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    return  # the parent is gone, or done with us
                kind = message[0]
                if kind == "consumed":
                    self.receiver.consumed(message[1])
                elif kind == "free":
                    self.delivery.give(message[1])
                    self.receiver.buffer_freed()
                elif kind == "call":
                    calls.put(message)
        finally:
            calls.put(None)
            worker.join(timeout=15)
            self._stop.set()
            self.receiver.close()

    def _calls(self, calls: queue.Queue) -> None:
        while (message := calls.get()) is not None:
            _, request_id, name, *args = message
            try:
                value = getattr(self, "do_" + name)(*args)
            except Exception as exc:
                self.send(("reply", request_id, False, _portable(exc)))
                continue
            if name == "start_epoch":
                token, out = value
                self.send(("started", request_id, token))
                self._forward(token, out)  # its batches follow the "started" message
            else:
                self.send(("reply", request_id, True, value))
            if name == "close":
                os._exit(0)  # the receiver is closed and the parent has its answer

    def do_discover(self):
        describes, new = self.receiver.discover()
        return {a: d.SerializeToString() for a, d in describes.items()}, new

    def do_forget(self, addresses):
        self.receiver.forget(addresses)

    def do_get_keys(self, *args):
        return self.receiver.get_keys(*args)

    def do_server_stats(self):
        return self.receiver.server_stats()

    def do_start_epoch(self, epoch, batches, first_seq, skip, catalog):
        self._stop.set()  # the previous epoch's forwarder
        if self._forwarder is not None:
            self._forwarder.join()
        return self.receiver.start_epoch(epoch, batches, first_seq, skip, catalog)

    def do_cancel_epoch(self, token):
        self.receiver.cancel_epoch(token)

    def do_close(self):
        self._stop.set()
        self.receiver.close()

    def _forward(self, token: int, out: queue.Queue) -> None:
        """Sends the epoch's batches to the parent as slot numbers, in the order they come."""
        self._stop = stop = threading.Event()

        def run() -> None:
            while not stop.is_set():
                try:
                    item = out.get(timeout=0.2)
                except queue.Empty:
                    continue
                if isinstance(item, Batch):
                    slot = self.delivery.slots.slot_of(item.images.ctypes.data)
                    self.send(("batch", token, item.seq, slot, item.ids, item.labels, item.failures, item.nbytes))
                else:
                    self.send(("end", token, None) if item is END else ("error", token, _portable(item)))
                    return

        self._forwarder = threading.Thread(target=run, name="remoteloader-forward", daemon=True)
        self._forwarder.start()


# Errors that cross from the child keep their type when it is one the loader's callers
# handle (the message is kept either way); no exception object itself is sent.
_ERRORS = {c.__name__: c for c in (LoaderError, ConnectionError, PermissionError, TimeoutError, ValueError,
                                   RuntimeError, OSError)}


def _portable(exc: BaseException) -> tuple[str, str]:
    """(type name, message) of an error to send to the parent; see _rebuild."""
    for cls in type(exc).__mro__:
        if cls.__name__ in _ERRORS and _ERRORS[cls.__name__] is cls:
            return cls.__name__, str(exc)
    return "LoaderError", f"{type(exc).__name__}: {exc}"


def _rebuild(error: tuple[str, str]) -> BaseException:
    name, text = error
    return _ERRORS[name](text)


class _ForwardLogs(logging.Handler):
    def __init__(self, child: _Child):
        super().__init__()
        self.child = child

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.child.send(("log", record.levelno, record.name, record.getMessage()))
        except Exception:
            pass


# Run with -I (no current folder, no PYTHON* variables on the path), then the parent's path
# after the child's own; addsitedir also runs .pth files (e.g. an editable install's finder).
_BOOTSTRAP = ("import json, site, sys\n"
              "for p in json.loads(sys.argv[1]):\n"
              "    if p not in sys.path: site.addsitedir(p)\n"
              "from remoteloader.client.receiver import main; main(sys.argv[2:])")


def _watch_parent(parent: int) -> None:
    """Exits when the training process is gone (forked children of it may keep the socket open)."""
    while os.getppid() == parent:
        threading.Event().wait(0.5)
    os._exit(0)


def main(argv: list[str]) -> None:
    conn_fd, slots_fd, parent = int(argv[0]), int(argv[1]), int(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training script's to handle
    threading.Thread(target=_watch_parent, args=(parent,), name="remoteloader-parent", daemon=True).start()
    child = _Child(Connection(conn_fd), slots_fd)
    root = logging.getLogger("remoteloader")
    root.addHandler(_ForwardLogs(child))
    root.setLevel(logging.INFO)
    root.propagate = False
    child.serve()


if __name__ == "__main__":
    main(sys.argv[1:])
