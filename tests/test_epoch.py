"""client/epoch.py without servers: which epoch each pass plays, when an epoch ends, and which
saved positions resume which ranks (the plan is the real pure function over 22 samples)."""

from __future__ import annotations

import json

import pytest

from remoteloader.client import plan as plan_module
from remoteloader.client.epoch import EpochPosition, FrameworkEpochs
from remoteloader.client.ranks import Partition

N, BATCH = 22, 3
ONE = Partition(0, 1)


def make_plan(epoch: int, partition: Partition, **options) -> plan_module.EpochPlan:
    options = {"shuffle": True, "seed": 4, "drop_last": False, **options}
    return plan_module.make_plan(N, BATCH, epoch=epoch, rank=partition.rank, world_size=partition.world_size,
                                 **options)


def identity(**changes) -> dict:
    return {"seed": 4, "num_samples": N, "batch_size": BATCH, "shuffle": True, "drop_last": False, "ordered": True,
            **changes}


class Trainer:
    """Drives an EpochPosition the way RemoteLoader does: a pass starts, delivers, is left or ends."""

    def __init__(self, position: EpochPosition | None = None, partition: Partition = ONE):
        self.position = position or EpochPosition(make_plan, replayable=True)
        self.partition = partition
        self.played = None

    def start(self):
        played = self.position.next_pass(self.partition)
        assert self.played is None or played.token > self.played.token, "each pass gets a token of its own"
        self.played = played
        self.position.begin(played)
        return played

    def play(self, batches: int | None = None) -> tuple[int, list[list[int]]]:
        """Starts a pass and delivers ``batches`` of it (all: to its end); returns its epoch and ids."""
        played = self.start()
        todo = list(range(played.start, len(played.plan.batches)))
        if batches is not None:
            todo = todo[:batches]
        for seq in todo:
            self.position.delivered(self.played, seq)
        if batches is None and not todo:
            self.position.ended(self.played)
        return played.epoch, [played.plan.batches[s].tolist() for s in todo]

    def state(self) -> dict:
        return json.loads(json.dumps(self.position.state_dict(identity(), self.partition)))


def test_every_pass_plays_the_next_epoch_whether_it_ends_or_is_left():
    t = Trainer()
    assert t.play()[0] == 0
    assert t.play(2)[0] == 1  # left after two batches (a break, or a framework that stops early)
    assert t.play(0)[0] == 2  # left before its first delivery, but started
    epoch, ids = t.play()
    assert epoch == 3 and ids == [b.tolist() for b in make_plan(3, ONE).batches]
    orders = {tuple(id for b in make_plan(e, ONE).batches for id in b.tolist()) for e in range(4)}
    assert len(orders) == 4, "epochs repeat an order"


def test_an_epoch_ends_with_its_last_batch_not_with_one_more_request():
    t = Trainer()
    t.play(len(make_plan(0, ONE).batches))  # stops at len() without asking for more
    assert (t.state()["epoch"], t.state()["position"]) == (1, 0)
    assert t.play()[0] == 1


def test_set_epoch_before_the_first_batch_wins():
    t = Trainer()
    t.play(1)
    t.position.set_epoch(7)
    assert t.play()[0] == 7
    t.position.set_epoch(7)  # the same epoch again: from its first batch
    epoch, ids = t.play()
    assert epoch == 7 and len(ids) == len(make_plan(7, ONE).batches)
    t.play(2)
    t.position.set_epoch(8)
    assert t.play()[0] == 8


def test_a_position_reached_is_saved_until_the_next_pass_starts():
    t = Trainer()
    t.position.set_epoch(2)
    t.play(3)
    assert (t.state()["epoch"], t.state()["position"]) == (2, 3)
    t.position.set_epoch(2)  # a checkpoint taken now still says where training stopped
    assert (t.state()["epoch"], t.state()["position"]) == (2, 3)
    epoch, ids = t.play()  # but this process plays epoch 2 from its start
    assert epoch == 2 and len(ids) == len(make_plan(2, ONE).batches)


