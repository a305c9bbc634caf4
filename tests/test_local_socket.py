"""Same-host shared memory, server side: the arena's generation words, the local socket that
hands out its descriptor, and streams whose chunks stay in the arena (Setup.shared_memory).

Servers for the module (--max-image-size 64; 32x32 samples, 5 a chunk in messages with
--chunk-bytes 16384, 4 a chunk in shared memory with --shared-chunk-bytes 12288):
    TOKEN  --token-file --slots 4 (a lone stream holds 2) --stall-timeout 3
    OPEN   no token: any local process may map the chunks
    OFF    --local-socket false
"""

from __future__ import annotations

import asyncio
import mmap
import os
import queue
import signal
import socket
import time

import grpc
import pytest

from remoteloader.protos import codec, loader_pb2
from remoteloader.tools.textures import make_imagefolder

pytestmark = pytest.mark.timeout(120)

STREAM = "/remoteloader.v1.Loader/Stream"
TOKEN = "local-s3cret-0123456789-abcdef"
SIZE = 32
PER_CHUNK = 16384 // (SIZE * SIZE * 3)  # samples a chunk of a stream through gRPC
PER_SHARED_CHUNK = 12288 // (SIZE * SIZE * 3)  # and of a stream through shared memory
N = 12  # samples in the shard
TOKEN_SERVER, OPEN, OFF = 0, 1, 2
SERVER_ARGS = ("--max-image-size", "64", "--chunk-bytes", "16384", "--shared-chunk-bytes", "12288")


