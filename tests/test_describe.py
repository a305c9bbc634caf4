"""Describe at real scale: class lists once, shards in pages, whatever their numbers.

``server/describe.py`` pages a server's shards; the client (``Link.fetch_describe``) reads every
page and ``SampleSpace`` numbers the shards. A server of 100,000 shards naming 1,000 or 21,843
classes (ImageNet, ImageNet-21k) answers in pages that each stay under gRPC's limits; a class
list too long for any message is refused at start, saying what it is. The last test packs a
1,000-class ImageFolder into thousands of shards and trains from it.
"""

from __future__ import annotations

from concurrent import futures

import grpc
import numpy as np
import pytest
from packing import pack_cli

from remoteloader.client import RemoteLoader
from remoteloader.client.option_groups import ConnectionOptions, SecurityOptions
from remoteloader.client.sample_space import SampleSpace
from remoteloader.client.thread_receiver import describe_servers
from remoteloader.protos import SERVICE, limits, loader_pb2
from remoteloader.server.describe import DescribeError, ShardPages
from remoteloader.tools.textures import make_imagefolder


class Stub:
    """What Describe reads of a shard (server/catalog.py's Shard): no index behind it."""

    def __init__(self, k: int, class_names: list[str], samples: int = 1300):
        self.id = f"tar-{k:024x}"
        self.name = f"imagenet-train-{k:06d}.tar"
        self.class_names = class_names
        self.fields = ("label",)
        self._samples = samples

    def __len__(self) -> int:
        return self._samples


def wordnet_ids(n: int) -> list[str]:
    return [f"n{1440764 + 37 * i:08d}" for i in range(n)]


def pages_of(pages: ShardPages) -> list[loader_pb2.DescribeResponse]:
    """Every page, as a client asks for them: from shard 0, then after the last one it got."""
    out: list[loader_pb2.DescribeResponse] = []
    start = 0
    while True:
        page = loader_pb2.DescribeResponse()
        pages.fill(page, start)
        out.append(page)
        start += len(page.shards)
        if start >= page.num_shards:
            return out


@pytest.mark.parametrize("classes", [1000, 21_843])
def test_100000_shards_naming_one_class_list_are_described_in_bounded_pages_the_list_once(classes):
    names = wordnet_ids(classes)
    shards = [Stub(k, names) for k in range(100_000)]
    pages = ShardPages(shards)
    got = pages_of(pages)
    assert len(got) == len(pages) > 1
    assert max(page.ByteSize() for page in got) <= limits.DESCRIBE_PAGE_BYTES + 64 * 1024
    assert [len(page.class_lists) for page in got] == [1] + [0] * (len(got) - 1)  # the list once, in the first page
    assert list(got[0].class_lists[0].names) == names
    described = [s for page in got for s in page.shards]
    assert [s.id for s in described] == [s.id for s in shards]
    assert {s.class_list for s in described} == {1} and {s.num_samples for s in described} == {1300}


def test_shards_with_lists_of_their_own_carry_each_list_once_in_the_page_of_its_first_shard():
    lists = [[f"c{k}-{i}" for i in range(4000)] for k in range(300)]  # ~40 KB a list: several pages
    shards = [Stub(k, lists[k % 300] if k % 7 else []) for k in range(3000)]
    got = pages_of(ShardPages(shards))
    assert len(got) > 3
    assert max(page.ByteSize() for page in got) <= limits.DESCRIBE_PAGE_BYTES + 64 * 1024
    numbered: list[list[str]] = []
    for page in got:
        assert page.class_list_start == len(numbered)
        numbered += [list(c.names) for c in page.class_lists]
        for s in page.shards:  # a page names only lists it or an earlier one carries
            assert s.class_list <= len(numbered)
    described = [s for page in got for s in page.shards]
    for shard, s in zip(shards, described):
        assert (numbered[s.class_list - 1] if s.class_list else []) == shard.class_names


