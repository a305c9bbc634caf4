"""``remoteloader probe [HOST:PORT]``: exit 0 when a server's gRPC health says SERVING.

For container health checks where no grpc_health_probe binary is installed. Without an
address it probes the server of this container, as its ``REMOTELOADER_*`` variables place
it: the plaintext health port (``REMOTELOADER_HEALTH_PORT``) when there is one, which
answers whatever TLS and token the server's own port asks for, else its port
(``REMOTELOADER_PORT``, 50051). ``--tls CA_PEM`` speaks TLS to a server's own port.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from remoteloader.protos import SERVICE

DEFAULT_PORT = 50051


def this_containers_server(environ: Mapping[str, str] = os.environ) -> str:
    """127.0.0.1 and the port the REMOTELOADER_* variables give the health checks."""
    port = environ.get("REMOTELOADER_HEALTH_PORT", "0").strip() or "0"
    if port == "0":
        port = environ.get("REMOTELOADER_PORT", "").strip() or str(DEFAULT_PORT)
    return f"127.0.0.1:{port}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "address",
        nargs="?",
        default=None,
        help="server host:port (default: 127.0.0.1 and $REMOTELOADER_HEALTH_PORT, else $REMOTELOADER_PORT, else 50051)",
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    parser.add_argument("--service", default=SERVICE, help="service name to check ('' = overall)")
    parser.add_argument("--tls", metavar="CA_PEM", default="", help="speak TLS, trusting this CA")
    parser.add_argument("--server-name", default="", help="with --tls: the name the certificate holds")


def run(args: argparse.Namespace) -> int:
    address = args.address or this_containers_server()
    if args.tls:
        try:
            with open(args.tls, "rb") as f:
                credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
        except OSError as exc:
            print(f"--tls {args.tls}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
        channel = grpc.secure_channel(address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            print(f"{address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
