"""The training side of remoteloader: ``from remoteloader.client import RemoteLoader``."""

from remoteloader.client.engine import LoaderError, SampleFailure
from remoteloader.client.loader import RemoteLoader
from remoteloader.client.security import TLSConfig

__all__ = ["LoaderError", "RemoteLoader", "SampleFailure", "TLSConfig"]
