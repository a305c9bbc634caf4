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
import logging
import os
import queue
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from typing import Any

import numpy as np
import torch

from remoteloader.client import failures
from remoteloader.client import plan as plan_module
from remoteloader.client.batch_forms import user_batch
from remoteloader.client.batches import END, Batch, Item, LoaderError, SampleFailure
from remoteloader.client.cuda_delivery import CudaDelivery
from remoteloader.client.delivery import Delivered, Delivery, Output, Readable
from remoteloader.client.engine import EngineOptions
from remoteloader.client.epoch import IDENTITY, EpochPosition, FrameworkEpochs, Pass
from remoteloader.client.host_delivery import HostDelivery
from remoteloader.client.link import LinkOptions
from remoteloader.client.options import UINT64, LoaderOptions, Option, check_int
from remoteloader.client.plan import EpochPlan
from remoteloader.client.process_receiver import ProcessReceiver
from remoteloader.client.ranks import Partition, Ranks
from remoteloader.client.receiver import Receiver
from remoteloader.client.sample_space import SampleSpace
from remoteloader.client.security import TLSConfig
from remoteloader.client.server_set import ServerSet
from remoteloader.client.thread_receiver import ThreadReceiver, describe_servers
from remoteloader.client.throughput import Throughput
from remoteloader.protos import targets as tg
from remoteloader.protos.wire import RAW

log = logging.getLogger("remoteloader.client")

_OPEN: weakref.WeakSet[RemoteLoader] = weakref.WeakSet()  # closed at exit, while threads still run
_KEY_BLOCK = 1024


