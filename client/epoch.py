"""Where training is in its epochs: the one owner of the epoch position and its state_dict.

``EpochPosition`` knows which epoch the next pass plays, how far the current one got
(``position``: the first plan batch not yet delivered; ``done``: later batches already
delivered, with ``ordered=False``), the pass that advances it, a position
loaded from a ``state_dict`` until its pass starts, and the plan being played (whose digest
a state_dict carries). It changes only through its methods: ``set_epoch``, ``load``,
``next_pass``, ``begin``, ``delivered``, ``ended``.

Which epoch a pass plays (a pass is one ``iter()``; it starts at its first batch, so a
``set_epoch`` between ``iter()`` and the first batch counts):

* a position loaded with ``load_state_dict``: that epoch, from that position;
* after ``set_epoch(e)``: epoch ``e`` from its first batch (a loaded position of ``e`` is kept);
* after a pass that was left before its end (``break``, or a framework that stops at
  ``len()``): the epoch after the one it played;
* otherwise the epoch after the last one played to its end (epoch 0 at first).

An epoch ends when its last batch is delivered, not when the loop asks for one more:
from then on the position is the next epoch's first batch, which is what a checkpoint
taken at the end of an epoch saves. So a loop with or without ``set_epoch``, one that
stops at ``len()``, and a resumed run all play the same epochs in the same order.

A position is only valid for the plan it was reached in: ``load`` refuses a state saved
with another seed, sample count, batch size or world size, or (by the plan's digest, the
same on every rank) another shuffle, drop_last or sampler order, rather than play other
batches. Ranks move in lockstep with equal batch counts, so a position saved on one rank
(with ``ordered=True``) is every rank's: any rank of the same world size resumes from it,
each playing its own part of the plan. A state saved by an older remoteloader (version 1 or 2)
resumes only an order that did not change since (unshuffled, or a sampler's, checked id by id):
its shuffled order was another permutation, and such a state is refused, saying so.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from remoteloader.client.option_groups import UINT64, check_int
from remoteloader.client.plan import EpochPlan
from remoteloader.client.ranks import Partition
from remoteloader.client.sample_space import SampleSpace

STATE_VERSION = 3  # 3: the shuffled order is a keyed permutation, the digest made from the plan's parameters
# 2: the digest covers every rank's batches' ids; "ordered" is saved. 1: the digest covers this rank's.
# What a position is only valid for, as state_dict() saves it (the loader's values).
IDENTITY = ("seed", "num_samples", "batch_size", "shuffle", "drop_last", "ordered")


class FrameworkEpochs:
    """What a framework reaches a loader's ``set_epoch`` through, at each epoch's start.

    Lightning calls ``set_epoch(epoch)`` on ``loader.sampler`` and ``loader.batch_sampler.sampler``
    when it finds them (on every loader it trains, validates or tests with, its own epoch count),
    never on the loader itself; a ``DataLoader`` with a ``DistributedSampler`` needs no line from
    the user for that. ``RemoteLoader.batch_sampler`` is one of these, whose ``sampler`` is itself:
    the framework's ``set_epoch`` is the loader's, with its rules (``EpochPosition.set_epoch``: a
    loaded position of that epoch is kept). So a run resumed from a checkpoint the framework took
    at an epoch's end plays the next epoch, not epoch 0. It is not a sampler of sample ids (it has
    no ``__iter__``), and no ``sampler`` attribute of the loader exists: Lightning would take one for
    a ``DataLoader``'s and read ``batch_sampler`` beside it, to see whether it shuffles.

    Args:
        set_epoch: The loader's ``set_epoch`` (which checks the value).
    """

    def __init__(self, set_epoch: Callable[[int], None]):
        self._set_epoch = set_epoch

    @property
    def sampler(self) -> FrameworkEpochs:
        """Itself: Lightning looks for ``batch_sampler.sampler.set_epoch``."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """The epoch the framework's next pass plays (``EpochPosition.set_epoch``)."""
        self._set_epoch(epoch)


