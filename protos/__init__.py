"""The wire contract: ``loader.proto`` (package ``remoteloader.v1``), its generated code, the chunk codec
(``codec``), the chunk/message size rule (``limits``), and malloc tuned for its multi-MB messages (``malloc``).

Submodules load on first use, so that the server's configuration can use ``limits`` without
importing protobuf and gRPC (the CLI parses its arguments quickly).
"""

import importlib
from types import ModuleType

__all__ = ["CUSTOM_PIPELINE", "SERVICE", "codec", "limits", "loader_pb2", "loader_pb2_grpc", "malloc"]
_SUBMODULES = ("codec", "limits", "loader_pb2", "loader_pb2_grpc", "malloc")

SERVICE = "remoteloader.v1.Loader"  # loader.proto's service (tests/test_packaging.py checks the generated code agrees)
CUSTOM_PIPELINE = "custom"  # Setup.pipeline for a client's own albumentations pipeline (Setup.albumentations_json)


def __getattr__(name: str) -> ModuleType:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
