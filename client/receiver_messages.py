"""What the training process and its receiver process say to each other, one class a message.

``ProcessReceiver`` (the training process) starts the child with ``Init``; then it sends, over
the socketpair (``receiver_channel.py`` says how they are pickled and why that is safe):

* ``Call``: a request id and one of the Receiver methods it stands for (``Discover``,
  ``Forget``, ``GetKeys``, ``ServerStats``, ``StartPass``, ``CancelPass``, ``Close``), answered
  by one ``Reply`` (``StartPass`` by ``Started``, before any of the pass's batches);
* ``Consumed`` and ``Free``, never answered: the consumer took a batch of the pass; a slot is
  free again.

The child sends ``Reply``, ``Started``, ``BatchReady`` (which slot holds which batch of a
pass), ``PassEnded`` (END, or the error that ended it) and ``Log`` (a record for the parent's
logger). Pixels never travel in a message: they are in the shared slots.

Every message is a NamedTuple, dispatched by type (``match``), never by position or a string
tag; an empty NamedTuple equals any other (``Discover() == ServerStats()``): compare types.
A pass is named by its token (``epoch.Pass.token``) where a message crosses: a message about
a pass that is no longer the running one changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from remoteloader.client.batches import SampleFailure
    from remoteloader.client.epoch import Pass
    from remoteloader.client.option_groups import ConnectionOptions, FlowOptions, SecurityOptions


# ---- parent -> child ---------------------------------------------------------------------------
class Init(NamedTuple):
    """The child's first message: what its ThreadReceiver is made of."""

    address: Any  # as RemoteLoader's
    setup: bytes  # loader_pb2.Setup
    slots: int
    slot_bytes: int
    flow: FlowOptions
    connection: ConnectionOptions
    security: SecurityOptions
    seed: int
    described: dict[str, bytes]  # address -> loader_pb2.DescribeResponse, from the loader's start


class Discover(NamedTuple):
    pass


class Forget(NamedTuple):
    addresses: list[str]


class GetKeys(NamedTuple):
    owners: list[str]
    shard_id: str
    start: int
    size: int  # keys from ``start`` (not ``count``: a tuple's method)


class ServerStats(NamedTuple):
    pass


class StartPass(NamedTuple):
    played: Pass


class CancelPass(NamedTuple):
    token: int


class Close(NamedTuple):
    pass


Request = Discover | Forget | GetKeys | ServerStats | StartPass | CancelPass | Close


class Call(NamedTuple):
    """A Receiver method called in the child; answered by one Reply (StartPass: Started)."""

    request_id: int
    request: Request


class Consumed(NamedTuple):
    """The consumer took one batch of the pass ``token``."""

    token: int


class Free(NamedTuple):
    """Slot ``slot`` is free again."""

    slot: int


# ---- child -> parent ---------------------------------------------------------------------------
class Reply(NamedTuple):
    """A Call's answer: its value, or (``ok`` False) a portable error (``receiver_channel``)."""

    request_id: int
    ok: bool
    value: Any


class Started(NamedTuple):
    """StartPass's answer: the pass ``token`` runs; its batches follow."""

    request_id: int
    token: int


class BatchReady(NamedTuple):
    """Batch ``seq`` of the pass ``token`` is complete in slot ``slot``."""

    token: int
    seq: int
    slot: int
    ids: np.ndarray
    labels: np.ndarray
    failures: list[SampleFailure]
    nbytes: int
    targets: dict[str, Any]


class PassEnded(NamedTuple):
    """The pass ``token`` ended: played to its end (``error`` None) or with an error (portable)."""

    token: int
    error: tuple[str, str] | None


class Log(NamedTuple):
    """A log record of the child, for the parent's logger of the same name."""

    level: int
    name: str
    text: str


ToChild = Call | Consumed | Free
ToParent = Reply | Started | BatchReady | PassEnded | Log
