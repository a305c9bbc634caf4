"""A loader's I/O side, as its options ask for it: the receiver (``receiver="thread"`` or
``"process"``) and the delivery (host or CUDA), opened together once the servers are described
and the plan checked (``RemoteLoader._start``), and only then: this is where batch memory is
allocated.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from remoteloader.client.cuda_delivery import CudaDelivery
from remoteloader.client.delivery import Delivery
from remoteloader.client.host_delivery import HostDelivery
from remoteloader.client.options import LoaderOptions, ReceiverKind
from remoteloader.client.process_receiver import ProcessReceiver
from remoteloader.client.receiver import Receiver
from remoteloader.client.thread_receiver import ThreadReceiver
from remoteloader.protos import loader_pb2


def open_io(
    address: str | Iterable[str], o: LoaderOptions, described: Mapping[str, loader_pb2.DescribeResponse]
) -> tuple[Receiver, Delivery]:
    """The receiver (its links starting from ``described``, what the servers said at start) and
    the delivery ``o`` asks for; either is closed again if the other fails."""
    out, b = o.output, o.batches
    links = (o.connection, o.security)
    process: ProcessReceiver | None = None
    delivery: Delivery | None = None
    try:
        if out.receiver == ReceiverKind.PROCESS:
            # Batches arrive in its shared slots; the delivery copies them out (to the GPU
            # on CUDA) and gives the slots back.
            process = ProcessReceiver(
                address, o.setup, o.batch_buffers, o.batch_bytes, o.flow, *links, b.seed, described
            )
        if out.device.type == "cuda":
            delivery = CudaDelivery(
                out.device,
                out.normalize,
                out.dtype,
                o.batch_bytes,
                o.batch_buffers,
                receiver=process,
            )
        else:
            delivery = HostDelivery(
                out.normalize,
                out.dtype,
                o.batch_buffers,
                receiver=process,
                batch=(b.batch_size, *o.sample_size),
            )
        if process is not None:
            return process, delivery
        return ThreadReceiver(address, o.setup, delivery, o.flow, *links, b.seed, described), delivery
    except BaseException:
        if delivery is not None:
            delivery.close(final=True)
        if process is not None:
            process.close()
        raise
