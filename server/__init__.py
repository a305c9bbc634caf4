"""The loader server: ``ServerConfig``, ``create_server(config)``, ``serve(config)``.

Heavy imports (OpenCV, albumentations, gRPC) happen on first use of a name, so the CLI's
argument parsing and the worker processes start quickly. A server on this machine as a
subprocess (for demos, benchmarks and tests) is ``remoteloader.tools.local.LocalServer``.
"""

from remoteloader.server.config import ServerConfig

__all__ = ["LoaderServer", "ServerConfig", "create_server", "serve"]


def __getattr__(name: str):
    if name in ("LoaderServer", "create_server", "serve"):
        from remoteloader.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'remoteloader.server' has no attribute {name!r}")
