"""``receiver="process"``, the training process's side: a child process receives the batches.

``ProcessReceiver`` keeps the ``Receiver`` contract (``receiver.py``) by asking a child
process (a fresh interpreter running ``receiver_service.main``) to run a ThreadReceiver that
receives the pixels straight into batch slots of shared memory (``SharedSlots``); the
training process then only exchanges small messages with it (which slot holds which batch,
which slot is free again) and copies each batch out of its slot once, to the GPU when on
CUDA; on the CPU it lends the user a batch in its slot instead, up to two at a time
(``host_delivery.LentSlots``). Receiving costs gRPC about 0.5 CPU-seconds per GB (Python grpcio copies every message
twice before we see it), which in the training process would be ~0.1 core-s per 1000 224-px
images and would contend for its GIL; in the receiver process it costs the training process
nothing.

The two processes talk over a socketpair; what both ends share (the slots, the messages,
how errors cross) is ``receiver_channel.py``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from remoteloader.client import cpu
from remoteloader.client import receiver_messages as msg
from remoteloader.client.batches import END, Batch, Item, LoaderError
from remoteloader.client.epoch import Pass
from remoteloader.client.option_groups import ConnectionOptions, FlowOptions, SecurityOptions
from remoteloader.client.receiver_channel import SharedSlots, rebuild_error
from remoteloader.protos import loader_pb2

log = logging.getLogger("remoteloader.client")


class ProcessReceiver:
    """A ``Receiver`` whose ThreadReceiver runs in a child process, writing into shared slots.

    Batches come out of ``start_epoch``'s queue as engine Batches whose ``images`` is the
    uint8 NHWC view of their slot in this process; ``free(images)`` gives the slot back
    once the batch has been copied out (the consumer's delivery decides when).
    """

    def __init__(
        self,
        address: str | Iterable[str],
        setup: loader_pb2.Setup,
        slots: int,
        slot_bytes: int,
        flow: FlowOptions,
        connection: ConnectionOptions,
        security: SecurityOptions,
        seed: int,
        described: Mapping[str, loader_pb2.DescribeResponse] | None = None,
    ):
        self._setup_hw = (setup.height, setup.width)
        self._masks = "mask" in setup.fields
        self._pid = os.getpid()
        self.slots = SharedSlots(slots, slot_bytes)
        parent, child = socket.socketpair()
        self._socket = parent  # kept to wake the reader with shutdown() before its fd is closed
        self._conn = Connection(os.dup(parent.fileno()))
        # The child's path is the stdlib, then the parent's path in the parent's order: it
        # imports remoteloader, grpc and numpy from where the parent did (also from PYTHONPATH
        # ahead of site-packages, or a folder added at run time), and a training script's
        # folder cannot shadow a stdlib module.
        paths = [os.path.abspath(p) for p in sys.path if isinstance(p, str)]
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    "-c",
                    BOOTSTRAP,
                    json.dumps(paths),
                    str(child.fileno()),
                    str(self.slots.fd),
                    str(os.getpid()),
                ],
                pass_fds=(child.fileno(), self.slots.fd),
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._replies: dict[int, Future[Any]] = {}
        self._queues: dict[int, queue.Queue[Item]] = {}  # the running epoch's, by token
        self._queues_lock = threading.Lock()  # a batch is either put where cancel drains it, or freed
        self._playing: Pass | None = None  # the pass it started last, until it is cancelled
        self._dead: str | None = None
        self._close_when_read = False
        described_bytes = {a: d.SerializeToString() for a, d in (described or {}).items()}
        self._send(
            msg.Init(
                address, setup.SerializeToString(), slots, slot_bytes, flow, connection, security, seed, described_bytes
            )
        )
        self._reader = threading.Thread(target=self._read, name="remoteloader-receiver", daemon=True)
        self._reader.start()

    # ---- the Receiver contract --------------------------------------------------------------
    def discover(self) -> tuple[dict[str, loader_pb2.DescribeResponse], list[str]]:
        describes, new = self._request(msg.Discover())
        return {a: loader_pb2.DescribeResponse.FromString(d) for a, d in describes.items()}, new

    def forget(self, addresses: list[str]) -> None:
        self._request(msg.Forget(addresses))

    def get_keys(self, owners: list[str], shard_id: str, start: int, count: int) -> list[str]:
        return self._request(msg.GetKeys(owners, shard_id, start, count))

    def server_stats(self, timeout: float | None = None) -> dict[str, dict]:
        return self._request(msg.ServerStats(), timeout=timeout)

    def start_epoch(self, played: Pass) -> queue.Queue[Item]:
        self._request(msg.StartPass(played))
        self._playing = played
        return self._queues[played.token]  # made by the reader before any of the pass's batches

    @property
    def playing(self) -> Pass | None:
        return self._playing

    def cancel_epoch(self, played: Pass) -> None:
        if self._dead is None:
            self._request(msg.CancelPass(played.token), timeout=30)
        with self._queues_lock:
            out = self._queues.pop(played.token, None)
        if self._playing is played:
            self._playing = None
        if out is not None:
            self._drain(out)

    def _drain(self, out: queue.Queue[Item]) -> None:
        """Frees the slots of batches that reached this process but not the consumer."""
        while True:
            try:
                item = out.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Batch):
                self.free(item.images)

    def consumed(self, played: Pass) -> None:
        self._post(msg.Consumed(played.token))

    @property
    def slot_memory(self) -> np.ndarray:
        """Every batch slot, as one uint8 array (a ``delivery.SlotReceiver``)."""
        return self.slots.array

    def free(self, images: Any) -> None:
        """Gives a batch's slot back to the receiver (``images`` is the slot's view or tensor)."""
        address = images.data_ptr() if hasattr(images, "data_ptr") else images.ctypes.data
        self._post(msg.Free(self.slots.slot_of(address)))

    def cpu_seconds(self) -> float:
        return cpu.process_cpu(self.process.pid)

    def stopped(self) -> str | None:
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
                self._request(msg.Close(), timeout=15)
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
    def _request(self, request: msg.Request, timeout: float | None = None) -> Any:
        if os.getpid() != self._pid:  # its reader thread did not survive fork; the parent's reads the link
            raise RuntimeError(
                f"this RemoteLoader was made in process {self._pid}; after a fork its receiver "
                f"process still serves that one only: use the loader in the process that made it"
            )
        if self._dead is not None:
            raise LoaderError(self._dead)
        if threading.current_thread() is self._reader:  # a finalizer that ran there: nothing would answer
            raise RuntimeError("RemoteLoader: a call on its own receiver thread would wait forever")
        request_id = next(self._ids)
        future: Future[Any] = Future()
        self._replies[request_id] = future
        try:
            self._send(msg.Call(request_id, request))
        except OSError:  # the child is gone; the reader says why
            self._replies.pop(request_id, None)
            self._reader.join(timeout=5)
            raise LoaderError(self._dead or "the RemoteLoader's receiver process is gone") from None
        return future.result(timeout)

    def _post(self, message: msg.Consumed | msg.Free) -> None:
        if self._dead is None and os.getpid() == self._pid:
            try:
                self._send(message)
            except OSError:
                pass  # the reader reports the death

    def _send(self, message: msg.Init | msg.ToChild) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _take(self, message: msg.ToParent, h: int, w: int) -> None:
        """One message from the child, on the reader thread."""
        match message:
            case msg.Reply(request_id, ok, value):
                future = self._replies.pop(request_id)
                future.set_result(value) if ok else future.set_exception(rebuild_error(value))
            case msg.Started(request_id, token):  # before any of the pass's batches, on this same thread
                with self._queues_lock:
                    superseded = list(self._queues.values())
                    self._queues = {token: queue.Queue()}  # one pass at a time
                for old in superseded:  # as the engine drains its own queue on a new pass
                    self._drain(old)
                self._replies.pop(request_id).set_result(token)
            case msg.BatchReady(token, seq, slot, ids, labels, failures, nbytes, targets):
                images = self.slots.view(slot, len(ids), h, w)
                masks = self.slots.mask_view(slot, len(ids), h, w) if self._masks else None
                with self._queues_lock:
                    out = self._queues.get(token)
                    if out is not None:
                        out.put(Batch(seq, ids, images, images, labels, 0, failures, nbytes, masks, targets))
                if out is None:  # a pass that was cancelled meanwhile
                    self._post(msg.Free(slot))
            case msg.PassEnded(token, error):
                with self._queues_lock:
                    out = self._queues.get(token)
                    if out is not None:
                        out.put(END if error is None else rebuild_error(error))
            case msg.Log(level, name, text):
                logging.getLogger(name).log(level, "%s", text)
            case _:
                raise TypeError(f"the receiver process sent {type(message).__name__}")

    def _read(self) -> None:
        h, w = self._setup_hw
        try:
            while True:
                self._take(self._conn.recv(), h, w)
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


# Errors that cross from the child keep their type when it is one the loader's callers
# handle (the message is kept either way); no exception object itself is sent.
# Run with -I -S (the path is the stdlib alone: no current folder, no PYTHON* variables, no
# site-packages), then the parent's path appended in its order; addsitedir also runs the
# .pth files there (e.g. an editable install's finder).
BOOTSTRAP = (
    "import json, site, sys\n"
    "for p in json.loads(sys.argv[1]):\n"
    "    if p not in sys.path: site.addsitedir(p)\n"
    "from remoteloader.client.receiver_service import main; main(sys.argv[2:])"
)
