"""``remoteloader probe HOST:PORT``: exit 0 when a server's gRPC health says SERVING.

For container health checks where no grpc_health_probe binary is installed.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from remoteloader.protos import SERVICE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", nargs="?", default="127.0.0.1:50051", help="server host:port")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    parser.add_argument("--service", default=SERVICE, help="service name to check ('' = overall)")


def run(args: argparse.Namespace) -> int:
    with grpc.insecure_channel(args.address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
