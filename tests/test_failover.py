"""Servers that die, drain, come back or stay away in the middle of an epoch.

The tests share one module-wide Cluster of real servers (see ``servers``) and kill, stop and
restart them. Servers are slowed with ``--max-rate`` so that orders are still in flight when
one dies; each test then checks the promise of the issue: the epoch is delivered exactly once
and bitwise as it would have been without the failure (the augmentation of a sample
depends on (seed, epoch, shard, index), never on which server rendered it), or, when no
server can serve a shard within ``reconnect_timeout``, a LoaderError names the server.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import pytest
import torch
from conftest import Cluster

from remoteloader.client import LoaderError, RemoteLoader, thread_receiver
from remoteloader.client import link as link_module
from remoteloader.tools.textures import make_imagefolder

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

SIZE = 32
BATCH = 8
EPOCH_SECONDS = 60  # bound on any one epoch, failures included


# ---- helpers ----------------------------------------------------------------------------
class Watchdog:
    """Closes ``loader`` if the block runs over ``seconds`` and then fails the test.

    The iterating thread sees the loader's I/O thread stop and raises, so a hang becomes a
    clear failure instead of running into the per-test timeout.
    """

    def __init__(self, loader: RemoteLoader, seconds: float = EPOCH_SECONDS, what: str = ""):
        self.loader = loader
        self.seconds = seconds
        self.what = what or f"the epoch did not finish within {seconds:g}s"
        self.fired = threading.Event()
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        self.fired.set()
        self.loader.close()

    def __enter__(self) -> Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()
        if self.fired.is_set():
            pytest.fail(f"{self.what} (the loader was closed)")


def take(iterator, n: int) -> list[tuple]:
    return [tuple(next(iterator)) for _ in range(n)]


def epoch(loader: RemoteLoader, number: int) -> list[tuple]:
    loader.set_epoch(number)
    with Watchdog(loader):
        return [tuple(b) for b in loader]


def all_ids(batches) -> list[int]:
    return torch.cat([ids for _, _, ids in batches]).tolist()


def assert_exactly_once(batches, total: int) -> None:
    ids = all_ids(batches)
    counts = collections.Counter(ids)
    twice = sorted(i for i, c in counts.items() if c > 1)
    missing = sorted(set(range(total)) - set(counts))
    assert not twice and not missing, (f"{len(twice)} sample(s) delivered more than once {twice[:10]}, "
                                       f"{len(missing)} never delivered {missing[:10]}")
    assert len(ids) == total


def assert_same_batches(got, expected) -> None:
    """Bitwise: same ids in the same order, same labels, same pixels."""
    assert len(got) == len(expected), f"{len(got)} batches, expected {len(expected)}"
    for n, ((x, y, i), (xe, ye, ie)) in enumerate(zip(got, expected)):
        assert torch.equal(i, ie), f"batch {n}: ids {i.tolist()} != {ie.tolist()}"
        assert torch.equal(y, ye), f"batch {n}: labels differ"
        assert torch.equal(x, xe), f"batch {n}: pixels differ"


def outstanding(loader: RemoteLoader, address: str) -> int:
    """Samples ordered from ``address`` and not received yet (from the public stats)."""
    s = loader.stats()["servers"][address]
    return s["orders"] * BATCH - s["samples"]  # single-shard data: one order per batch


def total_orders(loader: RemoteLoader) -> int:
    return sum(s["orders"] for s in loader.stats()["servers"].values())


def make_loader(target, **kwargs) -> RemoteLoader:
    """share=False: an epoch played again after its reference pass is decoded again, not joined
    from what the servers kept of it (server/sharing.py), so it still needs the servers these
    tests kill; failover of loaders that share: tests/test_sharing.py."""
    options = dict(batch_size=BATCH, image_size=SIZE, seed=3, drop_last=False, return_ids=True,
                   connect_timeout=20, reconnect_timeout=40, share=False)
    options.update(kwargs)
    return RemoteLoader(target, **options)


# ---- the servers --------------------------------------------------------------------------
# Starting a server costs seconds of CPU (it imports OpenCV and albumentations and starts a
# decode worker), so the module shares one Cluster; a test that kills or stops a server
# leaves it down, and a later test that needs it brings it back (same port) with ``up``.
A, B = 0, 1  # two different shards, one server each: 30 + 24 samples
REPLICAS = (2, 3, 4)  # three servers of one directory: one shard of 96 samples


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("failover-data")
    a = make_imagefolder(root / "a", ["cat", "dog", "owl"], 10, size=(48, 64), seed=1)
    b = make_imagefolder(root / "b", ["dog", "fox"], 12, size=(48, 64), seed=2)
    shared = make_imagefolder(root / "shared", ["a", "b", "c"], 32, size=(48, 64), seed=4)
    with Cluster(tmp_path_factory.mktemp("failover-logs")) as cluster:
        # Rate limits keep orders in flight long enough for a failure to hit some of them.
        first = cluster.add_many([a, b], "--max-rate", "150", wait=False)
        second = cluster.add_many([shared] * 3, "--max-rate", "80", wait=False)
        for i in first + second:
            cluster.wait_ready(i)
        assert first == [A, B] and tuple(second) == REPLICAS
        yield cluster


def up(cluster, indices, need: int | None = None) -> list[int]:
    """The servers of ``indices`` that run, after restarting dead ones until ``need`` of them run."""
    need = len(indices) if need is None else need
    alive = [i for i in indices if cluster.alive(i)]
    for i in indices:
        if len(alive) >= need:
            break
        if i not in alive:
            cluster.restart(i)
            alive.append(i)
    return sorted(alive)


def target(cluster, indices) -> str:
    return ",".join(cluster.address(i) for i in indices)


# ---- servers that join --------------------------------------------------------------------
def test_server_added_behind_the_address_joins_at_the_next_epoch(servers, monkeypatch):
    # A DNS name cannot gain addresses on 127.0.0.1, so the resolver is made to grow instead.
    up(servers, (A, B))
    listed = [servers.address(A)]
    real = thread_receiver.discover
    monkeypatch.setattr(thread_receiver, "discover", lambda address: real(list(listed)))
    with make_loader("loader.invalid:50051") as loader:
        assert loader.servers == [servers.address(A)]
        first = epoch(loader, 0)
        assert_exactly_once(first, 30)
        listed.append(servers.address(B))
        second = epoch(loader, 1)
        assert sorted(loader.servers) == sorted([servers.address(A), servers.address(B)])
        assert loader.num_samples == 54
        assert_exactly_once(second, 54)
        assert loader.stats()["servers"][servers.address(B)]["samples"] > 0


def test_a_resumed_epoch_plays_over_the_servers_it_was_planned_for(servers, monkeypatch):
    """A server joins between load_state_dict and the resumed epoch: global ids would name
    other samples over the grown catalog, so the epoch finishes as planned; it joins next."""
    up(servers, (A, B))
    listed = [servers.address(A)]
    real = thread_receiver.discover
    monkeypatch.setattr(thread_receiver, "discover", lambda address: real(list(listed)))
    with make_loader("loader.invalid:50051") as first:
        reference = epoch(first, 2)
        first.set_epoch(2)
        with Watchdog(first):
            it = iter(first)
            take(it, 2)
            state = first.state_dict()
            del it
    with make_loader("loader.invalid:50051") as resumed:
        resumed.load_state_dict(state)
        listed.append(servers.address(B))
        with Watchdog(resumed):
            rest = [tuple(b) for b in resumed]
        assert_same_batches(rest, reference[2:])
        assert resumed.num_samples == 30 and resumed.state_dict()["epoch"] == 3
        after = epoch(resumed, 3)
        assert resumed.num_samples == 54
        assert_exactly_once(after, 54)


# ---- a replica dies --------------------------------------------------------------------
def test_sigkill_of_one_of_three_replicas_mid_epoch_loses_and_duplicates_nothing(servers):
    up(servers, REPLICAS)
    with make_loader(target(servers, REPLICAS)) as loader:
        assert loader.num_samples == 96
        assert len(loader.catalog.shards) == 1, "three servers of one directory must be replicas of one shard"
        reference = epoch(loader, 0)
        assert_exactly_once(reference, 96)
        orders_before = total_orders(loader)

        loader.set_epoch(0)
        with Watchdog(loader):
            it = iter(loader)
            got = take(it, 2)
            # The replica with the most work outstanding: its orders must move to the others.
            victim = max(REPLICAS, key=lambda i: outstanding(loader, servers.address(i)))
            in_flight = outstanding(loader, servers.address(victim))
            assert servers.kill(victim) == -9
            got += [tuple(b) for b in it]
        stats = loader.stats()

    assert_exactly_once(got, 96)
    assert_same_batches(got, reference)
    dead = stats["servers"][servers.address(victim)]
    assert dead["failures"] == 1, dead
    if in_flight > 0:  # its unfinished orders were sent again, to another replica
        assert total_orders(loader) - orders_before > len(reference), stats["servers"]


def test_sigterm_drains_a_replica_mid_epoch_and_the_epoch_completes_once(servers):
    replicas = up(servers, REPLICAS, need=2)
    with make_loader(target(servers, replicas)) as loader:
        reference = epoch(loader, 1)
        loader.set_epoch(1)
        with Watchdog(loader):
            it = iter(loader)
            got = take(it, 2)
            victim = max(replicas, key=lambda i: outstanding(loader, servers.address(i)))
            code = servers.stop(victim)  # SIGTERM: finishes what it holds, refuses the rest
            got += [tuple(b) for b in it]
    assert code == 0, f"a draining server must exit 0, got {code}:\n{servers.stderr(victim)}"
    assert_exactly_once(got, 96)
    assert_same_batches(got, reference)


# ---- the only server of a shard dies ---------------------------------------------------
def test_server_of_a_unique_shard_restarted_on_its_port_resumes_the_epoch(servers):
    up(servers, (A, B))
    with make_loader(target(servers, (A, B)), reconnect_timeout=30) as loader:
        total = loader.num_samples
        assert total == 54 and len(loader.catalog.shards) == 2
        reference = epoch(loader, 0)
        victim = servers.address(B)

        restarted = threading.Event()
        errors = []

        def restart() -> None:
            try:
                time.sleep(0.5)  # the loader is waiting for the shard by now
                servers.restart(B)
                restarted.set()
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        loader.set_epoch(0)
        with Watchdog(loader):
            it = iter(loader)
            got = take(it, 2)
            assert servers.kill(B) == -9
            thread = threading.Thread(target=restart, daemon=True)
            thread.start()
            try:
                got += [tuple(b) for b in it]
            finally:
                thread.join(40)
                assert not errors, f"the server could not be restarted: {errors[0]!r}"
        assert restarted.is_set()
        stats = loader.stats()["servers"][victim]
        assert stats["reconnects"] >= 1 and stats["failures"] >= 1, stats
        assert stats["state"] == "up", stats
        assert_exactly_once(got, total)
        assert_same_batches(got, reference)
        # ... and the next epoch runs normally over both servers.
        assert_exactly_once(epoch(loader, 1), total)


def test_server_that_stays_down_raises_loader_error_naming_it(servers, monkeypatch, caplog):
    limit = 2.0
    bound = limit + 10
    monkeypatch.setattr(link_module, "STILL_DOWN_EVERY", 0.5)  # (10 s in use)
    caplog.set_level(logging.WARNING, logger="remoteloader.client")
    up(servers, (A, B))
    victim = servers.address(B)
    with make_loader(target(servers, (A, B)), reconnect_timeout=limit) as loader:
        loader.set_epoch(0)
        with Watchdog(loader, bound, f"no LoaderError within {bound:g}s of the only server of a shard dying "
                                     f"(reconnect_timeout={limit:g}s)"):
            it = iter(loader)
            take(it, 1)
            killed = time.monotonic()
            assert servers.kill(B) == -9
            with pytest.raises(LoaderError) as info:
                for _ in it:
                    pass
            waited = time.monotonic() - killed
        message = str(info.value)
        state = loader.stats()["servers"][victim]
    assert victim in message, message
    assert "reconnect_timeout" in message and "sample" in message, message
    assert waited >= limit * 0.95, f"gave up after {waited:.1f}s, before reconnect_timeout={limit:g}s"
    assert waited < bound, f"took {waited:.1f}s to give up with reconnect_timeout={limit:g}s"
    assert state["failures"] >= 1 and state["state"] in ("down", "dead"), state
    # Said at once, and again while it is retried: which server, what waits, for how long.
    said = [r.getMessage() for r in caplog.records]
    lost = [m for m in said if m.startswith(f"loader server {victim} failed")]
    assert lost and "no other server holds its shards" in lost[0] and "reconnecting to it for up to 2s" in lost[0], said
    still = [m for m in said if m.startswith(f"loader server {victim} still down after")]
    assert still and "refused the connection" in still[-1] and "reconnect_timeout=2s" in still[-1], said