@pytest.fixture(scope="module")
def servers(module_cluster, tmp_path_factory):
    base = tmp_path_factory.mktemp("local")
    data = make_imagefolder(base / "data", ["a", "b"], N // 2, size=(48, 64), seed=3)
    token_file = base / "token"
    token_file.write_text(TOKEN + "\n")
    c = module_cluster
    c.add(data, *SERVER_ARGS, "--token-file", str(token_file), "--slots", "4", "--stall-timeout", "3", wait=False)
    c.add(data, *SERVER_ARGS, wait=False)
    c.add(data, *SERVER_ARGS, "--local-socket", "false", wait=False)
    for i in (TOKEN_SERVER, OPEN, OFF):
        c.wait_ready(i)
    return c


def _metadata(i: int):
    return [("authorization", f"Bearer {TOKEN}")] if i == TOKEN_SERVER else None


def _describe(servers, i: int) -> loader_pb2.DescribeResponse:
    with grpc.insecure_channel(servers.address(i)) as channel:
        describe = channel.unary_unary(
            "/remoteloader.v1.Loader/Describe", response_deserializer=loader_pb2.DescribeResponse.FromString
        )
        return describe(b"", timeout=10, metadata=_metadata(i))


def _handshake(address: str, line: bytes) -> tuple[bytes, list[int]]:
    """The local socket's answer to ``line`` (its descriptors, if any)."""
    assert address.startswith("@")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect("\0" + address[1:])
        s.sendall(line)
        message, fds, _flags, _addr = socket.recv_fds(s, 256, 4)
        assert s.recv(16) == b"", "the server closes the connection after its answer"
    return message, fds


def _map(servers, i: int, token: str = TOKEN) -> mmap.mmap:
    """The server's chunk memory, mapped read-only as a client maps it."""
    message, fds = _handshake(_describe(servers, i).local_socket, token.encode() + b"\n")
    assert message.startswith(b"ok ") and message.endswith(b"\n") and len(fds) == 1, message
    size = int(message[3:])
    try:
        assert os.fstat(fds[0]).st_size == size
        return mmap.mmap(fds[0], size, prot=mmap.PROT_READ)
    finally:
        os.close(fds[0])


def _generation(memory: mmap.mmap, offset: int) -> int:
    return int.from_bytes(memory[offset : offset + 8], "little")


class Stream:
    """A raw Stream call: requests in through a queue, (header, pixels) out of ``call``."""

    _END = object()

    def __init__(self, servers, i: int, setup: loader_pb2.Setup, timeout: float = 60):
        self.requests: queue.Queue = queue.Queue()
        self.requests.put(loader_pb2.StreamRequest(setup=setup))
        self.channel = grpc.insecure_channel(servers.address(i))
        method = self.channel.stream_stream(
            STREAM,
            request_serializer=loader_pb2.StreamRequest.SerializeToString,
            response_deserializer=codec.decode_chunk,
        )
        self.call = method(self._iterate(), timeout=timeout, metadata=_metadata(i))

    def _iterate(self):
        while (item := self.requests.get()) is not self._END:
            yield item

    def order(self, order_id: int, shard_id: str, indices, seed: int = 7) -> None:
        self.requests.put(
            loader_pb2.StreamRequest(
                order=loader_pb2.Order(order_id=order_id, shard_ids=[shard_id], indices=list(indices), seed=seed)
            )
        )

    def release(self, *tickets: int) -> None:
        self.requests.put(loader_pb2.StreamRequest(release=loader_pb2.Release(tickets=list(tickets))))

    def close(self) -> None:
        self.requests.put(self._END)
        self.call.cancel()
        self.channel.close()


def _setup(shared: bool, wire: str = "", exclusive: bool = False) -> loader_pb2.Setup:
    """``exclusive``: the stream shares no rendering (server/sharing.py), so every chunk is a new
    rendering and a slot it gives back goes back to the arena, its generation changed, rather
    than being kept unchanged for a later stream that asks for the same chunk."""
    return loader_pb2.Setup(
        pipeline="train", height=SIZE, width=SIZE, shared_memory=shared, wire=wire, exclusive=exclusive
    )


def _error(call, chunks: int = -1) -> grpc.RpcError:
    """How ``call`` ends (an error), after ``chunks`` more chunks when that is not -1."""
    got = 0
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            got += 1
    assert chunks in (-1, got), f"{got} chunks came before the error, not {chunks}"
    return info.value


def _eventually(condition, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ---- the arena ------------------------------------------------------------------------------
def test_a_slot_generation_changes_when_it_is_given_back():
    from remoteloader.server.shared_memory import Arena

    async def run() -> None:
        arena = Arena(3, 1001)  # slots that end off an 8-byte boundary
        try:
            assert arena.slots_size == 3003 and arena.size >= 3003 + 3 * 8
            offsets = [arena.generation_offset(s) for s in range(3)]
            assert offsets[0] % 8 == 0 and offsets[0] >= arena.slots_size
            assert offsets == list(range(offsets[0], offsets[0] + 24, 8))
            assert [arena.generation(s) for s in range(3)] == [0, 0, 0]
            slot = await arena.acquire()
            arena.view(slot, arena.slot_bytes)[:] = b"\xff" * arena.slot_bytes  # a full slot leaves them be
            assert arena.generation(slot) == 0
            arena.release(slot)
            assert arena.generation(slot) == 1
            word = bytes(arena.buffer[offsets[slot] : offsets[slot] + 8])
            assert int.from_bytes(word, "little") == 1  # in the file, where a client reads it
            assert [arena.generation(s) for s in range(3) if s != slot] == [0, 0]
        finally:
            arena.close()

    asyncio.run(run())


# ---- the local socket -----------------------------------------------------------------------
def test_describe_offers_the_local_socket_on_this_host(servers):
    boot_id = open("/proc/sys/kernel/random/boot_id").read().strip()
    for i in (TOKEN_SERVER, OPEN):
        reply = _describe(servers, i)
        assert reply.local_socket.startswith("@remoteloader-") and len(reply.local_socket) == len("@remoteloader-") + 16
        assert reply.host_id == boot_id
    assert _describe(servers, TOKEN_SERVER).local_socket != _describe(servers, OPEN).local_socket
    off = _describe(servers, OFF)
    assert off.local_socket == "" and off.host_id == ""
    assert "local socket @remoteloader-" in servers.stderr(TOKEN_SERVER)


def test_the_local_socket_hands_a_read_only_descriptor_for_the_token_only(servers):
    memory = _map(servers, TOKEN_SERVER)
    try:
        assert len(memory) > 4 * (16384 + 8)  # the slots, then their generation words
    finally:
        memory.close()
    address = _describe(servers, TOKEN_SERVER).local_socket
    for line in (b"\n", b"wrong-token-0123456789\n", TOKEN.encode()[:-1] + b"\n", TOKEN.encode() + b"x\n"):
        assert _handshake(address, line) == (b"refused\n", []), line
    try:  # a line over 4096 bytes: refused (the server leaves the rest unread: maybe a reset)
        assert _handshake(address, TOKEN.encode() * 200 + b"\n") == (b"refused\n", [])
    except ConnectionResetError:
        pass
    # Without a token, any local process may map it; but never write into it.
    message, fds = _handshake(_describe(servers, OPEN).local_socket, b"\n")
    assert message.startswith(b"ok ") and len(fds) == 1
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fds[0], int(message[3:]))  # read and write
        with pytest.raises(OSError):
            os.write(fds[0], b"x")
    finally:
        os.close(fds[0])


def test_a_silent_connection_is_closed_and_others_are_still_served(servers):
    address = _describe(servers, OPEN).local_socket
    silent = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(20)]  # more than MAX_HANDSHAKES
    try:
        for s in silent:
            s.connect("\0" + address[1:])
        started = time.monotonic()
        silent[0].settimeout(15)
        assert silent[0].recv(64) == b"refused\n"  # after the 5 s timeout
        assert 3 < time.monotonic() - started < 12
        message, fds = _handshake(address, b"\n")
        assert message.startswith(b"ok ") and len(fds) == 1
        os.close(fds[0])
    finally:
        for s in silent:
            s.close()


