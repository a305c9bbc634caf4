"""Where training is in its epochs: the one owner of the epoch position and its state_dict.

``EpochPosition`` knows which epoch the next iteration plays, how far the current one got
(``position``: the first plan batch not yet delivered; ``done``: later batches already
delivered, with ``ordered=False``), the token of the iteration that advances it, a
position loaded from a ``state_dict`` until that epoch starts, and the plan being played
(whose digest a state_dict carries). It changes only through its methods: ``set_epoch``,
``load``, ``take_resume``, ``begin``, ``delivered``, ``finished``.

A position is only valid for the plan it was reached in: ``load`` refuses a state saved
with another seed, sample count, batch size, rank split, or (by the plan's digest) another
shuffle, drop_last or sampler order, rather than play other batches.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from remoteloader.client.options import UINT64, check_int
from remoteloader.client.sample_space import SampleSpace

STATE_VERSION = 1
# What a position is only valid for, as state_dict() saves it (the loader's values).
IDENTITY = ("seed", "num_samples", "batch_size", "world_size", "rank", "shuffle", "drop_last")


def digest(batches: list[np.ndarray]) -> str:
    """A fingerprint of a plan: its batches' sample ids and boundaries."""
    h = hashlib.blake2b(digest_size=8)
    for batch in batches:
        h.update(len(batch).to_bytes(8, "little"))
        h.update(np.ascontiguousarray(batch, dtype="<i8").tobytes())
    return h.hexdigest()


@dataclass
class _Plan:
    """An epoch's batches, and their digest once asked for."""

    epoch: int
    batches: list[np.ndarray]
    digest: str | None = None


@dataclass(frozen=True)
class Resume:
    """A loaded position: its epoch starts at ``position``, less ``done``, over the plan it was
    checked against and the sample space that plan numbers."""

    epoch: int
    position: int
    done: frozenset[int]
    batches: list[np.ndarray]
    space: SampleSpace