def described(answer) -> loader_pb2.DescribeResponse:
    """What a client makes of a server whose Describe is ``answer(request)`` (a real gRPC server on
    127.0.0.1, the client's own Describe calls)."""
    server = grpc.server(futures.ThreadPoolExecutor(2),
                         options=[("grpc.max_send_message_length", limits.MAX_DESCRIBE_BYTES)])
    handler = grpc.unary_unary_rpc_method_handler(
        lambda request, context: answer(request),
        request_deserializer=loader_pb2.DescribeRequest.FromString,
        response_serializer=loader_pb2.DescribeResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Describe": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        connection = ConnectionOptions(connect_timeout=20, max_inflight=4, reconnect_timeout=5)
        (response,) = describe_servers(f"127.0.0.1:{port}", connection, SecurityOptions()).values()
        return response
    finally:
        server.stop(None)


def test_a_client_reads_every_page_and_numbers_the_shards_over_grpc():
    names = wordnet_ids(1000)
    shards = [Stub(k, names if k % 2 else wordnet_ids(10), samples=k % 5 + 1) for k in range(30_000)]
    pages = ShardPages(shards)
    assert len(pages) > 2

    def describe(request: loader_pb2.DescribeRequest) -> loader_pb2.DescribeResponse:
        response = loader_pb2.DescribeResponse(max_order_samples=1024)
        pages.fill(response, request.shard_start)
        return response

    describe_response = described(describe)
    assert len(describe_response.shards) == 30_000 and len(describe_response.class_lists) == 2
    space = SampleSpace({"server": describe_response})
    assert space.num_samples == sum(len(s) for s in shards)
    assert space.class_names == sorted(set(names) | set(wordnet_ids(10)))
    # Labels map from each shard's own list onto the union: label 3 of a 10-class shard, of a 1,000-class one.
    small, large = space.shards[0], space.shards[1]
    assert space.class_names[int(space.global_labels(np.asarray([0]), np.asarray([3]))[0])] == small.class_names[3]
    assert space.class_names[int(space.global_labels(np.asarray([1]), np.asarray([3]))[0])] == large.class_names[3]
    assert len({id(s.class_names) for s in space.shards}) == 2, "a class list held once per shard"


def test_a_server_of_an_older_version_is_named_as_such_not_as_unreachable():
    old = loader_pb2.DescribeResponse(version="0.1.0")  # shards, and no count of them (before pages)
    old.shards.add(id="tar-0", name="a.tar", num_samples=3)
    with pytest.raises(ConnectionError, match="runs remoteloader 0.1.0, whose Describe and orders this client"):
        described(lambda request: old)


def test_a_class_list_no_message_can_carry_is_refused_at_start_saying_so():
    huge = [f"class-{i:07d}-with-a-long-descriptive-name" for i in range(200_000)]  # ~9 MB of names
    with pytest.raises(DescribeError, match=r"names 200,000 classes.*more than one Describe message may carry"):
        ShardPages([Stub(0, huge)])
    long_id = Stub(1, [])
    long_id.id = "x" * (limits.MAX_SHARD_ID_BYTES + 1)
    with pytest.raises(DescribeError, match="longer than"):
        ShardPages([long_id])


@pytest.mark.slow
def test_an_imagenet_shaped_pack_of_1000_classes_in_thousands_of_shards_trains(cluster, tmp_path, run_bounded):
    """1,000 classes of 2 images packed 2 to a shard or less: each shard names the 1,000 classes,
    which made Describe outgrow gRPC's limit at about 480 shards; a batch touches hundreds of them."""
    classes = wordnet_ids(1000)
    src = make_imagefolder(tmp_path / "src", classes, 2, size=(24, 32), seed=5)
    result = pack_cli(src, tmp_path / "packed", "--shard-size", "2KB")
    assert result.returncode == 0, result.stderr
    tars = sorted((tmp_path / "packed").glob("*.tar"))
    assert len(tars) >= 1000, len(tars)
    i = cluster.add(tmp_path / "packed")
    with RemoteLoader(cluster.address(i), batch_size=256, image_size=16, return_ids=True, shuffle=True,
                      drop_last=False, connect_timeout=60) as loader:
        assert loader.class_names == classes
        assert len(loader.sample_space.shards) == len(tars)
        epoch = run_bounded(loader, 240)
        ids = np.concatenate([batch_ids.numpy() for _, _, batch_ids in epoch])
        assert sorted(ids.tolist()) == list(range(2000)), "not every sample exactly once"
        for _, labels, batch_ids in epoch[:2]:  # (a sample's key is <class>/<file>, as in its ImageFolder)
            for label, sample in zip(labels.tolist(), batch_ids.tolist()):
                assert loader.sample_key(sample).split("/")[0] == classes[label]