@pytest.mark.parametrize("stopped", [0, 3, "end"])
def test_a_resumed_run_plays_what_the_uninterrupted_one_would(stopped):
    full = Trainer()
    uninterrupted = [full.play() for _ in range(3)]
    first = Trainer()
    first.play()
    n = len(make_plan(1, ONE).batches)
    k = n if stopped == "end" else stopped
    first.play(k)
    saved = first.state()
    resumed = Trainer()
    resumed.position.load(saved, identity(), None, ONE)
    rest = [resumed.play(), resumed.play()]
    expected = [(1, uninterrupted[1][1][k:]), uninterrupted[2]] if k < n else uninterrupted[2:] + [full.play()]
    assert rest == expected


def test_set_epoch_keeps_a_loaded_position_of_its_epoch_only():
    t = Trainer()
    t.position.set_epoch(1)
    t.play(4)
    saved = t.state()
    r = Trainer()
    r.position.load(saved, identity(), None, ONE)
    r.position.set_epoch(1)  # the usual loop's set_epoch, or a framework's hook
    epoch, ids = r.play()
    assert epoch == 1 and ids == [b.tolist() for b in make_plan(1, ONE).batches[4:]]
    r.position.load(saved, identity(), None, ONE)
    r.position.set_epoch(2)
    epoch, ids = r.play()
    assert epoch == 2 and len(ids) == len(make_plan(2, ONE).batches)


class LoaderLike:
    """What a framework sees of RemoteLoader's epochs: ``batch_sampler`` (RemoteLoader's property)."""

    def __init__(self, position: EpochPosition):
        self.batch_sampler = FrameworkEpochs(position.set_epoch)

    def __iter__(self):
        return iter(())


def lightning_set_epoch(loader: object, epoch: int) -> None:
    """What Lightning 2.6 does at each epoch's start (``lightning.fabric.utilities.data._set_sampler_epoch``,
    here without importing Lightning: tests/test_frameworks.py runs the real one)."""
    for owner in (loader, getattr(loader, "batch_sampler", None)):
        sampler = getattr(owner, "sampler", None)
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)


def test_a_frameworks_set_epoch_reaches_the_position_with_its_rules():
    """Lightning calls set_epoch on ``batch_sampler.sampler`` at every epoch start (fit, validation):
    a run resumed from an end-of-epoch checkpoint (the next epoch at position 0, or no loader state
    at all) plays the epoch Lightning is at, and a loaded mid-epoch position of that epoch is kept."""
    fresh = Trainer()  # a fresh process resumed from an end-of-epoch checkpoint that holds no loader state
    lightning_set_epoch(LoaderLike(fresh.position), 2)
    assert fresh.play()[0] == 2
    t = Trainer()
    t.play()
    t.play(4)
    saved = t.state()
    resumed = Trainer()
    resumed.position.load(saved, identity(), None, ONE)
    lightning_set_epoch(LoaderLike(resumed.position), 1)
    epoch, ids = resumed.play()
    assert epoch == 1 and ids == [b.tolist() for b in make_plan(1, ONE).batches[4:]]
    # no sampler attribute: Lightning's checks that a loader shuffles (validation, overfit_batches) stop there
    assert not hasattr(LoaderLike(fresh.position), "sampler")


def test_one_ranks_ordered_position_resumes_every_rank_of_its_world():
    ranks = [Trainer(partition=Partition(r, 2)) for r in range(2)]
    for t in ranks:
        t.position.set_epoch(3)
        t.play(2)
    saved = ranks[0].state()
    assert saved["plan"] == ranks[1].state()["plan"], "the digest differs between ranks"
    for r in range(2):
        resumed = Trainer(partition=Partition(r, 2))
        resumed.position.load(saved, identity(), None, Partition(r, 2))
        epoch, ids = resumed.play()
        assert epoch == 3 and ids == [b.tolist() for b in make_plan(3, Partition(r, 2)).batches[2:]]


