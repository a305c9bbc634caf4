"""The loader server: ``ServerConfig``, ``create_server(config)``, ``serve(config)``, ``LocalServer``.

Heavy imports (OpenCV, albumentations, gRPC) happen on first use of a name, so the CLI's
argument parsing and the worker processes start quickly.
"""

from remoteloader.server.config import ServerConfig

__all__ = ["LoaderServer", "LocalServer", "ServerConfig", "create_server", "serve"]


def __getattr__(name: str):
    if name in ("LoaderServer", "create_server", "serve"):
        from remoteloader.server import app

        return getattr(app, name)
    if name == "LocalServer":
        from remoteloader.server.local import LocalServer

        return LocalServer
    raise AttributeError(f"module 'remoteloader.server' has no attribute {name!r}")
