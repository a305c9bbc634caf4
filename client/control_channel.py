"""A loader server's control channel, as a client's link uses it: Describe (every page) and GetKeys.

At start a refused connection (nothing listens there, or not yet: a server still starting)
is logged at once and tried again until connect_timeout; while reconnecting it is an error
at once, so the link backs off. Each failure says what the server answered, or that it did
not, naming its address.
"""

from __future__ import annotations

import logging
import time

import grpc

from remoteloader.client.option_groups import ConnectionOptions, SecurityOptions
from remoteloader.client.security import TLSConfig
from remoteloader.protos import limits, loader_pb2, loader_pb2_grpc

log = logging.getLogger("remoteloader.client")
CONTROL_RECEIVE = 16 * limits.MiB  # the largest Describe page


def channel_options(max_receive: int) -> list[tuple[str, str | int]]:
    return [
        ("grpc.max_receive_message_length", max_receive),
        ("grpc.max_send_message_length", limits.MAX_ORDER_MESSAGE_BYTES),  # orders (and Setups) are what it sends
        # Notice a dead peer within seconds, not at the next TCP timeout. (Adding
        # keepalive_permit_without_calls with max_pings_without_data=0 made the server
        # spend 4x the CPU per GB and halved throughput: measured, leave them out.)
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


def open_channel(address: str, tls: TLSConfig | None, max_receive: int) -> grpc.aio.Channel:
    """A channel to ``address`` (TLS when ``tls``) that takes messages up to ``max_receive`` bytes."""
    options = channel_options(max_receive)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(address, tls.credentials(), options=options)


class ControlChannel:
    """One server's control channel, opened when first used (a link that adopted its Describe
    opens it only for GetKeys)."""

    def __init__(self, address: str, connection: ConnectionOptions, security: SecurityOptions):
        self.address = address
        self.connection = connection
        self.security = security
        self._channel: grpc.aio.Channel | None = None

    def _open(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = open_channel(self.address, self.security.tls, CONTROL_RECEIVE)
        return self._channel

    async def describe(
        self, timeout: float, refused: bool = False, starting: bool = False
    ) -> loader_pb2.DescribeResponse:
        """Connects the channel and asks what the server holds, every page (bounded in time).
        ``refused``: a refused connection is an error at once (a reconnect backs off and tries
        again); ``starting``: it is logged at once (nothing listens there, or not yet: a server
        still starting) and tried again until the timeout, then raised naming the address."""
        stub = loader_pb2_grpc.LoaderStub(self._open())
        request, metadata = loader_pb2.DescribeRequest(), self.security.metadata
        started, was_refused = time.monotonic(), False
        try:
            try:
                describe = await self._describe_now(stub, request, timeout) if refused or starting else None
            except ConnectionRefusedError:
                if not starting:
                    raise ConnectionError(
                        f"loader server {self.address} refused the connection: nothing listens there "
                        f"(is the server running, and on this port?)"
                    ) from None
                was_refused = True
                log.warning("%s refused the connection; retrying for up to connect_timeout=%gs", self.address, timeout)
                describe = None
            if describe is None:  # wait for the server to come up, until the timeout
                left = max(0.0, timeout - (time.monotonic() - started))
                describe = await stub.Describe(request, timeout=left, wait_for_ready=True, metadata=metadata)
            await self._rest_of(stub, describe, timeout)
        except grpc.aio.AioRpcError as exc:
            if was_refused and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise ConnectionError(
                    f"loader server {self.address} refused the connection: nothing listens there (is the server "
                    f"running, and on this port?); tried again for connect_timeout={timeout:g}s"
                ) from None
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                hint = " (RemoteLoader(token=...) sends it)" if exc.code() == grpc.StatusCode.UNAUTHENTICATED else ""
                raise PermissionError(
                    f"loader server {self.address} refused this client: {exc.code().name}: {exc.details()}{hint}"
                ) from None
            if exc.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT):
                raise ConnectionError(  # it answered: say what it answered, not that it is unreachable
                    f"loader server {self.address} answered Describe with {exc.code().name}: {exc.details()} "
                    f"(a server of another remoteloader version?)"
                ) from None
            raise ConnectionError(
                f"loader server {self.address} did not answer within {timeout:g}s "
                f"(down, unreachable, or a TLS/plaintext mismatch): {exc.code().name}: "
                f"{exc.details()}"
            ) from None
        return describe

    async def _rest_of(
        self, stub: loader_pb2_grpc.LoaderStub, describe: loader_pb2.DescribeResponse, timeout: float
    ) -> None:
        """Adds the server's further pages of shards (and their class lists) to its first page."""
        if describe.shards and not describe.num_shards:  # (every server since 0.2 says how many)
            raise ConnectionError(
                f"loader server {self.address} runs remoteloader {describe.version or 'older than 0.2'}, whose "
                f"Describe and orders this client no longer speaks: run the servers and clients of one version"
            )
        while len(describe.shards) < describe.num_shards:
            request = loader_pb2.DescribeRequest(shard_start=len(describe.shards))
            page = await stub.Describe(request, timeout=timeout, metadata=self.security.metadata)
            if page.shard_start != len(describe.shards) or page.class_list_start != len(describe.class_lists):
                raise ConnectionError(
                    f"loader server {self.address} sent Describe page {page.shard_start} "
                    f"(class lists from {page.class_list_start}) for {len(describe.shards)} "
                    f"({len(describe.class_lists)}): its shards changed while it was described?"
                )
            if not page.shards:
                raise ConnectionError(f"loader server {self.address} sent an empty Describe page at {page.shard_start}")
            describe.shards.extend(page.shards)
            describe.class_lists.extend(page.class_lists)

    async def _describe_now(
        self, stub: loader_pb2_grpc.LoaderStub, request: loader_pb2.DescribeRequest, timeout: float
    ) -> loader_pb2.DescribeResponse | None:
        """One Describe without waiting for the channel: the answer; ConnectionRefusedError when
        the connection is refused; None when the server is not reachable yet for another reason."""
        try:
            return await stub.Describe(request, timeout=timeout, wait_for_ready=False, metadata=self.security.metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            if "refused" in (exc.details() or "").lower():
                raise ConnectionRefusedError(f"loader server {self.address} refused the connection") from None
            return None

    async def get_keys(self, shard_id: str, start: int, count: int) -> list[str]:
        stub = loader_pb2_grpc.LoaderStub(self._open())
        reply = await stub.GetKeys(
            loader_pb2.GetKeysRequest(shard_id=shard_id, start=start, count=count),
            timeout=self.connection.connect_timeout,
            metadata=self.security.metadata,
        )
        return list(reply.keys)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(grace=None)
        self._channel = None