def test_an_unordered_position_resumes_only_its_own_rank():
    t = Trainer(partition=Partition(0, 2))
    t.play(1)
    saved = {**t.state(), "ordered": False}
    other = Trainer(partition=Partition(1, 2))
    with pytest.raises(ValueError, match="saved on rank 0 and this loader is rank 1: it was saved with ordered=False"):
        other.position.load(saved, identity(), None, Partition(1, 2))
    own = Trainer(partition=Partition(0, 2))
    own.position.load(saved, identity(), None, Partition(0, 2))


def test_a_state_of_another_world_waits_for_the_process_group_then_is_checked():
    ranks = [Trainer(partition=Partition(r, 2)) for r in range(2)]
    for t in ranks:
        t.play(2)
    saved = ranks[0].state()
    early = Trainer()  # made, and loaded, before torch.distributed is initialized
    early.position.load(saved, identity(), None, Partition(0, 1, known=False))
    assert early.state()["world_size"] == 2 and early.state()["position"] == 2
    early.partition = Partition(1, 2)  # the process group exists by the first batch
    epoch, ids = early.play()
    assert epoch == 0 and ids == [b.tolist() for b in make_plan(0, Partition(1, 2)).batches[2:]]

    never = Trainer(partition=Partition(0, 1, known=False))  # and never initializes it
    never.position.load(saved, identity(), None, Partition(0, 1, known=False))
    with pytest.raises(ValueError, match="world_size=2 but this loader has world_size=1 .torch.distributed is not"):
        never.play()
    known = Trainer()
    with pytest.raises(ValueError, match="world_size=2 but this loader has world_size=1"):
        known.position.load(saved, identity(), None, Partition(0, 1))


def test_a_state_of_another_plan_is_refused_on_any_rank():
    t = Trainer(partition=Partition(1, 2))
    t.play(1)
    saved = t.state()
    other = EpochPosition(lambda e, p: make_plan(e, p, shuffle=False), replayable=True)
    with pytest.raises(ValueError, match="shuffle=True there"):
        other.load(saved, identity(shuffle=False), None, Partition(0, 2))


# The digests an older remoteloader saved for epoch 0 of these 22 samples in batches of 3, seed 4, one rank
# (versions 1 and 2 hashed the ids; for one rank they agree), by shuffle: its plan.py computed them.
OLDER = {False: "820b057f952b954a", True: "0d115295246a8885"}


@pytest.mark.parametrize("version", [1, 2])
def test_states_of_older_versions_load_where_their_order_did_not_change(version):
    t = Trainer(EpochPosition(lambda e, p: make_plan(e, p, shuffle=False), replayable=True))
    t.play(2)
    older = {**t.state(), "version": version, "shuffle": False, "plan": OLDER[False]}
    if version == 1:
        del older["ordered"]
    r = Trainer(EpochPosition(lambda e, p: make_plan(e, p, shuffle=False), replayable=True))
    r.position.load(older, identity(shuffle=False), None, ONE)
    assert r.play()[1] == [b.tolist() for b in make_plan(0, ONE, shuffle=False).batches[2:]]
    with pytest.raises(ValueError, match="another plan"):  # one whose ids differ is still refused
        Trainer().position.load({**older, "plan": "0" * 16}, identity(shuffle=False), None, ONE)


@pytest.mark.parametrize("version", [1, 2])
def test_a_shuffled_state_of_an_older_version_is_refused_its_order_changed(version):
    t = Trainer()
    t.play(2)
    older = {**t.state(), "version": version, "plan": OLDER[True]}
    with pytest.raises(ValueError, match=rf"older remoteloader \(state version {version}\), whose shuffled order "
                                         r"this version changed: its plan digest no longer matches"):
        Trainer().position.load(older, identity(), None, ONE)
    without_digest = {k: v for k, v in older.items() if k != "plan"}  # older still: compared by its keys alone
    with pytest.raises(ValueError, match="whose shuffled order this version changed"):
        Trainer().position.load(without_digest, identity(), None, ONE)
