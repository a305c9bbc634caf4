"""The same-host handshake both sides speak (DescribeResponse.local_socket, .host_id).

A server offers an abstract Unix socket, named in Describe as ``@name``. A client on the same
host (its ``host_id`` equal to the server's) connects to it and sends one line, its token
(empty when it has none), at most ``MAX_LINE`` bytes with the newline; the server answers
``OK <file size>\\n`` with a read-only descriptor of its chunk memory attached (SCM_RIGHTS),
or ``REFUSED``, and closes the connection. Chunks then carry ``ChunkHeader.shared``.
"""

from __future__ import annotations

MAX_LINE = 4096  # the token line, newline included
ANSWER_BYTES = 64  # the most an answer takes
OK, REFUSED = b"ok", b"refused\n"
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def host_id() -> str:
    """This host's identity (its kernel's boot id, DescribeResponse.host_id); "" when unknown."""
    try:
        with open(_BOOT_ID) as file:
            return file.read(256).strip()
    except OSError:
        return ""


def socket_address(name: str) -> str:
    """The address to bind or connect for a Describe name "@name" (an abstract socket);
    ValueError for any other form."""
    if not name.startswith("@") or not 1 < len(name) <= 100:
        raise ValueError(f"local socket {name!r}: expected an abstract socket name, @...")
    return "\0" + name[1:]