# ---- shared streams -------------------------------------------------------------------------
def test_a_shared_stream_points_at_exactly_the_pixels_a_normal_stream_sends(servers):
    shard_id = _describe(servers, OPEN).shards[0].id
    indices = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    plain = Stream(servers, OPEN, _setup(False))
    try:
        plain.order(1, shard_id, indices)
        expected = {}
        for header, pixels in plain.call:
            assert not header.HasField("shared")
            expected[header.start] = bytes(pixels)
            if sum(len(p) for p in expected.values()) == len(indices) * SIZE * SIZE * 3:
                break
    finally:
        plain.close()
    memory = _map(servers, OPEN)
    shared = Stream(servers, OPEN, _setup(True))
    try:
        shared.order(1, shard_id, indices)
        got, tickets = {}, set()
        for header, pixels in shared.call:
            s = header.shared
            assert len(pixels) == 0 and header.HasField("shared")
            assert s.length == header.count * SIZE * SIZE * 3 and s.offset + s.length <= len(memory)
            assert s.generation_offset >= s.offset + s.length or s.generation_offset + 8 <= s.offset
            assert _generation(memory, s.generation_offset) == s.generation
            got[header.start] = memory[s.offset : s.offset + s.length]
            assert _generation(memory, s.generation_offset) == s.generation  # the copy is whole
            assert s.ticket not in tickets
            tickets.add(s.ticket)
            shared.release(s.ticket)
            if header.start + header.count == header.order_size:
                break
        # The same pixels, in chunks of --shared-chunk-bytes rather than --chunk-bytes.
        assert b"".join(got[k] for k in sorted(got)) == b"".join(expected[k] for k in sorted(expected))
        assert sorted(got) == list(range(0, len(indices), PER_SHARED_CHUNK))
        assert sorted(expected) == list(range(0, len(indices), PER_CHUNK))
    finally:
        shared.close()
        memory.close()


def test_released_slots_let_a_long_order_through_a_few_slots(servers):
    shard_id = _describe(servers, TOKEN_SERVER).shards[0].id
    memory = _map(servers, TOKEN_SERVER)
    stream = Stream(servers, TOKEN_SERVER, _setup(True, exclusive=True))
    try:
        indices = [i % N for i in range(200)]  # 50 chunks through a stream's 2 slots
        stream.order(1, shard_id, indices)
        received, uses, previous = 0, {}, None
        for header, _pixels in stream.call:
            s = header.shared
            uses.setdefault(s.offset, []).append(s.generation)
            assert _generation(memory, s.generation_offset) == s.generation
            if previous is not None:  # the client holds two at a time: all the stream may hold
                stream.release(previous)
            previous = s.ticket
            received += header.count
            if received == len(indices):
                break
        assert received == len(indices) and len(uses) <= 4
        # Each use of a slot has a generation of its own.
        assert all(gens == sorted(set(gens)) for gens in uses.values()), uses
        assert sum(len(gens) for gens in uses.values()) == len(indices) // PER_SHARED_CHUNK
    finally:
        stream.close()
        memory.close()


def test_a_client_that_keeps_its_shared_chunks_is_ended_after_stall_timeout(servers):
    shard_id = _describe(servers, TOKEN_SERVER).shards[0].id
    memory = _map(servers, TOKEN_SERVER)
    stream = Stream(servers, TOKEN_SERVER, _setup(True, exclusive=True))
    try:
        stream.order(1, shard_id, range(N))  # 3 chunks: 2 lent, the third waits for a slot
        started = time.monotonic()
        held = [next(stream.call)[0].shared for _ in range(2)]
        error = _error(stream.call, 0)  # (the third waited for a slot: a stream's share is 2)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
        assert "released no shared chunk for stall_timeout=3s" in error.details(), error.details()
        assert time.monotonic() - started < 15
        # The stream gave its slots back (as it ends, just after its status): their generations
        # changed, so a late copy is known torn.
        assert _eventually(lambda: all(_generation(memory, s.generation_offset) != s.generation for s in held))
    finally:
        stream.close()
        memory.close()
    # The server serves on with the slots back.
    again = Stream(servers, TOKEN_SERVER, _setup(True))
    try:
        again.order(1, shard_id, range(N))
        received = 0
        for header, _ in again.call:
            again.release(header.shared.ticket)
            received += header.count
            if received == N:
                break
        assert received == N
    finally:
        again.close()


