"""Invariants that are the whole contract, checked on generated inputs (hypothesis).

* The epoch plan: for any dataset size, batch size, rank count, seed and epoch, every rank
  gets the same number of batches, the ranks' batches are disjoint and together cover the
  epoch (all of it, or all but the remainder with ``drop_last``), the plan is a pure
  function of its arguments, and each batch computed on its own is the one the whole
  epoch order, dealt by the split rule, holds there.
* The state_dict: a position saved anywhere in an epoch, and loaded into a fresh loader,
  resumes exactly the batches not yet delivered, and is refused by a loader of another plan.
* The chunk codec: whatever header and pixels, encoding then decoding gives them back, and
  on any message protobuf itself accepts (fields in another order, repeated, unknown ones
  between them) ``decode_chunk`` reads what protobuf reads, or refuses a truncated one.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec import field, varint

from remoteloader.client import plan
from remoteloader.client.ranks import Partition
from remoteloader.protos import loader_pb2
from remoteloader.protos.codec import decode_chunk, encode_chunk

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
U32, U64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)


# ---- the epoch plan -----------------------------------------------------------------------


@st.composite
def plan_arguments(draw):
    world_size = draw(st.integers(1, 8))
    return dict(num_samples=draw(st.integers(1, 3000)), batch_size=draw(st.integers(1, 64)),
                world_size=world_size, shuffle=draw(st.booleans()), seed=draw(U64), epoch=draw(st.integers(0, 10**6)),
                drop_last=draw(st.booleans()))


def every_rank(args: dict) -> list[list[np.ndarray]]:
    options = {k: v for k, v in args.items() if k not in ("num_samples", "batch_size")}
    return [plan.make_plan(args["num_samples"], args["batch_size"], rank=rank, **options).batches
            for rank in range(args["world_size"])]


@SETTINGS
@given(plan_arguments())
def test_every_rank_gets_as_many_batches_and_together_they_cover_the_epoch(args):
    n, batch_size, world_size = args["num_samples"], args["batch_size"], args["world_size"]
    ranks = every_rank(args)
    expected = plan.num_batches(n, batch_size, world_size, args["drop_last"])
    assert [len(batches) for batches in ranks] == [expected] * world_size
    ids = np.concatenate([b for batches in ranks for b in batches] or [np.zeros(0, np.int64)])
    assert ids.dtype == np.int64 and (ids.size == 0 or (ids.min() >= 0 and ids.max() < n))
    full_rounds = n // (batch_size * world_size) * batch_size * world_size
    if args["drop_last"]:
        assert all(len(b) == batch_size for batches in ranks for b in batches)
        assert len(np.unique(ids)) == ids.size == full_rounds  # disjoint, and all but the remainder
    else:
        assert len(np.unique(ids)) == n  # every sample, at least once
        # Only a rank left without a remainder sample repeats one (as DistributedSampler pads).
        assert ids.size - n == max(0, world_size - (n - full_rounds)) if n > full_rounds else ids.size == n
        assert all(0 < len(b) <= batch_size for batches in ranks for b in batches)


@SETTINGS
@given(plan_arguments())
def test_the_plan_is_a_pure_function_of_its_arguments(args):
    first, again = every_rank(args), every_rank(args)
    assert all(np.array_equal(a, b) for x, y in zip(first, again) for a, b in zip(x, y))
    if args["shuffle"] and sum(map(len, first[0])) > 20:  # another epoch is another order
        other = every_rank({**args, "epoch": args["epoch"] + 1})
        assert any(not np.array_equal(a, b) for x, y in zip(first, other) for a, b in zip(x, y))


def dealt(order: np.ndarray, batch_size: int, rank: int, world_size: int, drop_last: bool) -> list[np.ndarray]:
    """The split rule written out over a whole order, as the plan held it before it was computed batch by
    batch: global batches dealt round-robin, the remainder split evenly (np.array_split), one sample repeated
    by a rank left without any."""
    per_round = batch_size * world_size
    rounds = len(order) // per_round
    batches = [order[(k * world_size + rank) * batch_size:(k * world_size + rank + 1) * batch_size]
               for k in range(rounds)]
    rest = order[rounds * per_round:]
    if drop_last or rest.size == 0:
        return batches
    part = rest if world_size == 1 else np.array_split(rest, world_size)[rank]
    return batches + [part if part.size else order[rank % len(order):rank % len(order) + 1]]


@SETTINGS
@given(plan_arguments())
def test_each_batch_computed_alone_is_the_whole_order_dealt(args):
    n = args["num_samples"]
    order = plan.Shuffle(n, args["seed"], args["epoch"])(np.arange(n)) if args["shuffle"] else np.arange(n)
    for rank, batches in enumerate(every_rank(args)):
        expected = dealt(order, args["batch_size"], rank, args["world_size"], args["drop_last"])
        assert len(batches) == len(expected)
        assert all(np.array_equal(batches[k], b) for k, b in enumerate(expected))  # asked for one by one
        assert all(np.array_equal(a, b) for a, b in zip(batches, expected))  # and in turn


@SETTINGS
@given(st.integers(1, 500), st.integers(1, 32), st.integers(1, 4), st.integers(0, 1000))
def test_a_samplers_order_is_dealt_as_given(n, batch_size, world_size, epoch):
    order = np.random.default_rng(epoch).integers(0, n, size=n)  # repeats allowed, as a weighted sampler makes
    batches = [plan.make_plan(n, batch_size, shuffle=True, seed=0, epoch=epoch, rank=r, world_size=world_size,
                              drop_last=True, sampler=order.tolist()).batches for r in range(world_size)]
    rounds = n // (batch_size * world_size)
    for k in range(rounds):
        for rank in range(world_size):
            start = (k * world_size + rank) * batch_size
            assert np.array_equal(batches[rank][k], order[start:start + batch_size])
    for rank in range(world_size):
        with_rest = plan.make_plan(n, batch_size, shuffle=True, seed=0, epoch=epoch, rank=rank, world_size=world_size,
                                   drop_last=False, sampler=order.tolist()).batches
        expected = dealt(order, batch_size, rank, world_size, False)
        assert [b.tolist() for b in with_rest] == [b.tolist() for b in expected]


# ---- the chunk codec ----------------------------------------------------------------------


def _string(max_size: int = 40):
    return st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=max_size)


@st.composite
def headers(draw) -> loader_pb2.ChunkHeader:
    errors = draw(st.lists(st.builds(loader_pb2.SampleError, position=U32, index=U64, key=_string(),
                                     reason=_string()), max_size=4))
    return loader_pb2.ChunkHeader(
        order_id=draw(U64), start=draw(U32), count=draw(U32), order_size=draw(U32), height=draw(U32),
        width=draw(U32), channels=draw(U32), labels=draw(st.lists(st.integers(-2**63, 2**63 - 1), max_size=40)),
        errors=errors)


@st.composite
def unknown_fields(draw) -> bytes:
    """A field this version does not know, as a newer or other-language server may send."""
    number = draw(st.integers(3, 2000))
    kind = draw(st.sampled_from(["varint", "fixed64", "fixed32", "bytes", "group"]))
    if kind == "varint":
        return field(number, 0, varint(draw(U64)))
    if kind == "fixed64":
        return field(number, 1, draw(st.binary(min_size=8, max_size=8)))
    if kind == "fixed32":
        return field(number, 5, draw(st.binary(min_size=4, max_size=4)))
    payload = draw(st.binary(max_size=30))
    if kind == "bytes":
        return field(number, 2, varint(len(payload)) + payload)
    inner = field(number + 1, 2, varint(len(payload)) + payload)
    return field(number, 3, inner) + varint(number << 3 | 4)


@st.composite
def foreign_chunks(draw) -> bytes:
    """A valid Chunk laid out as any protobuf writer may: fields in any order, repeated, mixed with unknown ones."""
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        head = draw(headers()).SerializeToString()
        parts.append(field(1, 2, varint(len(head)) + head))
    for _ in range(draw(st.integers(0, 2))):
        pixels = draw(st.binary(max_size=300))
        parts.append(field(2, 2, varint(len(pixels)) + pixels))
    parts += draw(st.lists(unknown_fields(), max_size=3))
    return b"".join(draw(st.permutations(parts)))


@SETTINGS
@given(headers(), st.binary(max_size=5000))
def test_any_header_and_pixels_round_trip_and_match_protobufs_bytes(header, pixels):
    data = encode_chunk(header, pixels)
    reference = loader_pb2.Chunk(header=header, pixels=pixels)
    assert loader_pb2.Chunk.FromString(data) == reference
    if pixels:  # proto3 leaves an empty bytes field out; the codec always writes it (both valid)
        assert data == reference.SerializeToString()
    decoded = decode_chunk(data)
    assert decoded.header == header and bytes(decoded.pixels) == pixels


@SETTINGS
@given(foreign_chunks())
def test_any_layout_protobuf_accepts_decodes_as_protobuf_reads_it(data):
    parsed = loader_pb2.Chunk.FromString(data)
    decoded = decode_chunk(data)
    assert decoded.header == parsed.header and bytes(decoded.pixels) == parsed.pixels


@SETTINGS
@given(foreign_chunks(), st.data())
def test_a_cut_message_is_refused_or_read_as_protobuf_reads_it(data, draw):
    cut = data[:draw.draw(st.integers(0, max(0, len(data) - 1)))]
    try:
        parsed = loader_pb2.Chunk.FromString(cut)
    except DecodeError:
        parsed = None
    try:
        decoded = decode_chunk(cut)
    except ValueError:
        assert parsed is None, "decode_chunk refused a message protobuf reads"
        return
    assert parsed is not None, "decode_chunk read a message protobuf refuses"
    assert decoded.header == parsed.header and bytes(decoded.pixels) == parsed.pixels


# ---- the state_dict ------------------------------------------------------------------------


@st.composite
def positions(draw):
    """A plan, and a position in it reached by delivering some batches in any order (ordered=False)."""
    args = draw(plan_arguments())
    partition = Partition(draw(st.integers(0, args["world_size"] - 1)), args["world_size"])
    identity = {"seed": args["seed"], "num_samples": args["num_samples"], "batch_size": args["batch_size"],
                "shuffle": args["shuffle"], "drop_last": args["drop_last"], "ordered": False}
    options = {k: args[k] for k in ("shuffle", "seed", "drop_last")}

    def plan_of(epoch: int, part: Partition) -> plan.EpochPlan:
        return plan.make_plan(args["num_samples"], args["batch_size"], epoch=epoch, rank=part.rank,
                              world_size=part.world_size, **options)

    epoch = args["epoch"]
    batches = plan_of(epoch, partition).batches
    delivered = draw(st.lists(st.sampled_from(range(len(batches))), unique=True)) if batches else []
    return identity, partition, plan_of, epoch, batches, delivered


@SETTINGS
@given(positions())
def test_a_state_dict_resumes_exactly_the_batches_not_yet_delivered(case):
    from remoteloader.client.epoch import EpochPosition

    identity, partition, plan_of, epoch, batches, delivered = case
    playing = EpochPosition(plan_of, replayable=True)
    playing.set_epoch(epoch)
    played = playing.next_pass(partition)
    playing.begin(played)
    for seq in delivered:
        playing.delivered(played, seq)
    state = playing.state_dict(identity, partition)
    assert json.loads(json.dumps(state)) == state  # what a checkpoint holds

    fresh = EpochPosition(plan_of, replayable=True)
    fresh.load(json.loads(json.dumps(state)), identity, space=None, partition=partition)
    assert fresh.state_dict(identity, partition) == state
    resumed = fresh.next_pass(partition)
    remaining = [seq for seq in range(resumed.start, len(resumed.plan.batches)) if seq not in resumed.done]
    if batches and len(delivered) == len(batches):  # the epoch ended: the next one, whole
        assert resumed.epoch == epoch + 1 and remaining == list(range(len(plan_of(epoch + 1, partition).batches)))
    else:
        assert resumed.epoch == epoch
        assert remaining == [seq for seq in range(len(batches)) if seq not in delivered]
        assert all(np.array_equal(a, b) for a, b in zip(resumed.plan.batches, batches))

    for key, other in (("seed", (identity["seed"] + 1) % 2**64), ("batch_size", identity["batch_size"] + 1),
                       ("num_samples", identity["num_samples"] + 1)):
        with pytest.raises(ValueError, match=f"{key}="):
            EpochPosition(plan_of, replayable=True).load(state, {**identity, key: other}, None, partition)
    wider = Partition(partition.rank, partition.world_size + 1)
    with pytest.raises(ValueError, match="world_size="):
        EpochPosition(plan_of, replayable=True).load(state, identity, None, wider)
    if partition.world_size > 1:  # an unordered position is its own rank's
        other_rank = Partition((partition.rank + 1) % partition.world_size, partition.world_size)
        with pytest.raises(ValueError, match="ordered=False"):
            EpochPosition(plan_of, replayable=True).load(state, identity, None, other_rank)


# ---- seeds ------------------------------------------------------------------------------------

MASK64 = 2**64 - 1


def textbook_splitmix64(state: int) -> tuple[int, int]:
    """(next state, output) of splitmix64 as published (Steele, Lea and Flood 2014)."""
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


@SETTINGS
@given(st.integers(-(2**70), 2**70), st.integers(0, 8), U64, st.integers(0, 2**32), U64,
       st.lists(st.integers(0, 2**40), max_size=20))
def test_seeds_are_splitmix64_as_published(seed, count, order_seed, epoch, shard_key, indices):
    """Every image ever served depends on these numbers: any change to them shows here."""
    from remoteloader.server.seeds import sample_seeds, stream_seeds

    state, expected = seed & MASK64, []
    for _ in range(count):
        state, out = textbook_splitmix64(state)
        expected.append(out)
    assert stream_seeds(seed, count) == expected

    mixed = []
    for index in indices:  # the sample's four numbers, mixed, then two splitmix64 rounds
        x = (order_seed * 0x9E3779B97F4A7C15 & MASK64) ^ (epoch * 0xBF58476D1CE4E5B9 & MASK64)
        x = (index * 0x94D049BB133111EB & MASK64) ^ x ^ shard_key
        mixed.append(textbook_splitmix64(textbook_splitmix64(x)[1])[1])
    assert sample_seeds(order_seed, epoch, shard_key, np.asarray(indices, dtype=np.int64)) == mixed
