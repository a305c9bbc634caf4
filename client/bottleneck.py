"""What limits the images/s a training host gets: the one rule ``stats()`` and ``remoteloader bench`` use.

Over a span of time (an epoch; a benchmark's run), each server says how busy its decode
workers were (``ChunkHeader.workers_busy``) and this host measures how busy its receiver
was (CPU seconds over wall seconds). A server whose workers were busy ``BUSY`` of the time
was limited by its CPUs: more servers (or cores) help. A receiver as busy is this host's
limit: more servers cannot help, a receiver process or fewer bytes per image can. Otherwise
what held the server back lies between the two: its link (its bandwidth, or too little in
flight for its latency), or, for a server on this host read through shared memory (no
link), its reading of the data or its main process. When the training loop hardly waited,
its own step is the limit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from remoteloader.protos import limits

BUSY = 0.75  # a share of the time at which CPUs count as the limit
WAITED = 0.05  # below this share of the time waiting for data, the training step is the limit

SERVERS = "servers' decode CPUs"
RECEIVING = "this host's receiving"
LINKS = "links"
READING = "same-host servers' reading or main process"
STEP = "the training step"
UNKNOWN = "unknown (a span shorter than the servers' busy window)"
REMEDY = {
    SERVERS: "More loader servers, or more cores for them, would feed it faster",
    RECEIVING: (
        "More servers would not help: receiver='process' (another core for receiving) or fewer bytes "
        "per image (a smaller image_size) would"
    ),
    LINKS: (
        "The servers' decode workers had time to spare: faster links, servers behind other links, fewer "
        'bytes per image (RemoteLoader\'s wire option, docs/operator-guide.md, "Wire choices"), or more orders '
        "in flight (max_inflight, for a link with a long round trip) would feed it faster"
    ),
    READING: (
        "The servers on this host had decode workers to spare and no link between: their reads (a cold "
        "page cache or a slow disk; --cache-bytes keeps samples in memory) or their main processes held "
        "them back"
    ),
    STEP: "The input keeps up",
    UNKNOWN: "A longer epoch, or `remoteloader bench`, would say which part",
}


@dataclass(frozen=True)
class ServerSpan:
    """What one server delivered over a span."""

    images: int
    bytes: int
    workers_busy: float  # its workers' busy share, averaged over its images
    shared: bool = False  # read through shared memory (a server on this host): no link


def spans(before: Mapping[str, Mapping], after: Mapping[str, Mapping]) -> dict[str, ServerSpan]:
    """Each server's span between two readings of ``stats()["servers"]`` (Link.counters)."""
    out = {}
    for address, now in after.items():
        then = before.get(address, {})
        images = int(now["samples"]) - int(then.get("samples", 0))
        busy = float(now["busy_samples"]) - float(then.get("busy_samples", 0.0))
        out[address] = ServerSpan(
            images=images,
            bytes=int(now["bytes"]) - int(then.get("bytes", 0)),
            workers_busy=min(1.0, busy / images) if images > 0 else 0.0,
            shared=bool(now.get("shared_memory", False)),
        )
    return out


def server_limit(workers_busy: float, receiver_busy: float, shared: bool = False) -> str:
    """What held one server's delivery back (``shared``: read through shared memory)."""
    if workers_busy >= BUSY:
        return SERVERS
    if receiver_busy >= BUSY:
        return RECEIVING
    return READING if shared else LINKS


def likely_limit(
    servers: Mapping[str, ServerSpan], receiver_busy: float, waited: float | None = None, seconds: float | None = None
) -> str:
    """The limit of a span: ``STEP`` when the loop waited less than ``WAITED`` of it (``waited``
    None: a benchmark, where it always waits); ``UNKNOWN`` for a span of fewer ``seconds`` than
    the servers' busy share covers (it would mix in their time before it); else this host's
    receiving, or the limit of the servers that delivered most of the images."""
    if waited is not None and waited < WAITED:
        return STEP
    if seconds is not None and seconds < limits.BUSY_WINDOW:
        return UNKNOWN
    if receiver_busy >= BUSY:
        return RECEIVING
    total = sum(s.images for s in servers.values())
    on_cpus = sum(s.images for s in servers.values() if s.workers_busy >= BUSY)
    if total and on_cpus * 2 >= total:
        return SERVERS
    shared = sum(s.images for s in servers.values() if s.shared and s.workers_busy < BUSY)
    return READING if shared * 2 > total - on_cpus else LINKS
