"""Which servers feed a loader, and the sample space they make together.

Discovery runs at start-up and again before every epoch, so servers added behind a DNS
name join at the next epoch. A server, once described, stays: one that no longer resolves,
fails or refuses a stream is kept (it may be restarting; its link retries). Only a server
that joins but cannot serve this loader (pipeline, image size) is dropped: an error at
start-up, and later a warning, the receiver forgetting it, so that it is described and
checked anew the next time discovery finds it. A resumed epoch plays over the
sample space its position was saved in (its ids mean those servers' samples); servers
that joined meanwhile are held back for the following epoch.
"""

from __future__ import annotations

import logging

from remoteloader.client.receiver import Receiver
from remoteloader.client.sample_space import SampleSpace
from remoteloader.protos import CUSTOM_PIPELINE, loader_pb2
from remoteloader.protos.wire import RAW

log = logging.getLogger("remoteloader.client")


class ServerSet:
    """The servers a loader uses (``addresses``) and their sample space (``space``).

    Args:
        receiver: The loader's I/O side, which resolves, describes and forgets servers.
        setup: The loader's pipeline and output size, which every server must offer.

    Raises at start-up what discovery raises (ConnectionError, PermissionError) and
    ValueError for a server that cannot serve this loader.
    """

    def __init__(self, receiver: Receiver, setup: loader_pb2.Setup):
        self._receiver = receiver
        self._setup = setup
        self.addresses: list[str] = []
        self._joined: SampleSpace | None = None  # servers that joined during a resumed epoch, for the next
        self.space = self._discover(None)

    def next_epoch(self, planned: SampleSpace | None) -> SampleSpace:
        """The space the next epoch plays over; ``planned``: a resumed epoch's own space."""
        found = self._discover(self.space)
        if self._joined is not None and found is self.space:  # nothing new since they joined
            found = self._joined
        self._joined = None
        if planned is not None and found.shard_ids != planned.shard_ids:
            # Servers joined behind the address since the state was loaded: its epoch plays
            # over the servers it was planned for; they join next.
            self._joined, found = found, planned
        self.space = found
        return found

    def _discover(self, known: SampleSpace | None) -> SampleSpace:
        """Resolves the address again and describes servers not seen before (``known`` None:
        at start-up, where every problem is the user's to hear of now)."""
        try:
            describes, new = self._receiver.discover()
        except (ConnectionError, OSError) as exc:
            if known is None:
                raise
            # A DNS hiccup or a server still starting: carry on with the servers known, retry next epoch.
            log.warning(
                "looking for new loader servers failed (%s); continuing with %d known", exc, len(self.addresses)
            )
            return known
        if not new and known is not None:
            return known
        refused = {}
        for address in new:
            try:
                check_offer(self._setup, address, describes[address])
            except ValueError as exc:
                if known is None:
                    raise
                refused[address] = exc
        if refused:  # joined later: training goes on without it; it is asked again next epoch
            self._receiver.forget(list(refused))
            for address, reason in refused.items():
                log.warning(
                    "loader server %s joined but cannot serve this loader (%s); going on without it", address, reason
                )
            describes = {a: d for a, d in describes.items() if a not in refused}
            if len(describes) == len(self.addresses) and known is not None:
                return known
        self.addresses = list(describes)
        return SampleSpace(describes)


def check_offer(setup: loader_pb2.Setup, address: str, d: loader_pb2.DescribeResponse) -> None:
    """Raises ValueError if the server cannot serve the pipeline, size and wire ``setup`` asks for
    (at start, before any buffer is allocated; and for each server that joins later)."""
    h, w = setup.height // max(1, setup.clip_frames * (setup.clips_per_video or 1)), setup.width  # (a clip's frame)
    if setup.pipeline == CUSTOM_PIPELINE:
        if not d.custom_pipelines:
            raise ValueError(
                f"loader server {address} does not accept custom albumentations pipelines "
                f"(start it with --allow-custom-pipelines); it offers {', '.join(d.pipelines)}"
            )
    elif setup.pipeline not in d.pipelines:
        raise ValueError(f"pipeline={setup.pipeline!r}: loader server {address} offers {', '.join(d.pipelines)}")
    if setup.wire not in ("", RAW) and setup.wire not in d.wires:
        raise ValueError(
            f"wire={setup.wire!r}: loader server {address} offers {', '.join([RAW, *d.wires])} "
            f"(an older server, or one without zstandard and simplejpeg: pip install 'remoteloader[server]')"
        )
    if not (d.min_image_size <= h <= d.max_image_size and d.min_image_size <= w <= d.max_image_size):
        raise ValueError(
            f"image_size={h}x{w}: loader server {address} offers sizes {d.min_image_size}..{d.max_image_size}"
        )
