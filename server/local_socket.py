"""Same host: an abstract Unix socket that hands a local client the chunk memory, so that its
chunks skip gRPC (Setup.shared_memory, ChunkHeader.shared, DescribeResponse.local_socket).

One exchange per connection: the client sends one line, its token (the ``--token-file``
token; an empty line when it has none), at most ``MAX_LINE`` bytes with the newline, within
``TIMEOUT`` seconds; the server answers ``b"ok <file size>\\n"`` with a read-only descriptor of
the arena file attached (SCM_RIGHTS), or ``b"refused\\n"``, and closes the connection.

Who may map the chunks:
* With a token, whoever sends it (compared as gRPC calls' tokens are: security.token_matches).
* Without one, any process that can connect. An abstract socket belongs to its network
  namespace, so these are the processes that can reach the server's loopback port, which
  without a token serves them the same pixels.
* Except that a server which authenticates its clients only by certificate (``--tls-client-ca``,
  no token) hands the memory only to processes of its own user (their peer credentials).
The descriptor is opened read-only: a client reads chunks and generation words, and can never
write into the slots other streams read.

Once a stream's client has mapped the memory, each of its chunks' slots is lent to it (``Loans``)
until it releases the chunk's ticket: a lent slot counts among its stream's held slots, and the
stall rules (server.stalls) end a stream whose client keeps one unreleased. Whatever is still
lent when the stream ends goes back.

The handshakes run on the server's event loop (``loop.sock_accept``/``sock_recv`` on a raw
non-blocking socket, ``socket.send_fds`` for the answer: a few bytes to a fresh connection
never block), at most ``MAX_HANDSHAKES`` at once: no thread to stop, and a client that
connects and says nothing holds one of them for ``TIMEOUT`` seconds at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import struct
import time

from remoteloader.protos.same_host import MAX_LINE, OK, REFUSED, socket_address
from remoteloader.server.security import token_matches
from remoteloader.server.shared_memory import Arena
from remoteloader.server.sharing import SharedRenders
from remoteloader.server.slots import StreamSlots
from remoteloader.server.stalls import Stalled, Stalls

log = logging.getLogger(__name__)

MAX_HANDSHAKES = 16  # connections served at once; more wait in the listen backlog
TIMEOUT = 5.0  # seconds a connection may take to send its line


class LocalSocket:
    """A started local socket; ``close`` stops it. Made by ``start``."""

    def __init__(self, name: str, listener: socket.socket, fd: int, size: int, token: bytes | None, same_user: bool):
        self.name = name  # the abstract name, without its leading NUL
        self.size = size
        self._listener = listener
        self._fd = fd
        self._token = token
        self._same_user = same_user
        self._handshakes = asyncio.Semaphore(MAX_HANDSHAKES)
        self._tasks: set[asyncio.Task] = set()
        self._serving = asyncio.ensure_future(self._serve())

    @property
    def address(self) -> str:
        """As DescribeResponse.local_socket says it: ``@name``."""
        return "@" + self.name

    @classmethod
    def start(cls, arena: Arena, token: bytes | None, same_user: bool) -> LocalSocket | None:
        """Listens on a fresh abstract name; None (and a warning) where this host offers none."""
        name = "remoteloader-" + secrets.token_hex(8)
        listener = None
        try:
            fd = os.open(f"/proc/self/fd/{arena.fd}", os.O_RDONLY | os.O_CLOEXEC)  # read-only reopen
        except OSError as exc:
            log.warning("no local socket: cannot open the chunk memory read-only (%s)", exc)
            return None
        try:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(socket_address("@" + name))
            listener.listen(64)
            listener.setblocking(False)
        except OSError as exc:
            if listener is not None:
                listener.close()
            os.close(fd)
            log.warning("no local socket: %s", exc)
            return None
        return cls(name, listener, fd, arena.size, token, same_user)

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._handshakes.acquire()
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # (EMFILE and the like): try again shortly
                self._handshakes.release()
                log.warning("local socket: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            except BaseException:
                self._handshakes.release()
                raise
            task = asyncio.ensure_future(self._handshake(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _handshake(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.setblocking(False)
                try:
                    line = await asyncio.wait_for(self._read_line(conn), TIMEOUT)
                except (asyncio.TimeoutError, OSError):
                    line = None
                if line is not None and self._fd >= 0 and self._admits(conn, line):
                    socket.send_fds(conn, [b"%s %d\n" % (OK, self.size)], [self._fd])
                else:
                    conn.send(REFUSED)
        except OSError:  # the client left, or its receive buffer is full: nothing more to say
            pass
        finally:
            self._handshakes.release()

    @staticmethod
    async def _read_line(conn: socket.socket) -> bytes | None:
        """The token line without its newline; None when the client ends it early or it is too long."""
        loop = asyncio.get_running_loop()
        line = bytearray()
        while b"\n" not in line:
            if len(line) >= MAX_LINE:
                return None
            data = await loop.sock_recv(conn, MAX_LINE - len(line))
            if not data:
                return None
            line += data
        return bytes(line[: line.index(b"\n")]).strip()

    def _admits(self, conn: socket.socket, line: bytes) -> bool:
        if self._token is not None:
            return token_matches(line, self._token)
        if self._same_user:
            pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            return uid == os.geteuid()
        return True

    async def close(self) -> None:
        """Stops listening and drops the handshakes under way (idempotent); descriptors already
        handed out stay valid in their clients."""
        tasks = [self._serving, *self._tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # (their sockets leave the loop first)
        with contextlib.suppress(OSError):
            self._listener.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Loans:
    """The slots lent to one same-host stream's client (Setup.shared_memory), by ticket.

    Args:
        stalls: The server's stall rules.
        renders: Where the stream's slots go back (server.sharing, which keeps clean renderings).
        stream: The stream's part of the slots.
    """

    def __init__(self, stalls: Stalls, renders: SharedRenders, stream: StreamSlots):
        self._stalls = stalls
        self._renders = renders
        self._stream = stream
        # ticket -> (slot, time.monotonic() when lent), oldest first; each counts in stream.held
        self._lent: dict[int, tuple[int, float]] = {}
        self._last_ticket = 0

    def __bool__(self) -> bool:
        """Whether any slot is still lent."""
        return bool(self._lent)

    def lend(self, slot: int) -> int:
        """Lends a rendered chunk's slot to the client, which maps the arena; its ticket."""
        self._last_ticket += 1
        self._lent[self._last_ticket] = (slot, time.monotonic())
        return self._last_ticket

    def give_back(self, ticket: int) -> bool:
        """Gives back the slot lent under ``ticket``; False when the stream has no such loan."""
        loan = self._lent.pop(ticket, None)
        if loan is None:
            return False
        self._renders.give(self._stream, loan[0])
        return True

    def give_all(self) -> None:
        """Gives back every slot still lent (the stream ends): those no other stream holds or keeps
        go back to the arena, their generations changed."""
        while self._lent:
            self._renders.give(self._stream, self._lent.popitem()[1][0])

    def check(self) -> None:
        """Raises Stalled when the client has kept a lent slot as long as the stall rules let a
        chunk wait unread."""
        if self._lent:
            _slot, since = next(iter(self._lent.values()))
            reason = self._stalls.why(self._stream, time.monotonic() - since)
            if reason:
                raise Stalled(f"released no shared chunk for {reason}")