class RemoteLoader:
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
    Batches:
        batch_size: Samples per batch (default 256).
        image_size: Output size, an int or (height, width) (default 224).
        pipeline: ``"train"`` (random resized crop + flip), ``"eval"`` (resize + center
            crop), ``"detection-train"``, ``"detection-eval"``, ``"segmentation-train"``,
            ``"segmentation-eval"`` (docs/targets.md), or an albumentations pipeline
            (``A.Compose``, or its ``A.to_dict``), which the servers must allow (default "train").
        shuffle: Shuffle the union of all servers' samples every epoch (default True).
        seed: Seeds the shuffle and every sample's augmentation (default 0).
        drop_last: Drop the last incomplete batch (default True).
        sampler: An iterable of global sample ids replacing shuffle (e.g. weighted); its
            ``set_epoch`` is called if it has one (default None). It is ``options.sampler``:
            the loader has no ``sampler`` attribute, so that frameworks do not take it for a
            DataLoader.
        rank / world_size: This process's part of each epoch; default to torch.distributed's,
            read at ``len()`` and at each pass's first batch (a loader made before
            ``init_process_group`` is right), else 0 / 1. Every rank gets the same number of batches.
    Output:
        device: ``"cpu"`` or ``"cuda[:i]"`` (default "cpu").
        normalize: (mean, std) per channel on the 0..1 scale; when given, images come out as
            ``dtype`` NCHW (channels_last memory) normalized; otherwise uint8 NHWC.
        dtype: Floating dtype of normalized images (default torch.float32).
        return_ids: Yield (images, labels, ids) with the global sample ids (default False); with
            dict batches, the dict holds "ids".
        fields: The target fields to receive (docs/targets.md): e.g. ``["bboxes", "bbox_labels"]``.
            Default None: every field the servers' shards carry. When that is more than the class
            ``label`` (or fields is given), each batch is a dict of "images" and those fields:
            "label" a tensor, "mask" uint8 [B, H, W] (zeros for a sample without one), each other
            field a list of per-sample tensors (empty, or None for an extra array, where a sample
            has none), all on ``device``; otherwise batches are (images, labels) tuples as for
            classification.
            (With None, the loader asks the servers what they carry before it opens its
            streams: one more Describe per server at start; naming the fields saves that.) A
            field that no server's shards carry is an error naming what carries it (e.g. COCO
            servers' ``--coco-masks``), except ``orig_size`` and ``to_orig``, which every
            server computes.
        batch_format: None (default): batches as above; ``"torchvision"``: (images, targets) as
            torchvision's detection models and references take them: ``images`` a list of float
            [3, H, W] tensors on the 0..1 scale (or normalized, with ``normalize``), ``targets``
            a list of dicts with "boxes", "labels", "image_id", "area", "iscrowd", "masks"
            (with that field) and the other fields asked for (docs/targets.md, "Detection with torchvision").
        ordered: Yield batches in plan order (reproducible, default True) or as they complete.
        on_error: What to do with samples a server could not decode: "raise" (default),
            "warn" or "skip" (the batch comes without them), or a callable taking a list of
            SampleFailure that returns nothing (then the batch is kept as is, zeros in place).
    Flow control:
        prefetch: Batches requested ahead of the training loop (default 8: with uneven servers
            and ordered delivery, 4 left 10% of their capacity unused). Host memory is about
            (prefetch + 2) x batch bytes (pinned on CUDA); with ``normalize`` on the CPU, add
            the normalized batches you hold and up to two spare ones.
        max_inflight: Orders outstanding per server (default 4); server-side memory for the
            stream is about max_inflight x order bytes.
        connect_timeout: Seconds to wait for each server at start (default 10).
        reconnect_timeout: Seconds a failed server may take to come back before its
            unserved samples raise an error, when no other server holds its shards (default 60).
        progress_timeout: Seconds a server may hold orders without sending anything before it
            is treated as failed and its orders go elsewhere (default 60); one that still does so
            after reconnect_timeout is given up, with an error naming it.
        receiver: Where the batches are received: ``"process"``, a child process that writes
            them into shared memory (pinned on CUDA), so the training process spends almost
            no CPU and none of its GIL on input, or ``"thread"``, an I/O thread of this
            process (no child; one copy less on the CPU). Default: "process" on CUDA,
            "thread" on the CPU. With "process", (prefetch + 2) batch slots of shared memory
            replace the host buffers above.
        wire: How the pixels travel (docs/operator-guide.md, "Wire choices"): ``"raw"`` (default), ``"zstd"``
            (lossless, about 1.2x fewer bytes on photos, masks far fewer) or ``"jpeg95"`` (LOSSY:
            JPEG quality 95, about 4x fewer bytes; masks, labels and targets stay exact). The
            servers encode, this process (or its receiver process) decodes, at some CPU per
            image: worth it only where the link is the limit. Needs ``pip install
            'remoteloader[wire]'`` and servers that offer it.
        shared_memory: Servers on this host hand over their chunk memory, and batches are
            copied from where their decode workers wrote them instead of through gRPC
            (docs/operator-guide.md, "Same host"); found out per server, by its host id and a Unix socket only
            local processes can open; servers elsewhere are read over gRPC. Default True;
            False reads every server over gRPC. Only with ``wire="raw"``.
    Jobs sharing a fleet (docs/user-guide.md, "Several jobs on one fleet"):
        job: The training job this loader feeds, as the servers' operator names it in their
            ``--job-weights`` (its share of their decode workers) and as their metrics count
            it: letters, digits, ``.``, ``_``, ``-``, at most 64. Default None: each stream
            is a job of its own. A job the operator did not list weighs 1 a stream, named
            or not. Give every rank of a job the same name.
        share: Default True: where another loader asks a server for the very same chunk (same
            pipeline, size, fields, wire, seed, epoch and samples: the jobs of a sweep that
            differ only in the model), the server decodes it once for both; the batches are
            the same bit for bit, each loader still gets every sample once, and
            ``stats()["images_shared"]`` counts those that came from a decode another stream
            started. False: this loader's samples are decoded for it alone.
    Video (docs/video.md; servers that serve videos):
        clip_frames: Frames per clip, T (default None: images). Each sample is then a video's clip:
            batches are dicts with "video" uint8 [B, T, H, W, C] (``image_size`` is a frame's),
            with ``normalize`` ``dtype`` [B, C, T, H, W], "label", and "ids" with ``return_ids``.
            ``pipeline`` "train" and "eval" become "video-train" (one random clip per video per
            epoch, random resized crop + flip drawn once per clip) and "video-eval" (the centre clip,
            resized and centre-cropped as "eval").
        frame_stride: Source frames between a clip's frames, S (default 1).
        clips_per_video: Clips per video, K (default 1): "video-eval" spreads them uniformly,
            "video-train" draws each; with K > 1 "video" has a K axis after B.
        video_layout: Normalized clips as ``"BCTHW"`` (default) or ``"BTCHW"``.
    Security:
        tls: Path of the CA PEM that signed the servers' certificates, or a TLSConfig (with a
            client certificate for mutual TLS); default None: plaintext.
        token: Bearer token the servers expect (their --token-file); default None.
    """

    # The validated arguments, read-only (options.LoaderOptions holds them).
    batch_size: Option[int] = Option()
    image_size: Option[tuple[int, int]] = Option()
    shuffle: Option[bool] = Option()
    seed: Option[int] = Option()
    drop_last: Option[bool] = Option()
    device: Option[torch.device] = Option()
    normalize: Option[tuple[list[float], list[float]] | None] = Option()
    dtype: Option[torch.dtype] = Option()
    return_ids: Option[bool] = Option()
    fields: Option[tuple[str, ...] | None] = Option()
    batch_format: Option[str | None] = Option()
    ordered: Option[bool] = Option()
    on_error: Option[str | Callable[[list[SampleFailure]], None]] = Option()
    prefetch: Option[int] = Option()
    receiver: Option[str] = Option()
    wire: Option[str] = Option()
    shared_memory: Option[bool] = Option()
    job: Option[str | None] = Option()
    share: Option[bool] = Option()

    def __init__(
        self,
        address: str | Iterable[str],
        *,
        batch_size: int = 256,
        image_size: int | Sequence[int] = 224,
        pipeline: Any = "train",
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        sampler: Iterable[int] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        device: str | torch.device = "cpu",
        normalize: tuple[Sequence[float], Sequence[float]] | None = None,
        dtype: torch.dtype = torch.float32,
        return_ids: bool = False,
        fields: Sequence[str] | None = None,
        batch_format: str | None = None,
        ordered: bool = True,
        on_error: str | Callable[[list[SampleFailure]], None] = "raise",
        prefetch: int = 8,
        max_inflight: int = 4,
        connect_timeout: float = 10.0,
        reconnect_timeout: float = 60.0,
        progress_timeout: float = 60.0,
        tls: str | TLSConfig | None = None,
        token: str | None = None,
        receiver: str | None = None,
        wire: str = "raw",
        shared_memory: bool = True,
        job: str | None = None,
        share: bool = True,
        clip_frames: int | None = None,
        frame_stride: int = 1,
        clips_per_video: int = 1,
        video_layout: str = "BCTHW",
    ):
        arguments = {k: v for k, v in locals().items() if k not in ("self", "address")}  # (options.py checks them)
        self._close_lock = threading.Lock()
        self._closed = False
        self.options = LoaderOptions.from_arguments(arguments)
        self._ranks = Ranks(self.options.rank, self.options.world_size)
        self._position = EpochPosition(self._plan, replayable=sampler is None)
        self._counted: Partition | None = None  # the partition len() last counted batches for
        self._final_servers: dict[str, dict] = {}  # the servers' counters when it was closed
        self._final_receiver_cpu = 0.0  # and the receiver's CPU seconds
        self._throughput = Throughput(self.options.batch_size, self.options.setup.pipeline)
        self._keys: dict[tuple[str, int], list[str]] = {}
        self._pid = os.getpid()  # a forked copy of this object owns no thread and no child
        _OPEN.add(self)
        try:
            if self.fields is None:
                # The fields the servers' shards carry, asked before the I/O side opens: the
                # streams ask for them, and batch memory has room for masks when they carry some.
                # (A server that joins between this and the open with other fields does not
                # add them.)
                wanted = self._wanted_fields(SampleSpace(describe_servers(address, self._link_options())))
                self.options = self.options.with_fields(wanted)
            self._io, self._delivery = self._open_io(address)
            self._servers = ServerSet(self._io, self.options.setup)
            if self.fields is not None:
                wanted = self._wanted_fields(self._servers.space)
        except BaseException:
            self.close()
            raise
        # What each batch holds besides the images: None for (images, labels) tuples.
        self._batch_fields: tuple[str, ...] | None = (
            wanted if self.fields is not None or set(wanted) - {tg.LABEL} else None
        )
        self._warn_if_epochs_are_empty(self._ranks.current())

    def _wanted_fields(self, space: SampleSpace) -> tuple[str, ...]:
        """The fields asked for, or (fields=None) those the servers' shards carry; ValueError for
        fields asked for that no shard carries (a model trained on empty targets is silently wrong)."""
        wanted = space.fields if self.fields is None else self.fields
        rendered = tg.RENDERED + ((tg.FRAME_INDICES,) if self.options.clip is not None else ())
        missing = [f for f in wanted if f not in space.fields and f not in rendered]
        if missing:
            carried = "; ".join(f"{f}: {tg.CARRIED_BY.get(f, 'shards whose targets have it')}" for f in missing)
            raise ValueError(
                f"fields={list(wanted)}: none of the servers' shards carry {', '.join(missing)} (they carry "
                f"{', '.join(space.fields) or 'no targets'}). What carries them: {carried}"
            )
        if self.batch_format == "torchvision" and not {tg.BBOXES, tg.BBOX_LABELS} <= set(wanted):
            raise ValueError(
                f"batch_format='torchvision' needs the fields bboxes and bbox_labels (asked for: {list(wanted)}; "
                f"the servers' shards carry {', '.join(space.fields) or 'no targets'})"
            )
        return wanted

    def _open_io(self, address: str | Iterable[str]) -> tuple[Receiver, Delivery]:
        """The receiver and the delivery the options ask for (closed again if either fails)."""
        o = self.options
        engine_options = EngineOptions(
            seed=o.seed, prefetch=o.prefetch, ordered=o.ordered, progress_timeout=o.progress_timeout
        )
        link_options = self._link_options()
        process: ProcessReceiver | None = None
        delivery: Delivery | None = None
        try:
            if o.receiver == "process":
                # Batches arrive in its shared slots; the delivery copies them out (to the GPU
                # on CUDA) and gives the slots back.
                process = ProcessReceiver(
                    address, o.setup, o.batch_buffers, o.batch_bytes, engine_options, link_options
                )
            if o.device.type == "cuda":
                delivery = CudaDelivery(
                    o.device,
                    o.normalize,
                    o.dtype,
                    o.batch_bytes,
                    o.batch_buffers,
                    receiver=process,
                )
            else:
                delivery = HostDelivery(
                    o.normalize, o.dtype, o.batch_buffers, receiver=process, batch=(o.batch_size, *o.sample_size)
                )
            if process is not None:
                return process, delivery
            return ThreadReceiver(address, o.setup, delivery, engine_options, link_options), delivery
        except BaseException:
            if delivery is not None:
                delivery.close(final=True)
            if process is not None:
                process.close()
            raise

    def _link_options(self) -> LinkOptions:
        o = self.options
        return LinkOptions(
            connect_timeout=o.connect_timeout,
            max_inflight=o.max_inflight,
            reconnect_timeout=o.reconnect_timeout,
            tls=o.tls,
            metadata=o.metadata,
            token=o.token,
            shared_memory=o.shared_memory and o.wire == RAW,
        )

    def _warn_if_epochs_are_empty(self, partition: Partition) -> None:
        n = self._epoch_samples()
        if n and plan_module.num_batches(n, self.batch_size, partition.world_size, self.drop_last) == 0:
            warnings.warn(
                f"RemoteLoader: batch_size={self.batch_size} with drop_last=True leaves no whole batch "
                f"of the {n} samples {'the sampler gives' if self.options.sampler is not None else 'it serves'} "
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
        return plan_module.num_batches(n, self.batch_size, partition.world_size, self.drop_last)

    def _epoch_samples(self) -> int | None:
        """Samples an epoch plays before splitting into ranks (None: a sampler without __len__)."""
        sampler = self.options.sampler
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
            self.batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch,
            rank=partition.rank,
            world_size=partition.world_size,
            drop_last=self.drop_last,
            sampler=self.options.sampler,
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
        played, token, source = self._start_pass()
        out = self._delivery.start(source)
        ended = False  # the receiver said the pass is over
        meter = self._throughput
        span = meter.span(played.epoch, self._io.server_stats(), self._io.cpu_seconds())

        def epoch_done() -> None:
            meter.epoch_done(span, self._io.server_stats(), self._io.cpu_seconds())

        try:
            while True:
                item = meter.wait_for(lambda: self._get(out, token))
                if item is END:
                    ended = True
                    if self._position.ended(token):  # an epoch with no batches for this rank
                        epoch_done()
                    break
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, (Batch, Delivered)), item
                self._io.consumed(token)
                result = self._deliver(item)
                # Only once delivered (a batch that raised is played again on resume); the last
                # batch ends the epoch, whether or not the loop asks for another.
                if self._position.delivered(token, item.seq):
                    epoch_done()
                if result is not None:
                    yield result
        finally:
            if not ended and self._io.token == token:  # left early, and no newer pass started
                self._abandon(token)

    def _start_pass(self) -> tuple[Pass, int, queue.Queue[Item]]:
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
        played = self._position.next_pass(partition)
        out = self._io.start_epoch(
            token=played.token,
            epoch=played.epoch,
            batches=played.plan.batches,
            first_seq=played.start,
            space=space,
            skip=played.done,
        )
        self._position.begin(played)
        return played, played.token, out

    def _get(self, out: Readable[Output], token: int) -> Output:
        while True:
            try:
                return out.get(timeout=1.0)
            except queue.Empty:
                if self._closed:
                    raise LoaderError("the RemoteLoader was closed (close() or its with-block ended)") from None
                stopped = self._io.stopped()
                if stopped is not None:
                    raise LoaderError(stopped) from None
                if self._io.token != token:
                    raise RuntimeError(
                        "this iteration was superseded: iter(loader) was called again, which starts the epoch anew"
                    ) from None

    def _abandon(self, token: int) -> None:
        """The consumer stopped mid-epoch: stop the work (cancel_epoch gives the buffers back)."""
        try:
            self._io.cancel_epoch(token)
        except (RuntimeError, LoaderError, TimeoutError, concurrent.futures.TimeoutError):
            # closed meanwhile, or the receiver is gone or stuck
            return
        self._delivery.close()

    def _deliver(self, item: Batch | Delivered) -> tuple | dict[str, Any] | None:
        """The batch as the training loop gets it (None: on_error left none of its rows)."""
        delivered = failures.apply(self.on_error, self._delivery.finish(item))
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


@atexit.register
def _close_open_loaders() -> None:
    """Loaders the script did not close: at interpreter shutdown their I/O threads stop
    answering, and each close() would wait out its timeouts (seconds per loader)."""
    for loader in list(_OPEN):
        try:
            loader.close()
        except Exception:
            pass
