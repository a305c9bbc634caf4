"""The receiver process (``receiver="process"``, the default on CUDA), tested on the CPU.

The child process receives batches into shared slots; the training process lends each to
the user in its slot (up to two at a time) or copies it out, and gives the slot back. These
tests hold it to the thread receiver's contract (same batches, resume, failover, errors) and
check what is new: slots are never lost over abandoned epochs, the child's death is an error
and not a hang, and the child never outlives the training process.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing.connection import Connection

import numpy as np
import pytest
import torch
from conftest import outcome_in_fork, pixels_by_id

from remoteloader.client import LoaderError, RemoteLoader, process_receiver, thread_receiver
from remoteloader.tools.textures import make_imagefolder

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

SIZE = 32
BATCH = 8


@pytest.fixture(scope="module")
def shards(module_cluster, tmp_path_factory):
    """Two servers with their own shards, and two replicas of a third, larger one (for failover)."""
    roots = [make_imagefolder(tmp_path_factory.mktemp(f"recv{k}"), classes, per_class, size=(48, 64), seed=k)
             for k, (classes, per_class) in enumerate(((["cat", "dog"], 9), (["dog", "owl"], 9), (["ant"], 80)))]
    bad = roots[1] / "owl" / "broken.jpg"
    bad.write_bytes((roots[1] / "owl").glob("*.jpg").__next__().read_bytes()[:300])  # truncated
    first = module_cluster.add_many(roots + [roots[2]], "--max-rate", "400")[0]
    return module_cluster, first


def make(cluster, first, indices=(0, 1), **kwargs) -> RemoteLoader:
    options = dict(batch_size=BATCH, image_size=SIZE, connect_timeout=20, return_ids=True, on_error="skip")
    options.update(kwargs)
    return RemoteLoader([cluster.address(first + i) for i in indices], **options)


def epochs(loader, count: int) -> list[list[tuple]]:
    return [[tuple(b) for b in loader] for _ in range(count)]


def test_same_batches_labels_keys_and_failures_as_the_thread_receiver(shards):
    cluster, first = shards
    results, stats, keys, failures = {}, {}, {}, {}
    for mode in ("thread", "process"):
        seen = []
        with make(cluster, first, receiver=mode, on_error=seen.extend) as loader:
            assert loader.receiver == mode
            results[mode] = epochs(loader, 2)
            stats[mode] = loader.stats()
            keys[mode] = [loader.sample_key(i) for i in range(loader.num_samples)]
            failures[mode] = sorted((f.sample_id, f.key) for f in seen)
        after = loader.stats()  # closed: e.g. a summary printed after the with-block
        assert after["servers"] == stats[mode]["servers"] and after["images"] == stats[mode]["images"], mode
    for a, b in zip(results["thread"], results["process"]):
        assert len(a) == len(b) == 37 // BATCH
        for (ia, la, da), (ib, lb, db) in zip(a, b):
            assert torch.equal(da, db) and torch.equal(la, lb) and torch.equal(ia, ib)
    assert keys["thread"] == keys["process"] and "owl/broken.jpg" in keys["process"]
    assert failures["process"] == failures["thread"] and failures["process"], "the truncated file is reported"
    assert stats["process"]["images"] == stats["thread"]["images"] > 0
    assert set(stats["process"]["servers"]) == set(stats["thread"]["servers"])


def test_batches_are_lent_in_their_slots_to_a_loop_that_drops_them_and_copied_beyond_two(shards):
    """No copy out of the receiver's slots for a loop that holds a batch or two at a time; a
    loop that keeps its batches gets copies beyond two, so the receiver keeps slots to
    receive into, and every batch it kept stays whole."""
    cluster, first = shards
    with make(cluster, first, indices=(2,), receiver="process", prefetch=2) as loader:
        memory = loader._io.slot_memory  # the slots, 4 of them: prefetch + 2
        start, end = memory.ctypes.data, memory.ctypes.data + memory.nbytes

        def in_slots(images: torch.Tensor) -> bool:
            return start <= images.data_ptr() < end

        dropped = [in_slots(images) for images, _labels, _ids in loader]
        assert len(dropped) == 80 // BATCH and all(dropped), dropped
        loader.set_epoch(1)
        kept = [tuple(b) for b in loader]
        assert [in_slots(images) for images, _l, _i in kept] == [True, True] + [False] * (len(kept) - 2)
        loader.set_epoch(1)
        again = [tuple(b) for b in loader]  # (the epoch's two lent slots came back to the receiver)
        for (ia, la, da), (ib, lb, db) in zip(kept, again, strict=True):
            assert torch.equal(ia, ib) and torch.equal(la, lb) and torch.equal(da, db)


def test_abandoned_epochs_return_their_slots_and_resume_is_exact(shards):
    cluster, first = shards
    with make(cluster, first, receiver="process", prefetch=2) as loader:
        reference = pixels_by_id(epochs(loader, 1)[0])
        for _ in range(6):  # more abandoned epochs than the 4 slots
            loader.set_epoch(0)
            for _batch in loader:
                time.sleep(0.3)  # the next batches arrive here, in their slots, then are dropped
                break
        loader.set_epoch(0)
        it = iter(loader)
        head = [tuple(next(it)) for _ in range(2)]
        state = loader.state_dict()
        del it
    with make(cluster, first, receiver="process", prefetch=2) as resumed:
        resumed.load_state_dict(state)
        rest = [tuple(b) for b in resumed]
    got = pixels_by_id(head + rest)
    assert got.keys() == reference.keys()
    for i, image in reference.items():
        assert np.array_equal(got[i], image), f"sample {i} differs after resume"


def test_a_killed_replica_fails_over_and_its_warning_reaches_this_process(shards, caplog):
    cluster, first = shards
    owners = (first + 2, first + 3)  # one shard, two servers
    # share=False: epoch 0 played again is decoded again, not joined from what the servers kept
    # of the reference pass (server/sharing.py), so the victim still holds work when it dies.
    with make(cluster, first, indices=(2, 3), receiver="process", shuffle=False, share=False) as loader:
        reference = pixels_by_id(epochs(loader, 1)[0])
        loader.set_epoch(0)
        caplog.set_level(logging.WARNING, logger="remoteloader.client")
        it = iter(loader)
        got = [tuple(next(it))]
        servers = loader.stats()["servers"]
        victim = max(owners, key=lambda i: servers[cluster.address(i)]["orders"] * BATCH
                     - servers[cluster.address(i)]["samples"])
        s = servers[cluster.address(victim)]
        in_flight = s["orders"] * BATCH - s["samples"]
        cluster.kill(victim)
        got += [tuple(b) for b in it]
    try:
        delivered = pixels_by_id(got)
        assert delivered.keys() == reference.keys()
        assert all(np.array_equal(delivered[i], reference[i]) for i in reference)
        if in_flight:  # its orders went back to the queue, and the child's warning came here
            assert any(cluster.address(victim) in r.getMessage() and r.levelno == logging.WARNING
                       for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        cluster.restart(victim)


def test_death_of_the_receiver_process_is_an_error_not_a_hang(shards):
    cluster, first = shards
    with make(cluster, first, receiver="process") as loader:
        it = iter(loader)
        next(it)
        loader._io.process.kill()
        started = time.monotonic()
        with pytest.raises(LoaderError, match="receiver process exited"):
            for _ in it:
                pass
        assert time.monotonic() - started < 10
        with pytest.raises(LoaderError, match="receiver process exited"):
            iter(loader)


def test_close_ends_the_receiver_process(shards):
    cluster, first = shards
    loader = make(cluster, first, receiver="process")
    child = loader._io.process
    assert child.poll() is None
    loader.close()
    assert child.poll() is not None


def bounded(function, seconds: float):
    """function()'s result (or error), or a test failure if it has not returned within ``seconds``."""
    outcome = []

    def run() -> None:
        try:
            outcome.append((True, function()))
        except BaseException as exc:
            outcome.append((False, exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"no result within {seconds:g}s"
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def test_a_closed_loaders_late_reader_never_reads_the_next_loaders_link(shards, monkeypatch):
    """Each socket read of the receiver thread is delayed, as on a busy machine where it is
    descheduled just before reading: close() must not close (and free for reuse) the fd
    that read is about to use, or the next loader's link may get that number and lose
    its messages to the old reader (seen in CI as a next loader hanging in discovery)."""
    cluster, first = shards
    original = Connection._recv
    if "read" not in inspect.signature(original).parameters:
        pytest.skip("multiprocessing.connection reads differently in this Python")

    def late_read(fd, n):
        if threading.current_thread().name == "remoteloader-receiver":
            time.sleep(0.3)
        return os.read(fd, n)

    monkeypatch.setattr(Connection, "_recv", lambda self, size, read=None: original(self, size, late_read))
    for _ in range(3):
        with bounded(lambda: make(cluster, first, indices=(0,), receiver="process"), 30) as loader:
            assert len(bounded(lambda: list(loader), 30)) == 18 // BATCH


def test_a_link_that_breaks_under_a_live_receiver_process_is_an_error_not_a_hang(shards):
    cluster, first = shards
    with make(cluster, first, receiver="process") as loader:
        loader._io._socket.shutdown(socket.SHUT_RD)  # nothing reaches this process; the child lives on
        started = time.monotonic()
        with pytest.raises(LoaderError, match="link broke"):
            bounded(lambda: next(iter(loader)), 30)
        assert time.monotonic() - started < 15
        assert loader._io.process.poll() is not None, "the unreachable child is stopped"


def test_a_close_that_runs_on_the_receiver_thread_still_frees_everything(shards, monkeypatch):
    """A dropped loader in a reference cycle is collected (and closed) on whichever thread
    collects: often its own receiver thread, which must not wait on itself, nor keep the
    shared memory (hundreds of MB) open for the life of the process."""
    cluster, first = shards
    loader = make(cluster, first, indices=(0,), receiver="process")
    io = loader._io

    class ClosingOnTheReader(process_receiver.Future):
        def set_result(self, value):
            super().set_result(value)
            if threading.current_thread() is io._reader:
                loader.close()

    monkeypatch.setattr(process_receiver, "Future", ClosingOnTheReader)
    started = time.monotonic()
    bounded(loader.stats, 30)  # its reply's set_result closes the loader on the reader thread
    io._reader.join(10)
    assert not io._reader.is_alive() and time.monotonic() - started < 10
    assert io.process.poll() is not None and io.slots.fd == -1 and io._socket.fileno() == -1


def test_the_receiver_process_dies_with_the_training_process(shards, tmp_path):
    cluster, first = shards
    script = textwrap.dedent(f"""
        import os, sys
        from remoteloader.client import RemoteLoader
        loader = RemoteLoader({cluster.address(first)!r}, batch_size=4, image_size=16, receiver="process")
        next(iter(loader))
        print(loader._io.process.pid, flush=True)
        os._exit(0)  # no close(): as if killed
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    child = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"receiver process {child} outlived its training process")


def test_bad_arguments_and_unreachable_servers_are_clear(shards):
    cluster, first = shards
    with pytest.raises(ValueError, match="receiver='pipe'"):
        make(cluster, first, receiver="pipe")
    with pytest.raises(ConnectionError, match="127.0.0.1:9 refused the connection: nothing listens there"):
        RemoteLoader("127.0.0.1:9", connect_timeout=1, receiver="process")  # (before the receiver process starts)


def test_a_new_iteration_frees_what_the_superseded_one_held(shards):
    cluster, first = shards
    with make(cluster, first, receiver="process", prefetch=2) as loader:
        expected = sum(len(b[2]) for b in loader)
        for _ in range(4):  # 4 slots: any leak would leave the last epoch without one
            old = iter(loader)
            next(old)
            time.sleep(0.3)  # its next batches reach this process and wait there
            unstarted = iter(loader)  # supersedes `old`; never started itself
            del unstarted
        got = sum(len(b[2]) for b in loader)
        assert got == expected
        with pytest.raises(RuntimeError, match="superseded"):
            for _ in old:
                pass


def test_a_loader_made_in_a_thread_that_ended_keeps_its_receiver(shards):
    cluster, first = shards
    made = []
    maker = threading.Thread(target=lambda: made.append(make(cluster, first, indices=(2,), receiver="process")))
    maker.start()
    maker.join()
    with made[0] as loader:
        time.sleep(1.5)  # the child must not take the thread's end for its parent's
        assert sum(len(b[2]) for b in loader) == loader.num_samples == 80


def test_a_server_that_cannot_serve_and_joins_later_is_left_out_with_a_warning(shards, tmp_path, monkeypatch,
                                                                                caplog):
    """A server that joins behind the address but cannot serve this loader (here: too small
    an image size) is left out with a warning, epoch after epoch, while servers that can
    still join. (The thread receiver, whose resolver a test can grow; the process receiver
    runs the same Receiver and takes the same catalog from the loader.)"""
    cluster, first = shards
    small = cluster.add(make_imagefolder(tmp_path / "small", ["zebra"], 4, size=(32, 32), seed=9),
                        "--max-image-size", "16")
    listed = [cluster.address(first)]
    real = thread_receiver.discover
    monkeypatch.setattr(thread_receiver, "discover", lambda address: real(list(listed)))
    try:
        with make(cluster, first, receiver="thread") as loader:
            before = [tuple(b) for b in loader]
            listed.append(cluster.address(small))
            caplog.set_level(logging.WARNING, logger="remoteloader.client")
            for _ in range(2):
                loader.set_epoch(0)
                again = [tuple(b) for b in loader]
                assert len(again) == len(before)
                for (xa, la, ia), (xb, lb, ib) in zip(before, again):
                    assert torch.equal(ia, ib) and torch.equal(la, lb) and torch.equal(xa, xb)
            warned = [r.getMessage() for r in caplog.records if cluster.address(small) in r.getMessage()]
            assert len(warned) == 2 and "image_size=32x32" in warned[0], warned
            assert cluster.address(small) not in loader.servers
            listed.append(cluster.address(first + 1))  # one that can serve still joins
            joined = [tuple(b) for b in loader]
            assert loader.num_samples == 37 and len(joined) == 37 // BATCH
            assert sorted(loader.servers) == sorted([cluster.address(first), cluster.address(first + 1)])
            assert loader._io.engine.assembler.space is loader.catalog  # the epoch ran on the loader's catalog
    finally:
        cluster.stop(small)


def test_a_copy_of_the_loader_in_another_process_closes_nothing(shards):
    """After os.fork() the child holds a copy of the loader without its threads (or its
    receiver process): closing that copy, e.g. from the exit hook, must do nothing rather
    than wait on threads that are not there. (Forking a process with live gRPC threads is
    itself unsafe, so the fork is simulated: the copy is told it belongs to another pid.)"""
    cluster, first = shards
    with make(cluster, first, receiver="thread") as loader:
        next(iter(loader))
        loader._pid = os.getpid() + 1_000_000  # as seen from a forked child
        started = time.monotonic()
        loader.close()
        assert time.monotonic() - started < 0.5
        assert loader._io.stopped() is None, "the parent's I/O thread must be left alone"
        loader._pid = os.getpid()
        assert sum(len(b[1]) for b in loader) > 0  # still the parent's working loader


def test_a_loader_used_in_a_forked_child_is_a_clear_error_and_the_parents_link_is_untouched(shards):
    """A forked child (a DataLoader worker holding the loader) must not talk on the link:
    its replies would go to the parent's reader, and nothing would answer the child."""
    cluster, first = shards
    with make(cluster, first, receiver="process") as loader:
        expected = len(list(loader))
        outcome = outcome_in_fork(lambda: next(iter(loader)))
        assert outcome.startswith("RuntimeError") and "fork" in outcome, outcome
        assert loader._io.stopped() is None
        assert len(list(loader)) == expected  # the parent's loader still works


def test_a_module_in_the_script_folder_cannot_shadow_the_receivers_imports(shards, tmp_path):
    cluster, first = shards
    (tmp_path / "types.py").write_text("raise ImportError('the script folder shadowed the stdlib types')\n")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        from remoteloader.client import RemoteLoader
        with RemoteLoader({cluster.address(first)!r}, batch_size=4, image_size=16, receiver="process") as loader:
            print(len(next(iter(loader))[1]), flush=True)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "4", out.stderr


def test_the_receiver_imports_what_the_parent_imports_from_pythonpath_ahead_of_site_packages(shards, tmp_path):
    """A PYTHONPATH folder shadows site-packages in the training process, so it must in the
    receiver process too: a GPU image with an older grpc in site-packages and a newer one on
    PYTHONPATH once made the receiver refuse the generated code the parent had accepted.
    Here PYTHONPATH holds a grpc that notes the (isolated) receiver imported it, then loads
    the installed one in its place."""
    cluster, first = shards
    shim = tmp_path / "pythonpath" / "grpc"
    shim.mkdir(parents=True)
    marker = tmp_path / "receiver-imported-the-shim"
    (shim / "__init__.py").write_text(textwrap.dedent(f"""
        import importlib.machinery, importlib.util, sys
        if sys.flags.isolated:  # the receiver runs with -I, the training script without
            open({str(marker)!r}, "w").close()
        spec = importlib.machinery.PathFinder.find_spec(
            "grpc", [p for p in sys.path if not p.startswith({str(shim.parent)!r})])
        module = importlib.util.module_from_spec(spec)
        sys.modules["grpc"] = module
        spec.loader.exec_module(module)
    """))
    script = textwrap.dedent(f"""
        from remoteloader.client import RemoteLoader
        with RemoteLoader({cluster.address(first)!r}, batch_size=4, image_size=16, receiver="process") as loader:
            print(len(next(iter(loader))[1]), flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=str(shim.parent))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "4", out.stderr
    assert marker.exists(), "the receiver process imported grpc from site-packages, not from PYTHONPATH"


@pytest.mark.parametrize("receiver", ["thread", "process"])
def test_a_script_that_never_closes_its_loader_exits_promptly(shards, receiver):
    cluster, first = shards
    # The script's last exit hook runs after the loader's (registered on import, after it): by
    # then the loader must be closed, within the bound. The interpreter's teardown after it is
    # left out of the bound, which a loaded machine stretches (the whole exit took 5.1 s once,
    # beside two other test workers); with the loader closed, nothing of the loader's waits there.
    script = textwrap.dedent(f"""
        import atexit, time
        ended = []
        atexit.register(lambda: print(f"closed={{loader._closed}} in {{time.monotonic() - ended[0]:.3f}}", flush=True))
        from remoteloader.client import RemoteLoader
        loader = RemoteLoader({cluster.address(first)!r}, batch_size=4, image_size=16, receiver={receiver!r})
        next(iter(loader))
        print("ready", flush=True)
        ended.append(time.monotonic())
    """)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout.readline().strip() == "ready", process.stderr.read()
        assert process.wait(timeout=60) == 0, process.stderr.read()
        exited = process.stdout.read().strip()
        assert exited.startswith("closed=True in "), ("not closed at exit", exited, process.stderr.read())
        assert float(exited.split()[-1]) < 5, "exit waited on the loader's timeouts"
    finally:
        process.kill()
