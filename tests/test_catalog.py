"""The server's shards as one table (server/catalog.py, Catalog): server-wide sample ids, labels
looked up for a whole chunk at once, and what is known of each sample before it is served."""

from __future__ import annotations

import numpy as np

from remoteloader.protos import loader_pb2
from remoteloader.server.catalog import Catalog, SyntheticShard
from remoteloader.server.order_samples import Samples


def test_samples_of_many_shards_are_looked_up_by_server_wide_id():
    shards = [SyntheticShard(n, num_classes=k) for n, k in ((5, 3), (7, 200), (4, 10))]
    labels = [s.labels.copy() for s in shards]
    catalog = Catalog(shards)
    assert catalog.starts.tolist() == [0, 5, 12] and catalog.samples == 16
    # The shards' labels are views of the table's (kept once), with their values and the widest type.
    for shard, before in zip(shards, labels):
        assert np.shares_memory(shard.labels, catalog.labels)
        assert shard.labels.tolist() == before.tolist()
    assert catalog.labels.dtype == np.int32
    ids = [shards[2].id, shards[0].id, shards[1].id]
    order = loader_pb2.Order(shard_ids=ids, shards=[2, 0, 1, 1], indices=[6, 3, 4, 0])
    samples = Samples.of_order(order, catalog)
    assert samples.ids().tolist() == [5 + 6, 12 + 3, 4, 0]
    assert samples.labels() == [int(labels[1][6]), int(labels[2][3]), int(labels[0][4]), int(labels[0][0])]
    assert [s.id for s, _ in samples.pairs()] == [shards[1].id, shards[2].id, shards[0].id, shards[0].id]
    assert catalog.get(shards[1].id) is shards[1] and catalog.get("nope") is None


def test_what_is_known_of_a_sample_before_it_is_served_is_kept_per_server_wide_id():
    a, b = SyntheticShard(3), SyntheticShard(4)
    b.verified = np.array([True, False, True, True])
    a.failed = {1: "record 1 fails its CRC"}
    catalog = Catalog([a, b])
    assert catalog.verified().tolist() == [False, False, False, True, False, True, True]
    which, indices = np.array([1, 0, 0, 1]), np.array([1, 1, 2, 0])
    assert catalog.failures(which, indices) == ["", "record 1 fails its CRC", "", ""]


def test_a_chunk_over_many_tars_is_located_at_once_as_each_shard_locates_it(tmp_path):
    import io
    import tarfile

    from remoteloader.server.formats import open_shards
    from remoteloader.tools.textures import encode_jpeg, make_image

    rng = np.random.default_rng(3)
    for t in range(3):
        with tarfile.open(tmp_path / f"part-{t}.tar", "w") as tar:
            for k in range(4 + t):
                data = encode_jpeg(make_image(k % 2, 2, rng, 16, 16), 90)
                info = tarfile.TarInfo(f"s{t}_{k}.jpg")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    shards = open_shards([str(tmp_path)])
    assert len(shards) == 3
    one_by_one = {(s.id, i): s.locate(i) for s in shards for i in range(len(s))}
    catalog = Catalog(shards)
    which = np.array([2, 0, 1, 2, 0])
    indices = np.array([5, 3, 0, 0, 1])
    located = catalog.locate(which, indices)
    assert located == [one_by_one[(catalog.ids[w], i)] for w, i in zip(which, indices)]
    assert [s.locate(i) for s in shards for i in range(len(s))] == list(one_by_one.values())  # views, same ranges
