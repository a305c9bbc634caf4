"""RemoteLoader: the training-side iterable that wires discovery, plan, scheduling and delivery.

Where things live: options are validated in ``options.py``; the epoch position, resume and
the state_dict in ``epoch.py``; the global sample ids in ``sample_space.py`` and each
epoch's batches in ``plan.py``; the I/O side behind the ``Receiver`` contract
(``receiver.py``: ``thread_receiver.py``, or ``process_receiver.py`` with its child
``receiver_service.py``), whose ``engine.py`` schedules and fails over (where a failed
server's orders go), ``chunks.py`` checks what arrives, ``assembly.py`` puts batches
together and ``link.py`` owns each server's connection (its states, when it counts as down,
reconnect back-off); delivery to the training loop behind the ``Delivery`` contract
(``delivery.py``: ``host_delivery.py``, ``cuda_delivery.py``); what the loop saw, per epoch,
in ``throughput.py``; ``on_error`` in ``failures.py``.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import inspect
import logging
import os
import queue
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any

import numpy as np

from remoteloader.client import failures, memory_bounds
from remoteloader.client import options as options_module
from remoteloader.client import plan as plan_module
from remoteloader.client.batch_forms import user_batch
from remoteloader.client.batches import END, Batch, Item, LoaderError
from remoteloader.client.delivery import Delivered, Delivery, Output, Readable
from remoteloader.client.epoch import IDENTITY, EpochPosition, FrameworkEpochs, Pass
from remoteloader.client.io_side import open_io
from remoteloader.client.options import UINT64, LoaderOptions, check_int
from remoteloader.client.plan import EpochPlan
from remoteloader.client.ranks import Partition, Ranks
from remoteloader.client.receiver import Receiver
from remoteloader.client.sample_space import SampleSpace
from remoteloader.client.server_set import ServerSet, check_offer
from remoteloader.client.thread_receiver import describe_servers
from remoteloader.client.throughput import Throughput
from remoteloader.protos import targets as tg

log = logging.getLogger("remoteloader.client")

_OPEN: weakref.WeakSet[RemoteLoader] = weakref.WeakSet()  # closed at exit, while threads still run
_KEY_BLOCK = 1024


class RemoteLoader:
    __doc__ = options_module.docstring(
        """Batches of augmented images streamed from loader servers, as an ordinary iterable.

    Example:
        loader = RemoteLoader("127.0.0.1:50051,127.0.0.1:50052", batch_size=256, image_size=224)
        for epoch in range(10):
            loader.set_epoch(epoch)  # optional: each pass otherwise plays the next epoch
            for images, labels in loader:
                ...

    Args:
        address: Servers: ``"host:port"``, a comma-separated string or a list of them; a
            DNS name expands to every address it resolves to.
    """
    )

    def __init__(
        self,
        address: str | Iterable[str],
        **arguments: Any,  # options.py: their groups, defaults and checks (and __signature__)
    ) -> None:
        self._close_lock = threading.Lock()
        self._closed = False
        self.options = LoaderOptions.from_arguments(arguments)
        self._ranks = Ranks(self.options.batches.rank, self.options.batches.world_size)
        self._position = EpochPosition(self._plan, replayable=self.options.batches.sampler is None)
        self._counted: Partition | None = None  # the partition len() last counted batches for
        self._final_servers: dict[str, dict] = {}  # the servers' counters when it was closed
        self._final_receiver_cpu = 0.0  # and the receiver's CPU seconds
        self._throughput = Throughput(self.options.batches.batch_size, self.options.setup.pipeline)
        self._keys: dict[tuple[str, int], list[str]] = {}
        self._pid = os.getpid()  # a forked copy of this object owns no thread and no child
        _OPEN.add(self)
        try:
            wanted = self._start(address)
        except BaseException:
            self.close()
            raise
        # What each batch holds besides the images: None for (images, labels) tuples.
        self._batch_fields: tuple[str, ...] | None = (
            wanted if self.options.output.fields is not None or set(wanted) - {tg.LABEL} else None
        )
        self._warn_if_epochs_are_empty(self._ranks.current())

    def _start(self, address: str | Iterable[str]) -> tuple[str, ...]:
        """Describes each server once, checks the plan against what they said (pipeline, image
        size, wire, fields), checks the buffers fit in this machine's memory, and only then opens
        the receiver and allocates the buffers, once: a bad argument fails in milliseconds.
        Returns the fields the batches hold."""
        o = self.options
        described = describe_servers(address, o.connection, o.security)
        for server, describe in described.items():
            check_offer(o.setup, server, describe)
        # The fields asked for, or those the servers' shards carry: the streams ask for them,
        # and batch memory has room for masks when they carry some. (A server that joins
        # between this and the open with other fields does not add them.)
        wanted = self._wanted_fields(SampleSpace(described))
        if o.output.fields is None:
            self.options = o.with_fields(wanted)
        memory_bounds.check(self.options)
        self._io, self._delivery = open_io(address, self.options, described)
        self._servers = ServerSet(self._io, self.options.setup)
        return wanted

    def _wanted_fields(self, space: SampleSpace) -> tuple[str, ...]:
        """The fields asked for, or (fields=None) those the servers' shards carry; ValueError for
        fields asked for that no shard carries (a model trained on empty targets is silently wrong)."""
        wanted = space.fields if self.options.output.fields is None else self.options.output.fields
        rendered = tg.RENDERED + ((tg.FRAME_INDICES,) if self.options.clip is not None else ())
        missing = [f for f in wanted if f not in space.fields and f not in rendered]
        if missing:
            carried = "; ".join(f"{f}: {tg.CARRIED_BY.get(f, 'shards whose targets have it')}" for f in missing)
            raise ValueError(
                f"fields={list(wanted)}: none of the servers' shards carry {', '.join(missing)} (they carry "
                f"{', '.join(space.fields) or 'no targets'}). What carries them: {carried}"
            )
        if self.options.output.batch_format == "torchvision" and not {tg.BBOXES, tg.BBOX_LABELS} <= set(wanted):
            raise ValueError(
                f"batch_format='torchvision' needs the fields bboxes and bbox_labels (asked for: {list(wanted)}; "
                f"the servers' shards carry {', '.join(space.fields) or 'no targets'})"
            )
        return wanted

    def _warn_if_epochs_are_empty(self, partition: Partition) -> None:
        n = self._epoch_samples()
        if (
            n
            and plan_module.num_batches(
                n, self.options.batches.batch_size, partition.world_size, self.options.batches.drop_last
            )
            == 0
        ):
            warnings.warn(
                f"RemoteLoader: batch_size={self.options.batches.batch_size} with drop_last=True leaves no whole batch "
                f"of the {n} samples {'it serves' if self.options.batches.sampler is None else 'the sampler gives'} "
                f"for each of {partition.world_size} rank(s): every epoch is empty (pass drop_last=False or "
                f"a smaller batch_size)",
                stacklevel=4,
            )

    # ---- the public surface ------------------------------------------------------------
    @property
    def sample_space(self) -> SampleSpace:
        """The global sample space: every server's shards, numbered (``sample_space.shards``)."""
        return self._servers.space

    @property
    def catalog(self) -> SampleSpace:
        """The same as ``sample_space`` (an older name, kept for callers that use it). Not a
        server's catalog, which is its shard files' index."""
        return self.sample_space

    @property
    def num_samples(self) -> int:
        """Samples in the union of all servers' shards."""
        return self.sample_space.num_samples

    @property
    def class_names(self) -> list[str]:
        return list(self.sample_space.class_names)

    @property
    def servers(self) -> list[str]:
        return list(self._servers.addresses)

    @property
    def rank(self) -> int:
        """This process's rank: as given, else torch.distributed's now (0 before it is initialized)."""
        return self._ranks.current().rank

    @property
    def world_size(self) -> int:
        """The number of ranks: as given, else torch.distributed's now (1 before it is initialized)."""
        return self._ranks.current().world_size

    # Frameworks tell a DataLoader by its dataset and rewrite it (Lightning, Accelerate, Trainer's
    # skip_first_batches); RemoteLoader has none, and says why when asked directly.
    @property
    def dataset(self) -> Any:
        raise AttributeError(
            "RemoteLoader has no dataset: its samples live on the loader servers. To resume mid-epoch, "
            "load the state_dict() saved with the checkpoint (Accelerate: register_for_checkpointing(loader) and "
            "load_state) instead of skipping batches"
        )

    @property
    def sampler(self) -> Any:
        raise AttributeError(
            "RemoteLoader has no sampler attribute: the epoch order is its own (set_epoch, shuffle, seed); a "
            "sampler passed to it is options.sampler"
        )

    @property
    def batch_sampler(self) -> FrameworkEpochs:
        """Where a framework calls ``set_epoch`` at each epoch's start (Lightning calls
        ``batch_sampler.sampler.set_epoch``): the loader's ``set_epoch``, so that a run resumed
        from an end-of-epoch checkpoint plays the epoch the framework is at (``epoch.FrameworkEpochs``).
        Not an iterable of batches: ``plan()`` gives this rank's batches of sample ids."""
        return FrameworkEpochs(self.set_epoch)

    def __len__(self) -> int:
        """Batches per epoch for this rank (world size read now, when it was not given)."""
        n = self._epoch_samples()
        if n is None:
            raise TypeError("len(RemoteLoader) is unknown: its sampler has no __len__ (as DataLoader, len() needs one)")
        partition = self._ranks.current()
        self._counted = partition
        return plan_module.num_batches(
            n, self.options.batches.batch_size, partition.world_size, self.options.batches.drop_last
        )

    def _epoch_samples(self) -> int | None:
        """Samples an epoch plays before splitting into ranks (None: a sampler without __len__)."""
        sampler = self.options.batches.sampler
        if sampler is None:
            return self.num_samples
        return len(sampler) if isinstance(sampler, Sized) else None

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch the next pass plays, from its first batch (``client/epoch.py``).

        Without it, every pass (each ``iter()``, from its first batch) plays the epoch after the
        last one: a new order each time, as a DataLoader with shuffle=True gives. It counts when
        called before the pass's first batch (after ``iter()`` too). A loaded position of the
        same epoch is kept."""
        self._position.set_epoch(check_int("epoch", epoch, 0, UINT64))

    @property
    def epoch(self) -> int:
        """The epoch of the position: the one being played, or the one the next pass plays
        (after a pass left early, the next pass plays the one after it)."""
        return self._position.epoch

    def plan(self, epoch: int | None = None) -> Sequence[np.ndarray]:
        """This rank's batches of global sample ids for an epoch (a pure function): a sequence
        (``len``, ``[k]``, iteration) whose batches are computed as they are asked for."""
        return self._plan(self._position.epoch if epoch is None else epoch, self._ranks.current()).batches

    def _plan(self, epoch: int, partition: Partition) -> EpochPlan:
        return plan_module.make_plan(
            self.num_samples,
            self.options.batches.batch_size,
            shuffle=self.options.batches.shuffle,
            seed=self.options.batches.seed,
            epoch=epoch,
            rank=partition.rank,
            world_size=partition.world_size,
            drop_last=self.options.batches.drop_last,
            sampler=self.options.batches.sampler,
        )

    def sample_key(self, sample_id: int) -> str:
        """The sample's key on its server, e.g. ``"dog/0001.jpg"``."""
        shard, local = self.sample_space.locate(int(sample_id))
        block = local // _KEY_BLOCK
        keys = self._keys.get((shard.id, block))
        if keys is None:
            keys = self._io.get_keys(list(shard.owners), shard.id, block * _KEY_BLOCK, _KEY_BLOCK)
            self._keys[(shard.id, block)] = keys
        return keys[local % _KEY_BLOCK]

    def state_dict(self) -> dict:
        """A small JSON-serializable position: resume with load_state_dict in a fresh loader.

        ``position`` is the first plan batch not yet delivered (once an epoch's last batch is
        delivered, the next epoch's first); with ``ordered=False``, ``delivered_after`` lists the
        later batches that already were. ``plan`` is a digest of the epoch's batches on every
        rank: a loader whose plan differs (shuffle, drop_last, sampler...) refuses the state
        rather than play other batches. With ``ordered=True``, one rank's state resumes every
        rank of the same world size.
        """
        return self._position.state_dict(self._identity(), self._ranks.current())

    def load_state_dict(self, state: dict) -> None:
        """Continues at the saved position: the rest of that epoch is bitwise the same.

        Before torch.distributed is initialized, a state saved with another world size is checked
        for it, and again at the first batch, when the world size is known."""
        self._position.load(state, self._identity(), self.sample_space, self._ranks.current())

    def _identity(self) -> dict[str, Any]:
        """What a saved position is only valid for (epoch.IDENTITY), this loader's values."""
        return {key: self.num_samples if key == "num_samples" else getattr(self, key) for key in IDENTITY}

    def stats(self) -> dict:
        """Throughput, the time the loop waited for data, and per-server counters.

        Rates and the wait fraction are averages since the first batch was asked for (time
        the loader sat idle between epochs included); ``epochs`` has one entry per epoch played
        to its end (the last 100): its images, seconds, images/s, the share of it the loop
        waited for data, its likely limit (``client/bottleneck.py``), each server's workers'
        busy share over it and the receiver's (the log has the same line, and a warning once
        when that share passes ``throughput.WAIT_WARNING``, 0.2); ``receiver_cpu_s`` is the
        receiver's CPU time so far; the servers' counters (``workers_busy`` as each last said)
        are those at close() once it is closed."""
        per_server = self._final_servers if self._closed else self._io.server_stats()
        receiver_cpu = self._final_receiver_cpu if self._closed else self._io.cpu_seconds()
        return self._throughput.stats(per_server, receiver_cpu)

    # ---- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator:
        """A pass over an epoch, which starts at its first batch (``client/epoch.py`` says which
        epoch it plays: a framework that calls ``iter()`` and then ``set_epoch`` gets that epoch)."""
        if self._closed:
            raise RuntimeError("RemoteLoader is closed")
        stopped = self._io.stopped() if os.getpid() == self._pid else None  # (a forked copy: its first batch says)
        if stopped is not None:  # a loader that can no longer play says so at once
            raise LoaderError(stopped)
        return self._pass()

    def _pass(self) -> Iterator:
        played, source = self._start_pass()
        out = self._delivery.start(source)
        ended = False  # the receiver said the pass is over
        meter = self._throughput
        span = meter.span(played.epoch, self._io.server_stats(), self._io.cpu_seconds())

        def epoch_done() -> None:
            meter.epoch_done(span, self._io.server_stats(), self._io.cpu_seconds())

        try:
            while True:
                item = meter.wait_for(lambda: self._get(out, played))
                if item is END:
                    ended = True
                    if self._position.ended(played):  # an epoch with no batches for this rank
                        epoch_done()
                    break
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, (Batch, Delivered)), item
                self._io.consumed(played)
                result = self._deliver(item)
                # Only once delivered (a batch that raised is played again on resume); the last
                # batch ends the epoch, whether or not the loop asks for another.
                if self._position.delivered(played, item.seq):
                    epoch_done()
                if result is not None:
                    yield result
        finally:
            if not ended and self._io.playing is played:  # left early, and no newer pass started
                self._abandon(played)

    def _start_pass(self) -> tuple[Pass, queue.Queue[Item]]:
        """Finds the servers, reads the partition and starts the receiver on what this pass plays."""
        space = self._servers.next_epoch(self._position.resume_space())
        partition = self._ranks.current()
        counted = self._counted
        if counted is not None and counted.world_size != partition.world_size:
            self._counted = partition
            warnings.warn(
                f"len(loader) was counted for world_size={counted.world_size}, and this pass plays rank "
                f"{partition.rank} of {partition.world_size}: {len(self)} batches per epoch now (was "
                f"torch.distributed initialized after len() was read?)",
                stacklevel=3,
            )
        played = self._position.next_pass(partition, space)
        out = self._io.start_epoch(played)
        self._position.begin(played)
        return played, out

    def _get(self, out: Readable[Output], played: Pass) -> Output:
        while True:
            try:
                return out.get(timeout=1.0)
            except queue.Empty:
                if self._closed:
                    raise LoaderError("the RemoteLoader was closed (close() or its with-block ended)") from None
                stopped = self._io.stopped()
                if stopped is not None:
                    raise LoaderError(stopped) from None
                if self._io.playing is not played:
                    raise RuntimeError(
                        "this iteration was superseded: iter(loader) was called again, which starts the epoch anew"
                    ) from None

    def _abandon(self, played: Pass) -> None:
        """The consumer stopped mid-epoch: stop the work (cancel_epoch gives the buffers back)."""
        try:
            self._io.cancel_epoch(played)
        except (RuntimeError, LoaderError, TimeoutError, concurrent.futures.TimeoutError):
            # closed meanwhile, or the receiver is gone or stuck
            return
        self._delivery.close()

    def _deliver(self, item: Batch | Delivered) -> tuple | dict[str, Any] | None:
        """The batch as the training loop gets it (None: on_error left none of its rows)."""
        delivered = failures.apply(self.options.output.on_error, self._delivery.finish(item))
        if delivered is None:
            return None
        self._throughput.delivered(len(delivered.ids), delivered.nbytes)
        return user_batch(delivered, self.options, self._batch_fields)

    # ---- closing --------------------------------------------------------------------------
    def close(self) -> None:
        """Stops the receiver (thread or process) and closes the connections (idempotent)."""
        if getattr(self, "_pid", os.getpid()) != os.getpid():  # a forked copy (whose lock may be a held one)
            return
        with self._close_lock:  # two threads (a timer and the with-block's exit) close it once
            if self._closed:
                return
            self._closed = True
        self._close_io()

    def _close_io(self) -> None:
        delivery: Delivery | None = getattr(self, "_delivery", None)  # (None: closed while being made)
        if delivery is not None:
            delivery.close(final=True)
        io: Receiver | None = getattr(self, "_io", None)
        if io is not None:
            try:  # for stats() after close, as after a with-block
                self._final_servers = io.server_stats(timeout=2.0)
                self._final_receiver_cpu = io.cpu_seconds()
            except (LoaderError, RuntimeError, concurrent.futures.TimeoutError):
                pass  # its receiver is gone, stuck, or this is its own thread
            io.close()

    def __enter__(self) -> RemoteLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class _ReadBack:
    """A read-only attribute of RemoteLoader: the option of the same name (``options.read_back``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, loader: RemoteLoader | None, owner: type) -> Any:
        if loader is None:
            return self
        return options_module.read_back(loader.options, self.name)

    def __set__(self, loader: RemoteLoader, value: Any) -> None:
        raise AttributeError(f"RemoteLoader.{self.name} is fixed when it is made: make another loader")


for _name in options_module.READ_BACK:  # (the options declared read_back=True)
    setattr(RemoteLoader, _name, _ReadBack())
    RemoteLoader.__dict__[_name].__set_name__(RemoteLoader, _name)
RemoteLoader.__init__.__signature__ = options_module.signature(  # type: ignore[attr-defined]
    inspect.Parameter("address", inspect.Parameter.POSITIONAL_OR_KEYWORD)
)


@atexit.register
def _close_open_loaders() -> None:
    """Loaders the script did not close: at interpreter shutdown their I/O threads stop
    answering, and each close() would wait out its timeouts (seconds per loader)."""
    for loader in list(_OPEN):
        try:
            loader.close()
        except Exception:
            pass
