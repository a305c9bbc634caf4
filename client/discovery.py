"""Turning what the user wrote into server addresses: lists, commas, and DNS names.

``"loader:50051"`` expands to every address the name resolves to (a compose service
scaled to N replicas, or a Kubernetes headless Service), so adding servers needs no
client change.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable


def split_addresses(address: str | Iterable[str]) -> list[str]:
    """Normalizes ``"a:1,b:2"`` or ``["a:1", "b:2"]`` into a list of ``host:port``."""
    items = address.split(",") if isinstance(address, str) else list(address)
    out = []
    for item in items:
        item = str(item).strip()
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"server address {item!r}: expected host:port, e.g. 127.0.0.1:50051 or loader:50051")
        out.append(item)
    if not out:
        raise ValueError(f"address={address!r}: no server addresses given")
    return list(dict.fromkeys(out))


def resolve(address: str) -> list[str]:
    """Expands a DNS name to one ``ip:port`` per address behind it; IPs pass through."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        return [address]
    except OSError:
        pass
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConnectionError(f"cannot resolve loader server name {host!r} ({address}): {exc}") from None
    resolved = []
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        resolved.append(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    # localhost resolving to both 127.0.0.1 and ::1 is one server, not two
    if host == "localhost":
        return [address]
    return list(dict.fromkeys(resolved))


def discover(address: str | Iterable[str]) -> list[str]:
    out: list[str] = []
    for item in split_addresses(address):
        out.extend(resolve(item))
    return list(dict.fromkeys(out))
