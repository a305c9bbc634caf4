"""client/receiver_channel.py and client/receiver_messages.py without a child process: the
slots both processes map, errors that cross, and the typed messages over a real socketpair."""

from __future__ import annotations

import os
import socket
from multiprocessing.connection import Connection

import numpy as np
import pytest

from remoteloader.client import plan as plan_module
from remoteloader.client import receiver_messages as msg
from remoteloader.client.batches import LoaderError, SampleFailure
from remoteloader.client.epoch import Pass
from remoteloader.client.option_groups import ConnectionOptions, FlowOptions, SecurityOptions
from remoteloader.client.receiver_channel import SharedSlots, portable_error, rebuild_error

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="receiver='process' is Linux's")


def test_two_mappings_of_the_slots_see_the_same_bytes_and_find_a_slot_by_address():
    slots = SharedSlots(3, 2 * 4 * 4 * 3 + 2 * 4 * 4)
    other = SharedSlots(3, slots.slot_bytes, slots.fd)  # as the child maps the parent's memfd
    images = other.view(1, 2, 4, 4)
    images[:] = 7
    other.mask_view(1, 2, 4, 4)[:] = 9
    assert (slots.view(1, 2, 4, 4) == 7).all() and (slots.mask_view(1, 2, 4, 4) == 9).all()
    assert not slots.view(0, 2, 4, 4).any() and not slots.view(2, 2, 4, 4).any()
    assert other.slot_of(images.ctypes.data) == 1


def test_errors_cross_as_their_type_or_as_a_loader_error_naming_theirs():
    for error in (ConnectionError("down"), PermissionError("token"), ValueError("size"), LoaderError("x")):
        back = rebuild_error(portable_error(error))
        assert type(back) is type(error) and str(back) == str(error)
    back = rebuild_error(portable_error(KeyError("k")))
    assert isinstance(back, LoaderError) and "KeyError" in str(back)
    assert type(rebuild_error(portable_error(ConnectionRefusedError("r")))) is ConnectionError  # its closest kind


def test_every_message_crosses_a_socketpair_whole_and_is_told_by_its_type():
    plan = plan_module.make_plan(10, 4, shuffle=True, seed=1, epoch=2, rank=0, world_size=1, drop_last=False)
    played = Pass(2, plan, 1, frozenset({2}), token=9)
    failure = SampleFailure(3, "a/b.jpg", "truncated", "127.0.0.1:1")
    sent = [
        msg.Init("127.0.0.1:1", b"setup", 4, 1024, FlowOptions(prefetch=3), ConnectionOptions(wire="zstd"),
                 SecurityOptions(token="t" * 20), 7, {"127.0.0.1:1": b"describe"}),
        msg.Call(1, msg.Discover()), msg.Call(2, msg.ServerStats()), msg.Call(3, msg.GetKeys(["a"], "s", 0, 5)),
        msg.Call(4, msg.StartPass(played)), msg.Call(5, msg.CancelPass(9)), msg.Consumed(9), msg.Free(2),
        msg.Started(4, 9), msg.BatchReady(9, 1, 2, np.arange(4), np.ones(4, np.int64), [failure], 10, {}),
        msg.PassEnded(9, None), msg.PassEnded(9, ("ValueError", "bad")), msg.Log(30, "remoteloader.client", "hi"),
    ]
    a, b = socket.socketpair()
    with a, b:
        left, right = Connection(os.dup(a.fileno())), Connection(os.dup(b.fileno()))
        for message in sent:
            left.send(message)
        got = [right.recv() for _ in sent]
        left.close()
        right.close()
    for before, after in zip(sent, got, strict=True):
        assert type(after) is type(before)
    init, start, ready = got[0], got[4], got[9]
    assert init.connection.wire == "zstd" and init.security.metadata == (("authorization", "Bearer " + "t" * 20),)
    assert init.flow.prefetch == 3 and init.described == {"127.0.0.1:1": b"describe"}
    played_there = start.request.played
    assert played_there.token == 9 and played_there.start == 1 and played_there.done == frozenset({2})
    assert [x.tolist() for x in played_there.plan.batches] == [x.tolist() for x in plan.batches]
    assert ready.ids.tolist() == [0, 1, 2, 3] and ready.failures == [failure]
    assert type(got[1].request) is not type(got[2].request)  # (equal as empty tuples: compare types)
