"""TLS / mutual TLS credentials and the bearer-token check (gRPC calls and server.local_socket)."""

from __future__ import annotations

import hmac
import pathlib

import grpc

# Probes (Kubernetes, compose) ask for health without a token; nothing else is open.
OPEN_METHODS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS with the server's certificate; with ``client_ca``, clients must present one it signed."""
    ca = pathlib.Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials(
        [(pathlib.Path(key).read_bytes(), pathlib.Path(cert).read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def read_token(path: str) -> bytes:
    token = pathlib.Path(path).read_text().strip().encode()
    if len(token) < 16:
        raise ValueError(
            f"token_file {path}: the token is {len(token)} bytes; use at least 16 "
            f"(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return token


def token_matches(given: bytes, expected: bytes) -> bool:
    """Whether a client sent the expected token: compared in constant time, so how long it takes
    says nothing about the token."""
    return hmac.compare_digest(given, expected)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without ``authorization: Bearer <token>`` (constant-time comparison)."""

    def __init__(self, token: bytes):
        self._expected = b"Bearer " + token

        async def deny(request, context):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong bearer token (send metadata authorization: Bearer <token>)",
            )

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method in OPEN_METHODS:
            return await continuation(details)
        given = b""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                break
        if token_matches(given, self._expected):
            return await continuation(details)
        return self._deny_stream if details.method.endswith("/Stream") else self._deny_unary
