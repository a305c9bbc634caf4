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

from remoteloader.client import receiver_messages as msg
from remoteloader.client.batches import Batch, Item
from remoteloader.client.epoch import Pass
from remoteloader.client.receiver_channel import SharedSlots, portable_error
from remoteloader.client.thread_receiver import ThreadReceiver
from remoteloader.protos import loader_pb2

log = logging.getLogger("remoteloader.client")


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
        self._played: Pass | None = None  # the pass started last (the parent names it by its token)
        self._stop = threading.Event()

    def send(self, message: msg.ToParent) -> None:
        with self.lock:
            self.conn.send(message)

    def serve(self) -> None:
        """Reads the parent's messages: "free" and "consumed" at once, calls on a worker thread
        (so a slow call, e.g. GetKeys, never holds back the slots coming back)."""
        try:
            init: msg.Init = self.conn.recv()
        except (EOFError, OSError):
            return
        buffers = SlotBuffers(SharedSlots(init.slots, init.slot_bytes, self.slots_fd))
        receiver = ThreadReceiver(
            init.address,
            loader_pb2.Setup.FromString(init.setup),
            buffers,
            init.flow,
            init.connection,
            init.security,
            init.seed,
            {a: loader_pb2.DescribeResponse.FromString(d) for a, d in init.described.items()},
        )
        calls: queue.Queue[msg.Call | None] = queue.Queue()
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
                match message:
                    case msg.Consumed(token):
                        played = self._played
                        if played is not None and played.token == token:
                            receiver.consumed(played)
                    case msg.Free(slot):
                        buffers.give(slot)
                    case msg.Call():
                        calls.put(message)
        finally:
            calls.put(None)
            worker.join(timeout=15)
            self._stop.set()
            receiver.close()

    def _calls(self, receiver: ThreadReceiver, buffers: SlotBuffers, calls: queue.Queue[msg.Call | None]) -> None:
        while (call := calls.get()) is not None:
            try:
                value = self._call(receiver, call.request)
            except Exception as exc:
                self.send(msg.Reply(call.request_id, False, portable_error(exc)))
                continue
            if isinstance(call.request, msg.StartPass):
                token = call.request.played.token
                self.send(msg.Started(call.request_id, token))
                self._forward(buffers, token, value)  # its batches follow the Started message
            else:
                self.send(msg.Reply(call.request_id, True, value))
            if isinstance(call.request, msg.Close):
                os._exit(0)  # the receiver is closed and the parent has its answer

    def _call(self, receiver: ThreadReceiver, request: msg.Request) -> Any:
        match request:
            case msg.Discover():
                describes, new = receiver.discover()
                return {a: d.SerializeToString() for a, d in describes.items()}, new
            case msg.Forget(addresses):
                return receiver.forget(addresses)
            case msg.GetKeys(owners, shard_id, start, count):
                return receiver.get_keys(owners, shard_id, start, count)
            case msg.ServerStats():
                return receiver.server_stats()
            case msg.StartPass(played):
                self._stop.set()  # the previous pass's forwarder
                if self._forwarder is not None:
                    self._forwarder.join()
                self._played = played
                return receiver.start_epoch(played)
            case msg.CancelPass(token):
                running = self._played
                if running is not None and running.token == token:
                    receiver.cancel_epoch(running)
                return None
            case msg.Close():
                self._stop.set()
                receiver.close()
                return None
        raise ValueError(f"the receiver process has no call {type(request).__name__}")

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
                    ready = msg.BatchReady(
                        token, item.seq, slot, item.ids, item.labels, item.failures, item.nbytes, item.targets
                    )
                    self.send(ready)
                elif isinstance(item, BaseException):
                    self.send(msg.PassEnded(token, portable_error(item)))
                    return
                else:  # END
                    self.send(msg.PassEnded(token, None))
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
            self.service.send(msg.Log(record.levelno, record.name, record.getMessage()))
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
