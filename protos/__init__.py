"""The wire contract: ``loader.proto`` (package ``remoteloader.v1``), its generated code, and the chunk codec."""

from remoteloader.protos import codec, loader_pb2, loader_pb2_grpc

__all__ = ["codec", "loader_pb2", "loader_pb2_grpc"]
