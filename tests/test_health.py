"""Health when decoding stops: server/health.py, the worker pool's watchdog, and the client giving
up on a server that takes orders and never delivers (client/link.py), with real servers whose
decode workers are stopped with SIGSTOP (as `kill -STOP` would)."""

from __future__ import annotations

import os
import pathlib
import signal
import threading
import time

import grpc
import pytest
from conftest import ANY_PORT
from grpc_health.v1 import health_pb2, health_pb2_grpc

from remoteloader.client import LoaderError, RemoteLoader
from remoteloader.protos import SERVICE
from remoteloader.tools.textures import make_imagefolder

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def decode_workers(server_pid: int) -> list[int]:
    """The pids of a server's decode workers: the children of its forkserver."""
    parents: dict[int, int] = {}
    commands: dict[int, bytes] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            commands[int(entry.name)] = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    forkservers = [p for p, parent in parents.items() if parent == server_pid and b"forkserver" in commands[p]]
    return sorted(p for p, parent in parents.items() if parent in forkservers)


def stop_all(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)


@pytest.fixture
def data(tmp_path):
    return make_imagefolder(tmp_path / "data", ["ant", "bee"], 12, size=(48, 48), seed=3)


class HealthLog(threading.Thread):
    """Asks the Loader service's health on a port every 0.2 s, keeping (seconds, status)."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port = port
        self.seen: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not self.stop.wait(0.2):
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=2).status
                except grpc.RpcError:
                    status = -1
                self.seen.append((time.monotonic() - started, status))

    def wait_for_last(self, status: int, timeout: float) -> bool:
        """Whether the latest answer is ``status``, waiting up to ``timeout`` for one that is."""
        deadline = time.monotonic() + timeout
        while not (self.seen and self.seen[-1][1] == status):
            if time.monotonic() >= deadline or not self.is_alive():
                return False
            time.sleep(0.05)
        return True


def test_stopped_decode_workers_make_health_not_serving_then_are_replaced_and_the_epoch_completes(
    cluster, data, run_bounded
):
    i = cluster.add(data, "--workers", "2", "--worker-timeout", "6", "--health-port", ANY_PORT)
    workers = decode_workers(cluster.pid(i))
    assert len(workers) == 2, workers
    watch = HealthLog(cluster.health_port(i))
    watch.start()
    try:
        stop_all(workers)
        with RemoteLoader(cluster.address(i), batch_size=4, image_size=32, return_ids=True, drop_last=False,
                          connect_timeout=20) as loader:
            ids = [i for _images, _labels, batch in run_bounded(loader, 60) for i in batch.tolist()]
        # Health looks at the workers every second: it says SERVING again once it has looked.
        back = watch.wait_for_last(SERVING, 20)
    finally:
        watch.stop.set()
        watch.join(5)
    assert sorted(ids) == list(range(24)), "the epoch lost or repeated samples"
    statuses = [status for _, status in watch.seen]
    assert NOT_SERVING in statuses, f"health never said NOT_SERVING while both workers were stopped: {watch.seen}"
    assert back, f"health did not come back once the workers were replaced: {watch.seen}"
    went_down = next(t for t, status in watch.seen if status == NOT_SERVING)
    assert went_down < 6, f"NOT_SERVING only after {went_down:.1f}s (a third of --worker-timeout is 2 s)"
    log = cluster.stderr(i)
    assert log.count("without answering (worker_timeout=6s") == 2, log
    assert set(decode_workers(cluster.pid(i))).isdisjoint(workers), "the stopped workers are still there"


def test_a_server_that_takes_orders_and_never_delivers_is_given_up_with_its_name(cluster, data, run_bounded):
    i = cluster.add(data, "--workers", "1", "--worker-timeout", "600")
    stop_all(decode_workers(cluster.pid(i)))
    address = cluster.address(i)
    started = time.monotonic()
    with RemoteLoader(address, batch_size=4, image_size=32, connect_timeout=20, progress_timeout=2,
                      reconnect_timeout=3) as loader:
        with pytest.raises(LoaderError) as error:
            run_bounded(loader, 40)
    message = str(error.value)
    assert address in message and "took orders but delivered nothing" in message, message
    # At its first stall after reconnect_timeout: within progress_timeout + reconnect_timeout + progress_timeout.
    assert time.monotonic() - started < 2 + 3 + 2 + 6, message


def test_work_that_stalls_two_workers_fails_its_samples_and_the_pool_lives_on(tmp_path):
    """A worker silent on its work is replaced and the work goes to the next one; silent there
    too, its samples fail with the reason (e.g. a file that wedges the decoder), and the pool
    serves the next work."""
    import asyncio

    import numpy as np

    from remoteloader.server.catalog import Catalog
    from remoteloader.server.fair_queue import Job
    from remoteloader.server.formats import open_shards
    from remoteloader.server.order_samples import Samples
    from remoteloader.server.pipelines import PipelineSpec
    from remoteloader.server.render import Renderer
    from remoteloader.server.shared_memory import Arena
    from remoteloader.server.worker_pool import WorkerPool

    (shard,) = open_shards([str(make_imagefolder(tmp_path / "data", ["a"], 4, size=(64, 64)))])
    catalog = Catalog([shard])
    spec = PipelineSpec("eval", 32, 32)

    async def run():
        arena = Arena(2, 4 * 32 * 32 * 3)
        pool = WorkerPool(arena, workers=1, allow_custom=False, max_pixels=10**8, worker_timeout=1.0)
        try:
            pool.start()
            renderer = Renderer(catalog, pool, None)
            first = [w.process.pid for w in pool._workers]
            stop_all(first)
            pending = renderer.render(spec, Samples.of_shard(catalog, shard, np.arange(4)), [0, 1, 2, 3], 0, Job())
            while [w.process.pid for w in pool._workers] == first:  # replaced after 1 s of silence
                await asyncio.sleep(0.05)
            assert pool.silent_for() < 1.0
            stop_all([w.process.pid for w in pool._workers])  # and the next one stalls on it too
            stalled = await asyncio.wait_for(pending, 10)
            # The next work, on the worker started in its place: 1 s is too short for a fresh worker's
            # first task on a loaded machine (CI failed so: a third and fourth "stall"), and the test
            # of timeouts is over.
            pool.worker_timeout = 30.0
            samples = Samples.of_shard(catalog, shard, np.arange(4))
            served = await asyncio.wait_for(renderer.render(spec, samples, [0, 1, 2, 3], 1, Job()), 30)
            return stalled, served, pool.stalls, pool.workers
        finally:
            pool.close()
            arena.close()

    stalled, served, stalls, workers = asyncio.run(run())
    assert [pos for pos, _ in stalled.errors] == [0, 1, 2, 3]
    assert all("decode stalled" in reason and "twice" in reason for _, reason in stalled.errors), stalled.errors
    assert served.errors == [] and stalls == 2 and workers == 1