@dataclass
class EpochPosition:
    """The epoch the next iteration plays and how far it got.

    Others read ``epoch``, ``position``, ``done`` and ``token``; only its methods change them.

    Args:
        plan: This rank's batches of an epoch (the loader's pure plan function).
        replayable: Whether ``plan`` may be called just for a digest (not with a user's
            sampler, which may be random and is asked for one pass per epoch).
    """

    plan: Callable[[int], list[np.ndarray]]
    replayable: bool
    epoch: int = field(default=0, init=False)
    position: int = field(default=0, init=False)  # first batch of the current epoch not yet delivered
    done: set[int] = field(default_factory=set, init=False)  # later batches already delivered (ordered=False)
    token: int | None = field(default=None, init=False)  # the iteration that advances the position
    _chosen: bool = field(default=False, init=False)  # set_epoch or load since the last finished epoch
    _resume: Resume | None = field(default=None, init=False)  # a loaded position, until its epoch starts
    _playing: _Plan | None = field(default=None, init=False)  # the plan played (or loaded) last

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch the next iteration plays. Another epoch than the current one starts
        at its first batch: a position loaded or reached in the current one is dropped."""
        if epoch != self.epoch:
            self._resume = None
            self.position, self.done = 0, set()
        self.epoch = epoch
        self._chosen = True

    def loaded(self, epoch: int) -> Resume | None:
        """The loaded position, if there is one for ``epoch``."""
        return self._resume if self._resume is not None and self._resume.epoch == epoch else None

    def take_resume(self, epoch: int) -> Resume | None:
        """The loaded position, if it is ``epoch``'s; either way it is used up."""
        resume, self._resume = self._resume, None
        return resume if resume is not None and resume.epoch == epoch else None

    def begin(self, epoch: int, batches: list[np.ndarray], token: int, start: int, done: frozenset[int]) -> None:
        """An iteration (``token``) plays ``epoch`` from ``start``, less ``done``."""
        self._playing = _Plan(epoch, batches)  # its digest is computed when state_dict() asks
        self.token = token
        self.position, self.done = start, set(done)

    def owns(self, epoch: int, token: int) -> bool:
        """Whether the iteration ``token`` of ``epoch`` is still the one that advances the position."""
        return self.epoch == epoch and token == self.token

    def delivered(self, seq: int) -> None:
        """Batch ``seq`` reached the training loop (only then: one that raised is played again on resume)."""
        self.done.add(seq)
        while self.position in self.done:
            self.done.discard(self.position)
            self.position += 1

    def finished(self, epoch: int) -> None:
        """The iteration of ``epoch`` played to its end: the next one plays the following epoch,
        unless another was chosen meanwhile."""
        if not self._chosen or self.epoch == epoch:
            self.epoch = epoch + 1
        self.position, self.done = 0, set()
        self._chosen = False

    # ---- state_dict -----------------------------------------------------------------
    def state_dict(self, identity: Mapping[str, Any]) -> dict:
        """The position as a small JSON-serializable dict (see RemoteLoader.state_dict)."""
        return {
            "version": STATE_VERSION,
            "seed": identity["seed"],
            "epoch": self.epoch,
            "position": self.position,
            "delivered_after": sorted(self.done),
            "num_samples": identity["num_samples"],
            "batch_size": identity["batch_size"],
            "world_size": identity["world_size"],
            "rank": identity["rank"],
            "shuffle": identity["shuffle"],
            "drop_last": identity["drop_last"],
            "plan": self._plan_digest(self.epoch),
        }

    def load(self, state: Any, identity: Mapping[str, Any], space: SampleSpace) -> None:
        """Continues at a saved position, after checking it belongs to this loader's plan.

        Raises TypeError for something else than a dict, ValueError for a state of another
        version or plan, or one whose position lies outside its epoch.
        """
        if not isinstance(state, dict):
            raise TypeError(f"load_state_dict expects the dict state_dict() returned, got {type(state).__name__}")
        state = json.loads(json.dumps(state))
        missing = [k for k in ("version", "epoch", "position") if k not in state]
        if missing or state.get("version") != STATE_VERSION:
            raise ValueError(
                f"not a RemoteLoader state_dict (version 1): missing {', '.join(missing) or 'nothing'}, "
                f"version {state.get('version')!r}"
            )
        # shuffle and drop_last are left to the plan's digest, which also sees when they change
        # nothing (a sampler; an even split); a state saved before the digest existed compares them.
        keys = ["seed", "num_samples", "batch_size", "world_size", "rank"]
        if not state.get("plan"):
            keys += [k for k in ("shuffle", "drop_last") if k in state]
        for key in keys:
            mine = identity[key]
            if state.get(key) != mine:
                raise ValueError(
                    f"state_dict has {key}={state.get(key)!r} but this loader has {key}={mine!r}; "
                    f"a resumed epoch is only identical with the same {key}"
                )
        epoch = check_int("state_dict epoch", state["epoch"], 0, UINT64)
        position = check_int("state_dict position", state["position"], 0)
        done = state.get("delivered_after", [])
        if not isinstance(done, list):
            raise ValueError(f"state_dict delivered_after={done!r}: expected a list of batch numbers")
        later = {check_int("state_dict delivered_after", seq, position + 1) for seq in done}
        batches = self.plan(epoch)
        if state.get("plan") and state["plan"] != digest(batches):
            differ = [
                f"{k}={state[k]!r} there" for k in ("shuffle", "drop_last") if k in state and state[k] != identity[k]
            ]
            why = ", ".join(differ) or "a different sampler, or one whose order is not a function of the epoch"
            raise ValueError(
                f"state_dict was saved from another plan of epoch {epoch} than this loader's ({why}); "
                f"resuming would play other batches"
            )
        if position > len(batches) or (later and max(later) >= len(batches)):
            raise ValueError(
                f"state_dict position={position} delivered_after={sorted(later)}: epoch {epoch} has "
                f"{len(batches)} batches here"
            )
        self.epoch, self.position, self.done = epoch, position, later
        self._resume = Resume(epoch, position, frozenset(later), batches, space)
        self._playing = _Plan(epoch, batches)  # for state_dict() before the first batch
        self._chosen = True

    def _plan_digest(self, epoch: int) -> str | None:
        """The digest of ``epoch``'s plan: the one last played, or, before it is, a fresh one
        (None with a sampler, which is not asked for a pass here: it may be random)."""
        if self._playing is None or self._playing.epoch != epoch:
            if not self.replayable:
                return None
            self._playing = _Plan(epoch, self.plan(epoch))
        if self._playing.digest is None:
            self._playing.digest = digest(self._playing.batches)
        return self._playing.digest
