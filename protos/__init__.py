"""The wire contract: ``loader.proto`` (package ``remoteloader.v1``), its generated code, the chunk codec
and the chunk/message size rule (``limits``)."""

from remoteloader.protos import codec, limits, loader_pb2, loader_pb2_grpc

__all__ = ["codec", "limits", "loader_pb2", "loader_pb2_grpc"]
