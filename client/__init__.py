"""The training side of remoteloader: ``from remoteloader.client import RemoteLoader``."""

from remoteloader.client.batches import LoaderError, SampleFailure
from remoteloader.client.security import TLSConfig

__all__ = ["LoaderError", "RemoteLoader", "SampleFailure", "TLSConfig"]


def __getattr__(name: str):
    # RemoteLoader imports torch; the receiver process (remoteloader.client.receiver_service) does not need it.
    if name == "RemoteLoader":
        from remoteloader.client.loader import RemoteLoader

        return RemoteLoader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
