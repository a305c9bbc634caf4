"""The training side of remoteloader: ``from remoteloader.client import RemoteLoader``."""

from remoteloader.client.batches import LoaderError, SampleFailure
from remoteloader.client.security import TLSConfig

__all__ = ["LoaderError", "RemoteLoader", "SampleFailure", "TLSConfig", "boxes_to_orig"]


def __getattr__(name: str):
    # RemoteLoader imports torch; the receiver process (remoteloader.client.receiver_service) does not need it.
    if name == "RemoteLoader":
        from remoteloader.client.loader import RemoteLoader

        return RemoteLoader
    if name == "boxes_to_orig":
        from remoteloader.client.torchvision_form import boxes_to_orig

        return boxes_to_orig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