def test_a_cancelled_order_keeps_its_lent_slots_until_they_are_released(servers):
    shard_id = _describe(servers, OPEN).shards[0].id
    memory = _map(servers, OPEN)
    stream = Stream(servers, OPEN, _setup(True, exclusive=True))
    try:
        stream.order(1, shard_id, range(N))
        first = next(stream.call)[0].shared
        stream.requests.put(loader_pb2.StreamRequest(cancel=loader_pb2.Cancel(order_id=1)))
        stream.order(2, shard_id, [0])  # the stream goes on
        for header, _ in stream.call:
            if header.order_id == 2:
                break
        assert _generation(memory, first.generation_offset) == first.generation  # still lent
        stream.release(first.ticket)
        assert _eventually(lambda: _generation(memory, first.generation_offset) != first.generation)
    finally:
        stream.close()
        memory.close()


@pytest.mark.parametrize(
    "case",
    ["unknown ticket", "twice", "not shared", "zstd", "off"],
)
def test_bad_shared_requests_are_refused(servers, case):
    server = OFF if case == "off" else OPEN
    shard_id = _describe(servers, server).shards[0].id
    stream = Stream(servers, server, _setup(case != "not shared", "zstd" if case == "zstd" else ""))
    try:
        if case in ("unknown ticket", "not shared"):
            stream.release(12345)
        elif case == "twice":
            stream.order(1, shard_id, [0])
            ticket = next(stream.call)[0].shared.ticket
            stream.release(ticket, ticket)
        error = _error(stream.call)
    finally:
        stream.close()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    details = error.details()
    expected = {
        "unknown ticket": "Release of ticket 12345, which this stream does not hold",
        "twice": "which this stream does not hold (never sent, or released already)",
        "not shared": "Release on a stream whose Setup did not ask for shared_memory",
        "zstd": "wire='zstd' with shared_memory",
        "off": "this server offers no local socket",
    }[case]
    assert expected in details, details



def test_a_bad_release_ends_the_stream_at_once_even_while_its_chunks_wait_for_slots(servers):
    shard_id = _describe(servers, TOKEN_SERVER).shards[0].id
    stream = Stream(servers, TOKEN_SERVER, _setup(True))
    try:
        stream.order(1, shard_id, range(N))  # 3 chunks: 2 lent, the third waits for a slot
        held = [next(stream.call)[0].shared.ticket for _ in range(2)]
        started = time.monotonic()
        stream.release(max(held) + 1)  # not sent yet
        error = _error(stream.call, 0)
    finally:
        stream.close()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert f"ticket {max(held) + 1}, which this stream does not hold" in error.details()
    assert time.monotonic() - started < 2.5  # (not the 3 s stall)


def test_a_draining_server_reads_the_releases_of_its_shared_streams(cluster, tmp_path):
    data = make_imagefolder(tmp_path / "drain", ["a"], N, size=(48, 64), seed=4)
    index = cluster.add(data, *SERVER_ARGS, "--slots", "4", "--grace", "20")
    shard_id = _describe(cluster, index).shards[0].id
    memory = _map(cluster, index)
    stream = Stream(cluster, index, _setup(True))
    try:
        stream.order(1, shard_id, range(N))  # 3 chunks: 2 lent, the third waits for a slot
        held = [next(stream.call)[0].shared.ticket for _ in range(2)]
        cluster.servers[index].process.signal(signal.SIGTERM)
        cluster.wait_for_log(index, "draining", 10)
        time.sleep(0.5)
        stream.release(*held)  # the drain goes on reading them: the third chunk comes
        header = next(stream.call)[0]
        assert header.start + header.count == N
        time.sleep(0.5)  # the stream waits for its last Release before it ends
        assert _generation(memory, header.shared.generation_offset) == header.shared.generation
        stream.release(header.shared.ticket)
        error = _error(stream.call, 0)
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "draining" in error.details(), error
    finally:
        stream.close()
        memory.close()
    assert cluster.stop(index) == 0
