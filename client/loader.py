"""RemoteLoader: the training-side iterable that wires discovery, plan, scheduling and delivery."""

from __future__ import annotations

import atexit
import concurrent.futures
import hashlib
import json
import logging
import math
import os
import queue
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from remoteloader.client import plan as plan_module
from remoteloader.client.catalog import Catalog
from remoteloader.client.device import CudaDelivery, Delivered, HostDelivery
from remoteloader.client.engine import END, LoaderError, SampleFailure
from remoteloader.client.receiver import ProcessReceiver, Receiver
from remoteloader.client.security import TLSConfig, tls_config, token_metadata
from remoteloader.protos import loader_pb2

log = logging.getLogger("remoteloader.client")

ON_ERROR = ("raise", "warn", "skip")
RECEIVERS = ("thread", "process")
UINT64 = 1 << 64  # seeds and epochs travel as uint64
_OPEN: "weakref.WeakSet[RemoteLoader]" = weakref.WeakSet()  # closed at exit, while threads still run
_KEY_BLOCK = 1024


class RemoteLoader:
    """Batches of augmented images streamed from loader servers, as an ordinary iterable.

    Example:
        loader = RemoteLoader("127.0.0.1:50051,127.0.0.1:50052", batch_size=256, image_size=224)
        for epoch in range(10):
            loader.set_epoch(epoch)
            for images, labels in loader:
                ...

    Args:
        address: Servers: ``"host:port"``, a comma-separated string or a list of them; a
            DNS name expands to every address it resolves to.
    Batches:
        batch_size: Samples per batch (default 256).
        image_size: Output size, an int or (height, width) (default 224).
        pipeline: ``"train"`` (random resized crop + flip), ``"eval"`` (resize + center
            crop), or an albumentations pipeline (``A.Compose``, or its ``A.to_dict``), which
            the servers must allow (default "train").
        shuffle: Shuffle the union of all servers' samples every epoch (default True).
        seed: Seeds the shuffle and every sample's augmentation (default 0).
        drop_last: Drop the last incomplete batch (default True).
        sampler: An iterable of global sample ids replacing shuffle (e.g. weighted); its
            ``set_epoch`` is called if it has one (default None).
        rank / world_size: This process's part of each epoch; default to torch.distributed's
            when it is initialized, else 0 / 1. Every rank gets the same number of batches.
    Output:
        device: ``"cpu"`` or ``"cuda[:i]"`` (default "cpu").
        normalize: (mean, std) per channel on the 0..1 scale; when given, images come out as
            ``dtype`` NCHW (channels_last memory) normalized; otherwise uint8 NHWC.
        dtype: Floating dtype of normalized images (default torch.float32).
        return_ids: Yield (images, labels, ids) with the global sample ids (default False).
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
            is treated as failed and its orders go elsewhere (default 60).
        receiver: Where the batches are received: ``"process"``, a child process that writes
            them into shared memory (pinned on CUDA), so the training process spends almost
            no CPU and none of its GIL on input, or ``"thread"``, an I/O thread of this
            process (no child; one copy less on the CPU). Default: "process" on CUDA,
            "thread" on the CPU. With "process", (prefetch + 2) batch slots of shared memory
            replace the host buffers above.
    Security:
        tls: Path of the CA PEM that signed the servers' certificates, or a TLSConfig (with a
            client certificate for mutual TLS); default None: plaintext.
        token: Bearer token the servers expect (their --token-file); default None.
    """

    def __init__(self, address: str | Iterable[str], *, batch_size: int = 256, image_size: int | Sequence[int] = 224,
                 pipeline: Any = "train", shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                 sampler: Iterable[int] | None = None, rank: int | None = None, world_size: int | None = None,
                 device: str | torch.device = "cpu", normalize: tuple[Sequence[float], Sequence[float]] | None = None,
                 dtype: torch.dtype = torch.float32, return_ids: bool = False, ordered: bool = True,
                 on_error: str | Callable[[list[SampleFailure]], None] = "raise", prefetch: int = 8,
                 max_inflight: int = 4, connect_timeout: float = 10.0, reconnect_timeout: float = 60.0,
                 progress_timeout: float = 60.0, tls: str | TLSConfig | None = None, token: str | None = None,
                 receiver: str | None = None):
        self._close_lock = threading.Lock()
        self.batch_size = _int("batch_size", batch_size, 1)
        self.image_size = _size(image_size)
        self._setup = _setup(pipeline, self.image_size)
        self.shuffle = bool(shuffle)
        self.seed = _int("seed", seed, 0, UINT64)
        self.drop_last = bool(drop_last)
        self.sampler = sampler
        self.rank, self.world_size = _rank_world(rank, world_size)
        self.device = _device(device)
        self.normalize = _normalize(normalize)
        if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"dtype={dtype}: expected torch.float32, bfloat16, float16 or float64")
        self.dtype = dtype
        self.return_ids = bool(return_ids)
        self.ordered = bool(ordered)
        if not callable(on_error) and on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r}: expected one of {', '.join(ON_ERROR)} or a callable")
        self.on_error = on_error
        prefetch, max_inflight = _int("prefetch", prefetch, 1), _int("max_inflight", max_inflight, 1)
        self.prefetch = prefetch
        for name, value in (("connect_timeout", connect_timeout), ("reconnect_timeout", reconnect_timeout),
                            ("progress_timeout", progress_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name}={value!r}: expected seconds >= 0")
        if progress_timeout == 0:
            raise ValueError("progress_timeout=0: expected seconds > 0")
        self._epoch = 0
        self._epoch_set = False
        self._position = 0  # first batch of the current epoch not yet delivered
        self._done: set[int] = set()  # later batches already delivered (ordered=False)
        self._token: int | None = None  # the current iteration's epoch token
        # A loaded position: (epoch, first batch, later batches delivered, that epoch's plan,
        # the catalog it was planned over)
        self._resume: tuple[int, int, frozenset, list[np.ndarray], Catalog] | None = None
        self._joined: Catalog | None = None  # servers that joined during a resumed epoch, for the next
        self._playing: tuple[int, str | None, list[np.ndarray]] | None = None  # (epoch, plan digest, plan)
        self._closed = False
        self._final_servers: dict[str, dict] = {}  # the servers' counters when it was closed
        self._stats = {"batches": 0, "images": 0, "bytes": 0, "wait_s": 0.0, "start": None, "busy_s": 0.0}
        self._keys: dict[tuple[str, int], list[str]] = {}

        if receiver is None:
            receiver = "process" if self.device.type == "cuda" and hasattr(os, "memfd_create") else "thread"
        if receiver not in RECEIVERS:
            raise ValueError(f"receiver={receiver!r}: expected one of {', '.join(RECEIVERS)}")
        if receiver == "process" and not hasattr(os, "memfd_create"):
            raise ValueError("receiver='process' needs Linux (os.memfd_create); use receiver='thread'")
        self.receiver = receiver
        self.catalog: Catalog | None = None
        self._delivery = None
        self._io = None
        h, w = self.image_size
        batch_bytes = self.batch_size * h * w * 3
        engine_options = dict(seed=self.seed, prefetch=prefetch, ordered=self.ordered,
                              reconnect_timeout=reconnect_timeout, progress_timeout=progress_timeout)
        link_options = dict(connect_timeout=connect_timeout, max_inflight=max_inflight, tls=tls_config(tls),
                            metadata=token_metadata(token))
        self._servers: list[str] = []
        self._pid = os.getpid()  # a forked copy of this object owns no thread and no child
        _OPEN.add(self)
        try:
            # In a receiver process, batches arrive in its shared slots and the delivery
            # copies them out (to the GPU on CUDA) and gives the slots back.
            shared = None
            if receiver == "process":
                shared = self._io = ProcessReceiver(address, self._setup, prefetch + 2, batch_bytes,
                                                    engine_options, link_options)
            if self.device.type == "cuda":
                self._delivery = CudaDelivery(self.device, self.normalize, self.dtype, batch_bytes, prefetch,
                                              on_free=self._buffer_freed, receiver=shared)
            else:
                self._delivery = HostDelivery(self.normalize, self.dtype, prefetch, receiver=shared)
            if receiver == "thread":
                self._io = Receiver(address, self._setup, self._delivery, engine_options, link_options)
            self.catalog = self._discover()
        except BaseException:
            self.close()
            raise
        n = self._epoch_samples()
        if n and plan_module.num_batches(n, self.batch_size, self.world_size, self.drop_last) == 0:
            warnings.warn(f"RemoteLoader: batch_size={self.batch_size} with drop_last=True leaves no whole batch "
                          f"of the {n} samples {'the sampler gives' if self.sampler is not None else 'it serves'} "
                          f"for each of {self.world_size} rank(s): every epoch is empty (pass drop_last=False or "
                          f"a smaller batch_size)", stacklevel=2)

    # ---- the public surface ------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """Samples in the union of all servers' shards."""
        return self.catalog.num_samples

    @property
    def class_names(self) -> list[str]:
        return list(self.catalog.class_names)

    @property
    def servers(self) -> list[str]:
        return list(self._servers)

    def __len__(self) -> int:
        n = self._epoch_samples()
        if n is None:
            raise TypeError("len(RemoteLoader) is unknown: its sampler has no __len__ (as DataLoader, len() "
                            "needs one)")
        return plan_module.num_batches(n, self.batch_size, self.world_size, self.drop_last)

    def _epoch_samples(self) -> int | None:
        """Samples an epoch plays before splitting into ranks (None: a sampler without __len__)."""
        if self.sampler is None:
            return self.num_samples
        return len(self.sampler) if hasattr(self.sampler, "__len__") else None

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch the next iteration plays (each iteration otherwise advances by one).

        Another epoch than the current one starts at its first batch: a position loaded or
        reached in the current one is dropped."""
        epoch = _int("epoch", epoch, 0, UINT64)
        if epoch != self._epoch:  # a position (loaded, or where a loop broke off) is its own epoch's
            self._resume = None
            self._position, self._done = 0, set()
        self._epoch = epoch
        self._epoch_set = True

    @property
    def epoch(self) -> int:
        return self._epoch

    def plan(self, epoch: int | None = None) -> list[np.ndarray]:
        """This rank's batches of global sample ids for an epoch (a pure function)."""
        return plan_module.epoch_plan(self.num_samples, self.batch_size, shuffle=self.shuffle, seed=self.seed,
                                      epoch=self._epoch if epoch is None else epoch, rank=self.rank,
                                      world_size=self.world_size, drop_last=self.drop_last, sampler=self.sampler)

    def sample_key(self, sample_id: int) -> str:
        """The sample's key on its server, e.g. ``"dog/0001.jpg"``."""
        shard, local = self.catalog.locate(int(sample_id))
        block = local // _KEY_BLOCK
        keys = self._keys.get((shard.id, block))
        if keys is None:
            keys = self._io.get_keys(list(shard.owners), shard.id, block * _KEY_BLOCK, _KEY_BLOCK)
            self._keys[(shard.id, block)] = keys
        return keys[local % _KEY_BLOCK]

    def state_dict(self) -> dict:
        """A small JSON-serializable position: resume with load_state_dict in a fresh loader.

        ``position`` is the first plan batch not yet delivered; with ``ordered=False``,
        ``delivered_after`` lists the later batches that already were. ``plan`` is a digest
        of the epoch's batches: a loader whose plan differs (shuffle, drop_last, sampler...)
        refuses the state rather than play other batches.
        """
        return {"version": 1, "seed": self.seed, "epoch": self._epoch, "position": self._position,
                "delivered_after": sorted(self._done), "num_samples": self.num_samples,
                "batch_size": self.batch_size, "world_size": self.world_size, "rank": self.rank,
                "shuffle": self.shuffle, "drop_last": self.drop_last, "plan": self._plan_digest(self._epoch)}

    def load_state_dict(self, state: dict) -> None:
        """Continues at the saved position: the rest of that epoch is bitwise the same."""
        if not isinstance(state, dict):
            raise TypeError(f"load_state_dict expects the dict state_dict() returned, got {type(state).__name__}")
        state = json.loads(json.dumps(state))
        missing = [k for k in ("version", "epoch", "position") if k not in state]
        if missing or state.get("version") != 1:
            raise ValueError(f"not a RemoteLoader state_dict (version 1): missing {', '.join(missing) or 'nothing'}, "
                             f"version {state.get('version')!r}")
        # shuffle and drop_last are left to the plan's digest, which also sees when they change
        # nothing (a sampler; an even split); a state saved before the digest existed compares them.
        keys = ["seed", "num_samples", "batch_size", "world_size", "rank"]
        if not state.get("plan"):
            keys += [k for k in ("shuffle", "drop_last") if k in state]
        for key in keys:
            mine = self.num_samples if key == "num_samples" else getattr(self, key)
            if state.get(key) != mine:
                raise ValueError(f"state_dict has {key}={state.get(key)!r} but this loader has {key}={mine!r}; "
                                 f"a resumed epoch is only identical with the same {key}")
        epoch = _int("state_dict epoch", state["epoch"], 0, UINT64)
        position = _int("state_dict position", state["position"], 0)
        done = state.get("delivered_after", [])
        if not isinstance(done, list):
            raise ValueError(f"state_dict delivered_after={done!r}: expected a list of batch numbers")
        done = {_int("state_dict delivered_after", seq, position + 1) for seq in done}
        batches = self.plan(epoch)
        if state.get("plan") and state["plan"] != _digest(batches):
            differ = [f"{k}={state[k]!r} there" for k in ("shuffle", "drop_last") if k in state and
                      state[k] != getattr(self, k)]
            why = ", ".join(differ) or "a different sampler, or one whose order is not a function of the epoch"
            raise ValueError(f"state_dict was saved from another plan of epoch {epoch} than this loader's ({why}); "
                             f"resuming would play other batches")
        if position > len(batches) or (done and max(done) >= len(batches)):
            raise ValueError(f"state_dict position={position} delivered_after={sorted(done)}: epoch {epoch} has "
                             f"{len(batches)} batches here")
        self._epoch, self._position, self._done = epoch, position, done
        self._resume = (epoch, position, frozenset(done), batches, self.catalog)
        self._playing = (epoch, None, batches)  # for state_dict() before the first batch
        self._epoch_set = True

    def _plan_digest(self, epoch: int) -> str | None:
        """The digest of ``epoch``'s plan: the one last played, or, before it is, a fresh one
        (None with a sampler, which is not asked for a pass here: it may be random)."""
        if self._playing is None or self._playing[0] != epoch:
            if self.sampler is not None:
                return None
            self._playing = (epoch, None, self.plan(epoch))
        if self._playing[1] is None:
            self._playing = (epoch, _digest(self._playing[2]), self._playing[2])
        return self._playing[1]

    def stats(self) -> dict:
        """Throughput, the time the loop waited for data, and per-server counters.

        Rates and the wait fraction are averages since the first batch was asked for (time
        the loader sat idle between epochs included); the servers' counters are those at
        close() once it is closed."""
        s = self._stats
        elapsed = (time.perf_counter() - s["start"]) if s["start"] else 0.0
        per_server = self._final_servers if self._closed else self._io.server_stats()
        return {"batches": s["batches"], "images": s["images"], "bytes": s["bytes"], "elapsed_s": elapsed,
                "images_per_s": s["images"] / elapsed if elapsed else 0.0,
                "bytes_per_s": s["bytes"] / elapsed if elapsed else 0.0,
                "wait_s": s["wait_s"], "wait_fraction": s["wait_s"] / elapsed if elapsed else 0.0,
                "servers": per_server}

    def __iter__(self) -> Iterator:
        if self._closed:
            raise RuntimeError("RemoteLoader is closed")
        epoch = self._epoch
        found = self._discover()
        if self._joined is not None and found is self.catalog:  # nothing new since they joined
            found = self._joined
        self._joined = None
        resume = self._resume if self._resume is not None and self._resume[0] == epoch else None
        self._resume = None
        if resume is not None and found.shard_ids != resume[4].shard_ids:
            # Servers joined behind the address since the state was loaded: its epoch plays
            # over the servers it was planned for (its ids mean their samples); they join next.
            self._joined, found = found, resume[4]
        self.catalog = found
        if resume is not None:
            _, start, done, batches, _ = resume  # the plan the state was checked against
        else:
            start, done, batches = 0, frozenset(), self.plan(epoch)
        self._playing = (epoch, None, batches)  # its digest is computed when state_dict() asks
        token, out = self._io.start_epoch(epoch, batches, start, done, self.catalog)
        self._token = token
        self._position, self._done = start, set(done)
        return self._iterate(epoch, out, token)

    def _iterate(self, epoch: int, source, token: int) -> Iterator:
        out = self._delivery.start(source)
        finished = False
        try:
            while True:
                waited = time.perf_counter()
                if self._stats["start"] is None:
                    self._stats["start"] = waited
                item = self._get(out, token)
                self._stats["wait_s"] += time.perf_counter() - waited
                if item is END:
                    finished = True
                    break
                if isinstance(item, BaseException):
                    raise item
                self._io.consumed(token)
                result = self._deliver(item)
                if self._epoch == epoch and token == self._token:  # (not after set_epoch or a new iter())
                    self._delivered(item.seq)  # only once delivered: a batch that raised is not skipped on resume
                if result is not None:
                    yield result
        finally:
            if token != self._token:  # a newer iteration has started: this one owns nothing any more
                pass
            elif not finished:
                self._abandon(token)
            else:
                if not self._epoch_set or self._epoch == epoch:
                    self._epoch = epoch + 1
                self._position, self._done = 0, set()
                self._epoch_set = False

    def _delivered(self, seq: int) -> None:
        self._done.add(seq)
        while self._position in self._done:
            self._done.discard(self._position)
            self._position += 1

    def _get(self, out, token: int):
        while True:
            try:
                return out.get(timeout=1.0)
            except queue.Empty:
                if self._closed:
                    raise LoaderError("the RemoteLoader was closed (close() or its with-block ended)") from None
                if not self._io.alive():
                    raise LoaderError(self._io.failure() or "the RemoteLoader's receiver stopped") from None
                if self._io.token != token:
                    raise RuntimeError("this iteration was superseded: iter(loader) was called again, "
                                       "which starts the epoch anew") from None

    def _abandon(self, token: int) -> None:
        """The consumer stopped mid-epoch: stop the work (cancel_epoch gives the buffers back)."""
        try:
            self._io.cancel_epoch(token)
        except (RuntimeError, LoaderError, TimeoutError, concurrent.futures.TimeoutError):
            # closed meanwhile, or the receiver is gone or stuck
            return
        self._delivery.close()

    def _buffer_freed(self) -> None:
        if not self._closed and self._io is not None:
            self._io.buffer_freed()

    def _deliver(self, item):
        delivered = item if isinstance(item, Delivered) else self._delivery.convert(item)
        self._delivery.hand_over(delivered)
        images, labels, ids = delivered.images, delivered.labels, delivered.ids
        if delivered.failures:
            keep = self._handle_failures(delivered)
            if keep is not None:
                keep_on = keep.to(images.device)
                images, labels, ids = images[keep_on], labels[keep_on], ids[keep]
                if len(ids) == 0:
                    warnings.warn(f"batch {delivered.seq}: none of its {len(keep)} samples could be served, so it "
                                  f"is left out and this rank yields fewer batches than len(loader); under DDP the "
                                  f"ranks then disagree (on_error='raise' or a callable keeps every batch)",
                                  stacklevel=4)
                    return None
        self._stats["batches"] += 1
        self._stats["images"] += len(ids)
        self._stats["bytes"] += delivered.nbytes
        return (images, labels, ids) if self.return_ids else (images, labels)

    def _handle_failures(self, batch: Delivered):
        failures = batch.failures
        if callable(self.on_error):
            self.on_error(list(failures))
            return None
        text = "; ".join(f"id {f.sample_id} {f.key!r} on {f.server}: {f.reason}" for f in failures[:10])
        more = f" (and {len(failures) - 10} more)" if len(failures) > 10 else ""
        if self.on_error == "raise":
            raise LoaderError(f"{len(failures)} sample(s) of batch {batch.seq} could not be served: {text}{more}. "
                              f"Pass on_error='skip' or 'warn' to train without them.")
        if self.on_error == "warn":
            warnings.warn(f"skipping {len(failures)} sample(s) that could not be served: {text}{more}", stacklevel=4)
        bad = {f.sample_id for f in failures}
        return torch.tensor([i not in bad for i in batch.ids.tolist()], dtype=torch.bool)

    def close(self) -> None:
        """Stops the receiver (thread or process) and closes the connections (idempotent)."""
        if getattr(self, "_pid", os.getpid()) != os.getpid():  # a forked copy (whose lock may be a held one)
            return
        with self._close_lock:  # two threads (a timer and the with-block's exit) close it once
            if self._closed:
                return
            self._closed = True
        if getattr(self, "_delivery", None) is not None:
            self._delivery.close(final=True)
        if getattr(self, "_io", None) is not None:
            try:  # for stats() after close, as after a with-block
                self._final_servers = self._io.server_stats(timeout=2.0)
            except (LoaderError, RuntimeError, concurrent.futures.TimeoutError):
                pass  # its receiver is gone, stuck, or this is its own thread
            self._io.close()

    def __enter__(self) -> "RemoteLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ---- helpers ------------------------------------------------------------------------
    def _discover(self) -> Catalog:
        """Resolves the address again and describes servers not seen before.

        Called at start-up and before every epoch, so servers added behind a DNS name join
        at the next epoch. Servers that no longer resolve are kept: they may be restarting.
        """
        try:
            describes, new = self._io.discover()
        except (ConnectionError, OSError) as exc:
            if self.catalog is None:
                raise
            # A DNS hiccup or a server still starting: carry on with the servers known, retry next epoch.
            log.warning("looking for new loader servers failed (%s); continuing with %d known", exc,
                        len(self._servers))
            return self.catalog
        if not new:
            return self.catalog
        refused = {}
        for address in new:
            try:
                self._check_offer({address: describes[address]})
            except ValueError as exc:
                if self.catalog is None:  # at start-up: the user must hear of it now
                    raise
                refused[address] = exc
        if refused:  # joined later: training goes on without it; it is asked again next epoch
            self._io.forget(list(refused))
            for address, exc in refused.items():
                log.warning("loader server %s joined but cannot serve this loader (%s); going on without it",
                            address, exc)
            describes = {a: d for a, d in describes.items() if a not in refused}
            if len(describes) == len(self._servers):
                return self.catalog
        self._servers = list(describes)
        return Catalog(describes)

    def _check_offer(self, describes: dict) -> None:
        h, w = self.image_size
        for address, d in describes.items():
            if self._setup.pipeline == "custom":
                if not d.custom_pipelines:
                    raise ValueError(f"loader server {address} does not accept custom albumentations pipelines "
                                     f"(start it with --allow-custom-pipelines); it offers {', '.join(d.pipelines)}")
            elif self._setup.pipeline not in d.pipelines:
                raise ValueError(f"pipeline={self._setup.pipeline!r}: loader server {address} offers "
                                 f"{', '.join(d.pipelines)}")
            if not (d.min_image_size <= h <= d.max_image_size and d.min_image_size <= w <= d.max_image_size):
                raise ValueError(f"image_size={h}x{w}: loader server {address} offers sizes "
                                 f"{d.min_image_size}..{d.max_image_size}")


@atexit.register
def _close_open_loaders() -> None:
    """Loaders the script did not close: at interpreter shutdown their I/O threads stop
    answering, and each close() would wait out its timeouts (seconds per loader)."""
    for loader in list(_OPEN):
        try:
            loader.close()
        except Exception:
            pass


def _int(name: str, value, low: int, high: int | None = None) -> int:
    """``value`` as an int in [low, high) (numpy ints too; not bools, floats or strings)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r}: expected an int")
    value = int(value)
    if value < low or (high is not None and value >= high):
        bound = f">= {low}" if high is None else f"in {low}..{high - 1}"
        raise ValueError(f"{name}={value!r}: expected an int {bound}")
    return value


def _digest(batches: list[np.ndarray]) -> str:
    """A fingerprint of a plan: its batches' sample ids and boundaries."""
    h = hashlib.blake2b(digest_size=8)
    for batch in batches:
        h.update(len(batch).to_bytes(8, "little"))
        h.update(np.ascontiguousarray(batch, dtype="<i8").tobytes())
    return h.hexdigest()


def _size(image_size) -> tuple[int, int]:
    size = (image_size, image_size) if isinstance(image_size, (int, np.integer)) else image_size
    if not isinstance(size, Sequence) or len(size) != 2 or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) and 0 < v <= 65535 for v in size):
        raise ValueError(f"image_size={image_size!r}: expected an int or (height, width), 1..65535 each")
    return int(size[0]), int(size[1])


