"""What ``remoteloader pack`` (tools/pack.py) needs from the server, in one public place.

pack reads a dataset the way a server reads it, rewrites its JPEGs for the server's region
decoder, and writes WebDataset tars that servers read back. Every server name it uses comes
from here, grouped by what it is for, so a change to one of them is plainly a change to
what pack and the servers agree on. (The other tools use ``cli`` and ``config`` alone.)

* Reading the source: ``open_storage``, ``is_remote`` and ``Storage`` (a folder or an object
  store), ``open_shards`` and ``FormatOptions`` (any format a server reads), ``CocoShard`` and
  ``ImageFolderShard`` (the two sources pack opens itself), ``Shard`` (what they all are),
  ``read_sample`` (a sample's bytes, as the decode workers read them).
* Checking and rewriting images: ``read_size`` and ``DecodeError`` (the header check every
  decode passes), ``can_transcode`` and ``transcode_jpeg`` (the lossless rewrite with a restart
  marker per MCU).
* Targets: ``draw_regions`` (a COCO sample's semantic mask), ``arrays_of`` (a Targets record's
  arrays), ``from_source`` (what a server makes of a tar's ``.json``), ``TargetError``.
* What servers read back: ``CLASSES_FILE``, ``IMAGE_EXTENSIONS``, ``MASK_SUFFIX``,
  ``MAX_JSON_BYTES`` (a tar's member names and limits), ``INDEX_SUFFIX`` and ``index_tar``
  (a tar's sidecar index).
* Videos: ``holds_videos`` (whether a folder is a video folder, as a server decides it),
  ``VideoFolderShard`` (such a folder, each video indexed as a server indexes it) and
  ``VIDEO_EXTENSIONS`` (the video member names a tar reader takes).
* ``default_workers``: the usable cores, as a server counts them.
"""

from __future__ import annotations

import numpy as np

from remoteloader.server.catalog import CLASSES_FILE, IMAGE_EXTENSIONS, MASK_SUFFIX, MAX_JSON_BYTES, Shard
from remoteloader.server.config import default_workers
from remoteloader.server.decode import DecodeError, can_transcode, read_size, transcode_jpeg
from remoteloader.server.formats import FormatOptions, open_shards
from remoteloader.server.formats.coco import CocoShard
from remoteloader.server.formats.imagefolder import ImageFolderShard
from remoteloader.server.formats.index import INDEX_SUFFIX
from remoteloader.server.formats.tar import TarShard
from remoteloader.server.formats.video import VideoFolderShard, holds_videos
from remoteloader.server.sample_reads import read_sample
from remoteloader.server.storage import Storage, is_remote, open_storage
from remoteloader.server.targets import TargetError, arrays_of, draw_regions, from_source
from remoteloader.server.video_decode import VIDEO_EXTENSIONS

__all__ = [
    "CLASSES_FILE",
    "IMAGE_EXTENSIONS",
    "INDEX_SUFFIX",
    "MASK_SUFFIX",
    "MAX_JSON_BYTES",
    "CocoShard",
    "DecodeError",
    "FormatOptions",
    "ImageFolderShard",
    "Shard",
    "Storage",
    "TargetError",
    "VIDEO_EXTENSIONS",
    "VideoFolderShard",
    "arrays_of",
    "can_transcode",
    "default_workers",
    "draw_regions",
    "from_source",
    "holds_videos",
    "index_tar",
    "is_remote",
    "open_shards",
    "open_storage",
    "read_sample",
    "read_size",
    "transcode_jpeg",
]


def index_tar(path: str, class_names: list[str], verified: np.ndarray | None = None) -> None:
    """Indexes a tar as a server does, which writes its sidecar index (``path`` + INDEX_SUFFIX):
    servers then start without scanning the tar. ``verified``: per sample, whether it is known
    to decode whole without error (pack's rewritten JPEGs), kept in the index (Shard.verified)."""
    TarShard(*open_storage(path), class_names, verified=verified)
