"""The client's half of the same-host path: is a server on this host, and its chunk memory mapped.

A server on this host says so in Describe: its host id (the kernel's boot id) and the name of
an abstract Unix socket, which only processes on this host (and in its network namespace)
can open. Over it, after the token when the server has one, the server hands over its chunk
memory as a file descriptor (SCM_RIGHTS). The client maps it read-only; chunks then come as
headers that say where their pixels lie (``ChunkHeader.shared``), and the client copies them
from there straight into its batch, then releases them. Anything that fails here only means
the server is fed over gRPC as any other: a server elsewhere, in another container, or one
that refuses.

Nothing from the server is trusted: a ``SharedPayload`` must lie inside the mapping, and a
copy counts only if the slot's generation word is unchanged after it (the server changes it
before it reuses the slot, e.g. after the stream ended).
"""

from __future__ import annotations

import mmap
import os
import socket
import struct

from remoteloader.protos import loader_pb2
from remoteloader.protos.malloc import map_now
from remoteloader.protos.same_host import ANSWER_BYTES, OK, host_id, socket_address

TIMEOUT = 2.0  # seconds: a local socket answers at once


def on_this_host(describe: loader_pb2.DescribeResponse) -> bool:
    """Whether a server offers its chunk memory and says it runs on this host."""
    mine = host_id()
    return bool(describe.local_socket) and bool(mine) and describe.host_id == mine


class SharedChunks:
    """A server's chunk memory, mapped read-only (one per link and server incarnation)."""

    def __init__(self, memory: mmap.mmap):
        self._memory = memory
        self.view = memoryview(memory)
        self.size = len(memory)

    @classmethod
    def open(cls, name: str, token: str | None) -> SharedChunks:
        """Asks the server's local socket ``name`` ("@..." abstract) for its chunk memory.

        Raises OSError (cannot connect, refused, no descriptor) or ValueError (a bad answer)."""
        address = socket_address(name)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(TIMEOUT)
            sock.connect(address)
            sock.sendall((token or "").encode() + b"\n")
            message, fds, _, _ = socket.recv_fds(sock, ANSWER_BYTES, 1)
        try:
            words = message.split()
            if len(fds) != 1 or len(words) != 2 or words[0] != OK or not words[1].isdigit():
                raise OSError(f"local socket {name}: refused ({message[:40]!r})")
            size = int(words[1])
            if size <= 0 or size != os.fstat(fds[0]).st_size:
                raise ValueError(f"local socket {name}: memory of {size} bytes, its file has another size")
            memory = mmap.mmap(fds[0], size, prot=mmap.PROT_READ)
            map_now(memory, write=False)
        finally:
            for fd in fds:
                os.close(fd)
        return cls(memory)

    def payload(self, shared: loader_pb2.SharedPayload) -> memoryview:
        """The chunk's bytes where the server left them; ValueError if they are not all inside."""
        if shared.offset + shared.length > self.size or shared.generation_offset + 8 > self.size:
            raise ValueError(
                f"shared payload [{shared.offset}, +{shared.length}) or its generation word at "
                f"{shared.generation_offset} lies outside the {self.size}-byte chunk memory"
            )
        if self.generation(shared) != shared.generation:
            raise ValueError("its slot was reused before it was read")
        return self.view[shared.offset : shared.offset + shared.length]

    def generation(self, shared: loader_pb2.SharedPayload) -> int:
        """The slot's generation word now."""
        return struct.unpack_from("<Q", self._memory, shared.generation_offset)[0]

    def close(self) -> None:
        self.view.release()
        try:
            self._memory.close()
        except BufferError:  # a view still exported (a copy under way elsewhere): freed with it
            pass