def _setup(pipeline, size: tuple[int, int]) -> loader_pb2.Setup:
    h, w = size
    if isinstance(pipeline, str):
        if pipeline == "custom":
            raise ValueError("pipeline='custom': pass the albumentations pipeline itself (A.Compose or A.to_dict)")
        return loader_pb2.Setup(pipeline=pipeline, height=h, width=w)
    if isinstance(pipeline, dict):
        document = pipeline
    elif type(pipeline).__module__.startswith("albumentations"):
        import albumentations as A  # only when the user already uses it

        document = A.to_dict(pipeline)
    else:
        raise ValueError(f"pipeline={pipeline!r}: expected 'train', 'eval', an albumentations pipeline or its "
                         f"A.to_dict() dictionary")
    return loader_pb2.Setup(pipeline="custom", height=h, width=w, albumentations_json=json.dumps(document))


def _rank_world(rank, world_size) -> tuple[int, int]:
    if rank is None or world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    world_size = _int("world_size", world_size, 1)
    return _int("rank", rank, 0, world_size), world_size


def _device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} but torch.cuda.is_available() is False: this torch build "
                             f"({torch.__version__}) has no usable GPU here; pass device='cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(device)!r}: expected 'cpu' or 'cuda'")
    return device


def _normalize(normalize):
    if normalize is None:
        return None
    try:
        mean, std = normalize
        mean, std = [float(v) for v in mean], [float(v) for v in std]
    except (TypeError, ValueError):
        raise ValueError(f"normalize={normalize!r}: expected (mean, std), three floats each") from None
    if len(mean) != 3 or len(std) != 3 or any(s <= 0 for s in std) or not all(map(math.isfinite, mean + std)):
        raise ValueError(f"normalize={normalize!r}: expected (mean, std), three floats each, std > 0")
    if any(abs(v) > 1 for v in mean) or any(v > 1 for v in std):
        raise ValueError(f"normalize={normalize!r}: mean and std are on the 0..1 scale (images are divided "
                         f"by 255 first), e.g. ImageNet's ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)); "
                         f"divide 0..255 figures by 255")
    return mean, std
