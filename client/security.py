"""Client-side TLS settings and the bearer token."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class TLSConfig:
    """How to verify the servers, and how to prove who we are (mutual TLS).

    Args:
        ca: PEM CA bundle that signed the servers' certificates.
        cert / key: This client's PEM certificate and key, for servers that require one.
        server_name: Name to check the server certificate against, when the address is an
            IP or a name the certificate does not list.
    """

    ca: str
    cert: str = ""
    key: str = ""
    server_name: str = ""

    def __post_init__(self):
        if bool(self.cert) != bool(self.key):
            raise ValueError("TLSConfig: cert and key go together (mutual TLS needs both)")
        for name in ("ca", "cert", "key"):
            path = getattr(self, name)
            if path and not pathlib.Path(path).is_file():
                raise ValueError(f"TLSConfig.{name}={path!r}: no such file")
            if path and b"-----BEGIN " not in pathlib.Path(path).read_bytes()[: 1 << 20]:
                raise ValueError(f"TLSConfig.{name}={path!r}: not a PEM file (no '-----BEGIN' line)")

    def credentials(self) -> grpc.ChannelCredentials:
        read = lambda p: pathlib.Path(p).read_bytes() if p else None  # noqa: E731
        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


def tls_config(tls) -> TLSConfig | None:
    if tls is None or isinstance(tls, TLSConfig):
        return tls
    if isinstance(tls, (str, pathlib.Path)):
        return TLSConfig(ca=str(tls))
    raise ValueError(f"tls={tls!r}: expected the path of a CA PEM file or a TLSConfig")


def token_metadata(token: str | None) -> tuple:
    if token is None:
        return ()
    if not isinstance(token, str) or not token.strip():
        raise ValueError("token: expected a non-empty string")
    return (("authorization", f"Bearer {token.strip()}"),)
