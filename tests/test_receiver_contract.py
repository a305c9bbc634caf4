"""The Receiver and Delivery contracts (``receiver.py``, ``delivery.py``), one test that every
pair passes: both receivers (``thread``, ``process``) with both deliveries (host; CUDA, skipped
without a GPU), opened as a loader opens them (``io_side.open_io``) on a real server.

What a RemoteLoader relies on: the servers described at start are reported new by the first
``discover`` and not described again; a started ``Pass`` is ``playing`` and delivers its plan's
batches in order, then END; a pass cancelled after one batch gives every buffer back (the
next pass plays whole with only ``prefetch + 2`` of them) and is no longer playing; keys,
counters and CPU time are there to read; ``stopped`` says nothing while it works.
"""

from __future__ import annotations

import pytest
import torch

from remoteloader.client import plan as plan_module
from remoteloader.client.batches import END
from remoteloader.client.epoch import Pass
from remoteloader.client.io_side import open_io
from remoteloader.client.options import LoaderOptions
from remoteloader.client.sample_space import SampleSpace
from remoteloader.client.thread_receiver import describe_servers
from remoteloader.tools.textures import make_imagefolder

pytestmark = pytest.mark.timeout(120)
BATCH, SIZE = 4, 16


@pytest.fixture(scope="module")
def server(module_cluster, tmp_path_factory):
    root = make_imagefolder(tmp_path_factory.mktemp("contract") / "data", ["a", "b"], 7, size=(24, 32))
    return module_cluster.address(module_cluster.add(root))


def play(receiver, delivery, played: Pass, stop_after: int | None = None) -> list[list[int]]:
    """Runs ``played`` as RemoteLoader._pass does; its batches' ids (it stops after ``stop_after``)."""
    out = delivery.start(receiver.start_epoch(played))
    assert receiver.playing is played
    got = []
    while (item := out.get(timeout=30)) is not END:
        assert not isinstance(item, BaseException), item
        receiver.consumed(played)
        delivered = delivery.finish(item)
        assert delivered.images.shape == (len(delivered.ids), SIZE, SIZE, 3)
        assert delivered.images.device.type == delivery_device(delivery)
        got.append(delivered.ids.tolist())
        del delivered
        if stop_after is not None and len(got) == stop_after:
            break
    return got


def delivery_device(delivery) -> str:
    return "cuda" if type(delivery).__name__ == "CudaDelivery" else "cpu"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU here"))])
@pytest.mark.parametrize("kind", ["thread", "process"])
def test_every_receiver_with_every_delivery_keeps_the_contract(server, kind, device):
    options = LoaderOptions.from_arguments(
        dict(batch_size=BATCH, image_size=SIZE, pipeline="eval", receiver=kind, device=device, prefetch=2)
    )
    described = describe_servers(server, options.connection, options.security)
    receiver, delivery = open_io(server, options, described)
    try:
        describes, new = receiver.discover()
        assert new == [server] and describes[server] == described[server]
        assert receiver.discover()[1] == []
        space = SampleSpace(describes)
        plan = plan_module.make_plan(space.num_samples, BATCH, shuffle=True, seed=3, epoch=0, rank=0,
                                     world_size=1, drop_last=False)
        expected = [b.tolist() for b in plan.batches]
        assert len(expected) == 4  # 14 samples in batches of 4: more than prefetch + 2 = 4 buffers' worth at once

        assert play(receiver, delivery, Pass(0, plan, 0, frozenset(), token=1, space=space)) == expected

        left = Pass(0, plan, 0, frozenset(), token=2, space=space)
        assert play(receiver, delivery, left, stop_after=1) == expected[:1]
        receiver.cancel_epoch(left)  # as RemoteLoader._abandon: the pass, then the delivery's work
        delivery.close()
        assert receiver.playing is None
        # Every buffer came back: a pass from batch 1, less batch 2, plays the rest whole.
        resumed = Pass(0, plan, 1, frozenset({2}), token=3, space=space)
        assert play(receiver, delivery, resumed) == [expected[1], expected[3]]

        counters = receiver.server_stats(timeout=10)[server]
        assert counters["samples"] >= space.num_samples and counters["state"] == "up"
        keys = receiver.get_keys([server], space.shards[0].id, 0, 2)
        assert len(keys) == 2 and all(isinstance(k, str) and k for k in keys)
        assert receiver.cpu_seconds() > 0 and receiver.stopped() is None
    finally:
        delivery.close(final=True)
        receiver.close()
    receiver.close()  # idempotent