class NextPass(enum.Enum):
    """What the next pass plays."""

    FROM_START = "the epoch's first batch"  # at first, after set_epoch, after an epoch's end
    FOLLOWING = "the epoch after the one a pass left"  # a pass stopped before the end
    RESUME = "a loaded position"


@dataclass(frozen=True)
class Pass:
    """What one pass plays: ``plan`` from ``start``, less ``done``, over ``space`` (the sample
    space its ids number). The loader hands it to its receiver, whose ``EpochRun`` runs it; it
    is the one home of its ``token`` (``next_pass`` gives each pass its own), which names the
    pass where it crosses to another process, so that a late message about an abandoned pass
    changes nothing. Only the pass that began last advances the position."""

    epoch: int
    plan: EpochPlan
    start: int
    done: frozenset[int]
    token: int = 0
    space: SampleSpace | None = None


@dataclass(frozen=True)
class _Loaded:
    """A loaded state_dict until its pass starts: checked against ``pass_``'s plan, made for
    ``partition`` (the state's own world size while torch.distributed is not initialized),
    over ``space``, the sample space its ids number."""

    state: dict
    pass_: Pass
    partition: Partition
    space: SampleSpace
    identity: Mapping[str, Any]


@dataclass
class EpochPosition:
    """The epoch the next pass plays and how far the current one got.

    Others read ``epoch``, ``position`` and ``done``; only its methods change them.

    Args:
        plan: An epoch's plan for a partition (the loader's pure plan function over its
            current sample space).
        replayable: Whether ``plan`` may be called just for a digest (not with a user's
            sampler, which may be random and is asked for one pass per epoch).
    """

    plan: Callable[[int, Partition], EpochPlan]
    replayable: bool
    epoch: int = field(default=0, init=False)
    position: int = field(default=0, init=False)  # first batch of the epoch not yet delivered
    done: set[int] = field(default_factory=set, init=False)  # later batches already delivered (ordered=False)
    _played: Pass | None = field(default=None, init=False)  # the pass that advances the position
    _next: NextPass = field(default=NextPass.FROM_START, init=False)
    _loaded: _Loaded | None = field(default=None, init=False)  # set when _next is RESUME
    _playing: EpochPlan | None = field(default=None, init=False)  # the plan played (or loaded) last
    _tokens: Iterator[int] = field(default_factory=lambda: itertools.count(1), init=False)

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch the next pass plays, from its first batch; a loaded position of
        that epoch is kept. The position reached stays what state_dict() saves until then."""
        if epoch != self.epoch:
            self.position, self.done, self._playing = 0, set(), None
        self.epoch = epoch
        if self._next is not NextPass.RESUME or epoch != self._loaded_epoch():
            self._next, self._loaded = NextPass.FROM_START, None

    def _loaded_epoch(self) -> int | None:
        return self._loaded.pass_.epoch if self._loaded is not None else None

    def resume_space(self) -> SampleSpace | None:
        """The sample space of the loaded position the next pass plays, if it plays one."""
        return self._loaded.space if self._loaded is not None else None

    def next_pass(self, partition: Partition, space: SampleSpace | None = None) -> Pass:
        """What the pass starting now plays, for ``partition`` over ``space``, with a token of
        its own (ValueError: a loaded position that is not valid for it, e.g. another world size)."""
        return dataclasses.replace(self._next_pass(partition), token=next(self._tokens), space=space)

    def _next_pass(self, partition: Partition) -> Pass:
        if self._next is NextPass.RESUME:
            assert self._loaded is not None
            loaded, self._loaded = self._loaded, None
            if partition == loaded.partition:
                return loaded.pass_
            return self._check(loaded.state, partition, loaded.identity, resolved=True)
        epoch = self.epoch + 1 if self._next is NextPass.FOLLOWING else self.epoch
        check_int("epoch", epoch, 0, UINT64)
        return Pass(epoch, self.plan(epoch, partition), 0, frozenset())

    def begin(self, played: Pass) -> None:
        """The pass ``played`` started (its receiver runs it); if it is left before the end,
        the next pass plays the following epoch."""
        self.epoch, self.position, self.done = played.epoch, played.start, set(played.done)
        self._playing = played.plan  # its digest is computed when state_dict() asks
        self._played = played
        self._next, self._loaded = NextPass.FOLLOWING, None

    def owns(self, played: Pass) -> bool:
        """Whether the pass ``played`` still advances the position (not after set_epoch, a load
        or a newer pass)."""
        return played is self._played and self._next is NextPass.FOLLOWING

    def delivered(self, played: Pass, seq: int) -> bool:
        """Batch ``seq`` of pass ``played`` reached the training loop (only then: one that raised
        is played again on resume). Returns whether that ended its epoch."""
        if not self.owns(played):
            return False
        self.done.add(seq)
        while self.position in self.done:
            self.done.discard(self.position)
            self.position += 1
        if self._playing is not None and self.position >= len(self._playing.batches):
            self._end()
            return True
        return False

    def ended(self, played: Pass) -> bool:
        """Pass ``played`` played to its end; returns whether that ended its epoch (an epoch
        with no batches here, which no delivery ended)."""
        if not self.owns(played):
            return False
        self._end()
        return True

    def _end(self) -> None:
        self.epoch += 1
        self.position, self.done, self._playing = 0, set(), None
        self._played, self._next = None, NextPass.FROM_START

    # ---- state_dict -----------------------------------------------------------------
    def state_dict(self, identity: Mapping[str, Any], partition: Partition) -> dict:
        """The position as a small JSON-serializable dict (see RemoteLoader.state_dict);
        ``partition``: the loader's now, for a position no pass or load has planned yet."""
        plan = self._plan_of_position(partition)
        if plan is not None:
            partition = Partition(plan.rank, plan.world_size)
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "delivered_after": sorted(self.done),
            **{key: identity[key] for key in IDENTITY},
            "world_size": partition.world_size,
            "rank": partition.rank,
            "plan": plan.digest if plan is not None else None,
        }

    def _plan_of_position(self, partition: Partition) -> EpochPlan | None:
        """The plan the position belongs to: the one played or loaded, or, before there is one,
        a fresh one (None with a sampler, which is not asked for a pass here: it may be random)."""
        if self._playing is None or self._playing.epoch != self.epoch:
            if not self.replayable:
                return None
            self._playing = self.plan(self.epoch, partition)
        return self._playing

    def load(self, state: Any, identity: Mapping[str, Any], space: SampleSpace, partition: Partition) -> None:
        """Continues at a saved position, after checking it belongs to this loader's plan.

        Raises TypeError for something else than a dict, ValueError for a state of another
        version or plan, or one whose position lies outside its epoch. While the partition
        is provisional (``partition.known`` False: torch.distributed not yet initialized),
        the state is checked for its own world size, and again at its pass's first batch.
        """
        if not isinstance(state, dict):
            raise TypeError(f"load_state_dict expects the dict state_dict() returned, got {type(state).__name__}")
        state = json.loads(json.dumps(state))
        missing = [k for k in ("version", "epoch", "position") if k not in state]
        if missing or state.get("version") not in (1, 2, STATE_VERSION):
            raise ValueError(
                f"not a RemoteLoader state_dict (version 1 to {STATE_VERSION}): missing "
                f"{', '.join(missing) or 'nothing'}, version {state.get('version')!r}"
            )
        # shuffle and drop_last are left to the plan's digest, which also sees when they change
        # nothing (a sampler; an even split); a state saved before the digest existed compares them.
        keys = ["seed", "num_samples", "batch_size"]
        if not state.get("plan"):
            keys += [k for k in ("shuffle", "drop_last") if k in state]
        for key in keys:
            mine = identity[key]
            if state.get(key) != mine:
                raise ValueError(
                    f"state_dict has {key}={state.get(key)!r} but this loader has {key}={mine!r}; "
                    f"a resumed epoch is only identical with the same {key}"
                )
        resolved = partition.known or state.get("world_size") == partition.world_size
        if not resolved:  # check it for the world it was saved in; once the process group exists, again
            world = check_int("state_dict world_size", state.get("world_size"), 1)
            partition = Partition(min(partition.rank, world - 1), world, known=False)
        checked = self._check(state, partition, identity, resolved)
        self.epoch, self.position, self.done = checked.epoch, checked.start, set(checked.done)
        self._playing = checked.plan  # for state_dict() before the first batch
        self._next = NextPass.RESUME
        self._loaded = _Loaded(state, checked, partition, space, dict(identity))

    def _check(self, state: dict, partition: Partition, identity: Mapping[str, Any], resolved: bool) -> Pass:
        """The pass that plays ``state``'s position for ``partition``; ValueError where it
        cannot be played exactly (``resolved``: the partition is the one it will play in)."""
        saved_world, saved_rank = state.get("world_size"), state.get("rank")
        if saved_world != partition.world_size:
            pending = "" if partition.known else " (torch.distributed is not initialized: initialize it first)"
            raise ValueError(
                f"state_dict has world_size={saved_world!r} but this loader has "
                f"world_size={partition.world_size}{pending}; a resumed epoch is only identical with the same "
                f"world_size"
            )
        epoch = check_int("state_dict epoch", state["epoch"], 0, UINT64)
        position = check_int("state_dict position", state["position"], 0)
        done = state.get("delivered_after", [])
        if not isinstance(done, list):
            raise ValueError(f"state_dict delivered_after={done!r}: expected a list of batch numbers")
        later = {check_int("state_dict delivered_after", seq, position + 1) for seq in done}
        if resolved and saved_rank != partition.rank and (state.get("version") == 1 or not state.get("ordered", True)):
            why = (
                "it was saved with ordered=False, where each rank's delivered batches are its own"
                if state.get("version") != 1
                else "it was saved by an older remoteloader, whose states each hold one rank's plan"
            )
            raise ValueError(
                f"state_dict was saved on rank {saved_rank!r} and this loader is rank {partition.rank}: {why}; "
                f"load each rank's own state_dict (save one per rank), or save with ordered=True"
            )
        version = state.get("version")
        if version != STATE_VERSION and self.replayable and state.get("shuffle", identity["shuffle"]):
            raise ValueError(
                f"state_dict was saved by an older remoteloader (state version {version}), whose shuffled order "
                f"this version changed: its plan digest no longer matches this loader's plan of epoch {epoch}, "
                f"and resuming would play other batches; start the epoch afresh (set_epoch({epoch}) without "
                f"load_state_dict), or resume with the remoteloader that saved it"
            )
        plan = self.plan(epoch, partition)
        if version == STATE_VERSION:
            expected = plan.digest
        else:  # an unshuffled order, or a sampler's: the same ids as then, compared one by one
            expected = plan.ids_digest(every_rank=version != 1) if state.get("plan") else ""
        if state.get("plan") and state["plan"] != expected:
            differ = [
                f"{k}={state[k]!r} there" for k in ("shuffle", "drop_last") if k in state and state[k] != identity[k]
            ]
            why = ", ".join(differ) or "a different sampler, or one whose order is not a function of the epoch"
            raise ValueError(
                f"state_dict was saved from another plan of epoch {epoch} than this loader's ({why}); "
                f"resuming would play other batches"
            )
        n = len(plan.batches)
        if position > n or (later and max(later) >= n):
            raise ValueError(
                f"state_dict position={position} delivered_after={sorted(later)}: epoch {epoch} has {n} batches here"
            )
        if position == n and n:  # saved as its last batch was delivered (older states): the next epoch's start
            check_int("state_dict epoch", epoch + 1, 0, UINT64)
            return Pass(epoch + 1, self.plan(epoch + 1, partition), 0, frozenset())
        return Pass(epoch, plan, position, frozenset(later))
