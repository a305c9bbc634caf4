"""The receiver process itself: a ThreadReceiver serving its parent's ProcessReceiver.

Started by ``ProcessReceiver`` as ``python -I -c BOOTSTRAP`` (see ``process_receiver.py``
for the messages), it receives batches into the shared slots the parent mapped, and tells
the parent which slot holds which batch. It imports no torch: the training process does
every conversion. It exits when its parent is gone or closes the socket.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from remoteloader.client.batches import Batch, Item
from remoteloader.client.receiver_channel import SharedSlots, portable_error
from remoteloader.client.thread_receiver import ThreadReceiver
from remoteloader.protos import loader_pb2

log = logging.getLogger("remoteloader.client")

# Receiver methods the parent calls by name whose answer goes back as is.
_PLAIN_CALLS = frozenset({"forget", "get_keys", "server_stats", "cancel_epoch"})


class SlotBuffers:
    """The child's ``BatchBuffers``: batches are received into free slots; the parent frees them."""

    def __init__(self, slots: SharedSlots):
        self.slots = slots
        self._free = list(range(slots.count))[::-1]
        self._lock = threading.Lock()
        self._freed: Callable[[], None] = lambda: None

    def allocate(self, n: int, h: int, w: int) -> np.ndarray | None:
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        return self.slots.view(slot, n, h, w)

    def masks_for(self, images: np.ndarray, n: int, h: int, w: int) -> np.ndarray:
        return self.slots.mask_view(self.slots.slot_of(images.ctypes.data), n, h, w)

    def release(self, images: np.ndarray) -> None:
        self.give(self.slots.slot_of(images.ctypes.data))

    def give(self, slot: int) -> None:
        with self._lock:
            if slot in self._free:  # a bug: the parent may still be reading it while it is refilled
                log.error("batch slot %d was given back twice; ignoring the second time", slot)
                return
            self._free.append(slot)
        self._freed()

    def listen(self, freed: Callable[[], None]) -> None:
        self._freed = freed


class ReceiverService:
    """Serves a ThreadReceiver to the parent over the socket, and forwards each epoch's batches."""

    def __init__(self, conn: Connection, slots_fd: int):
        self.conn = conn
        self.slots_fd = slots_fd
        self.lock = threading.Lock()
        self._forwarder: threading.Thread | None = None
        self._stop = threading.Event()

    def send(self, message: tuple) -> None:
        with self.lock:
            self.conn.send(message)

    def serve(self) -> None:
        """Reads the parent's messages: "free" and "consumed" at once, calls on a worker thread
        (so a slow call, e.g. GetKeys, never holds back the slots coming back)."""
        try:
            _, address, setup, slots, slot_bytes, flow, connection, security, seed, described = self.conn.recv()
        except (EOFError, OSError):
            return
        buffers = SlotBuffers(SharedSlots(slots, slot_bytes, self.slots_fd))
        receiver = ThreadReceiver(
            address,
            loader_pb2.Setup.FromString(setup),
            buffers,
            flow,
            connection,
            security,
            seed,
            {a: loader_pb2.DescribeResponse.FromString(d) for a, d in described.items()},
        )
        calls: queue.Queue[tuple | None] = queue.Queue()
        worker = threading.Thread(
            target=self._calls, args=(receiver, buffers, calls), name="remoteloader-calls", daemon=True
        )
        worker.start()
        try:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    return  # the parent is gone, or done with us
                kind = message[0]
                if kind == "consumed":
                    receiver.consumed(message[1])
                elif kind == "free":
                    buffers.give(message[1])
                elif kind == "call":
                    calls.put(message)
        finally:
            calls.put(None)
            worker.join(timeout=15)
            self._stop.set()
            receiver.close()

    def _calls(self, receiver: ThreadReceiver, buffers: SlotBuffers, calls: queue.Queue[tuple | None]) -> None:
        while (message := calls.get()) is not None:
            _, request_id, name, *args = message
            try:
                value = self._call(receiver, name, args)
            except Exception as exc:
                self.send(("reply", request_id, False, portable_error(exc)))
                continue
            if name == "start_epoch":
                token, out = args[0], value
                self.send(("started", request_id, token))
                self._forward(buffers, token, out)  # its batches follow the "started" message
            else:
                self.send(("reply", request_id, True, value))
            if name == "close":
                os._exit(0)  # the receiver is closed and the parent has its answer

    def _call(self, receiver: ThreadReceiver, name: str, args: list[Any]) -> Any:
        if name in _PLAIN_CALLS:
            return getattr(receiver, name)(*args)
        if name == "discover":
            describes, new = receiver.discover()
            return {a: d.SerializeToString() for a, d in describes.items()}, new
        if name == "start_epoch":
            self._stop.set()  # the previous epoch's forwarder
            if self._forwarder is not None:
                self._forwarder.join()
            token, epoch, batches, first_seq, space, skip = args  # as ProcessReceiver.start_epoch sends them
            return receiver.start_epoch(
                token=token, epoch=epoch, batches=batches, first_seq=first_seq, space=space, skip=skip
            )
        if name == "close":
            self._stop.set()
            receiver.close()
            return None
        raise ValueError(f"the receiver process has no call {name!r}")

    def _forward(self, buffers: SlotBuffers, token: int, out: queue.Queue[Item]) -> None:
        """Sends the epoch's batches to the parent as slot numbers, in the order they come."""
        self._stop = stop = threading.Event()

        def run() -> None:
            while not stop.is_set():
                try:
                    item = out.get(timeout=0.2)
                except queue.Empty:
                    continue
                if isinstance(item, Batch):
                    slot = buffers.slots.slot_of(item.pixels.ctypes.data)
                    self.send(
                        (
                            "batch",
                            token,
                            item.seq,
                            slot,
                            item.ids,
                            item.labels,
                            item.failures,
                            item.nbytes,
                            item.targets,
                        )
                    )
                elif isinstance(item, BaseException):
                    self.send(("error", token, portable_error(item)))
                    return
                else:  # END
                    self.send(("end", token, None))
                    return

        self._forwarder = threading.Thread(target=run, name="remoteloader-forward", daemon=True)
        self._forwarder.start()


class _ForwardLogs(logging.Handler):
    """Sends the child's log records to the parent, which logs them under the same logger."""

    def __init__(self, service: ReceiverService):
        super().__init__()
        self.service = service

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.service.send(("log", record.levelno, record.name, record.getMessage()))
        except Exception:
            pass


def _watch_parent(parent: int) -> None:
    """Exits when the training process is gone (forked children of it may keep the socket open)."""
    while os.getppid() == parent:
        threading.Event().wait(0.5)
    os._exit(0)


def main(argv: list[str]) -> None:
    """The child's entry: ``argv`` is (socket fd, shared memory fd, parent pid)."""
    conn_fd, slots_fd, parent = int(argv[0]), int(argv[1]), int(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training script's to handle
    threading.Thread(target=_watch_parent, args=(parent,), name="remoteloader-parent", daemon=True).start()
    service = ReceiverService(Connection(conn_fd), slots_fd)
    root = logging.getLogger("remoteloader")
    root.addHandler(_ForwardLogs(service))
    root.setLevel(logging.INFO)
    root.propagate = False
    service.serve()


if __name__ == "__main__":
    main(sys.argv[1:])
