"""The wire contract: ``loader.proto`` (package ``remoteloader.v1``), its generated code, the chunk codec
and the chunk/message size rule (``limits``).

Submodules load on first use, so that the server's configuration can use ``limits`` without
importing protobuf and gRPC (the CLI parses its arguments quickly).
"""

import importlib
from types import ModuleType

__all__ = ["codec", "limits", "loader_pb2", "loader_pb2_grpc"]


def __getattr__(name: str) -> ModuleType:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
