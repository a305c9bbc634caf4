"""`remoteloader bench`: what servers deliver to this host, what limits it, and whether a
training step would wait for data; and the likely limit each epoch's stats() line names."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import pytest

from remoteloader.client import bottleneck
from remoteloader.tools import bench as remoteloader_bench
from remoteloader.tools import shaped_links
from remoteloader.tools.textures import make_imagefolder

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def two_servers(module_cluster, tmp_path_factory):
    """Two servers of one decode worker, each on 120 JPEGs of its own."""
    root = tmp_path_factory.mktemp("bench-data")
    datas = [make_imagefolder(root / f"part{i}", ["a", "b", "c"], 40, size=(160, 200), seed=i) for i in range(2)]
    module_cluster.add_many(datas)
    return module_cluster


def bench(cluster, tmp_path, *flags: str) -> tuple[dict, str]:
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "remoteloader.tools.cli", "bench", cluster.target, "--image-size", "64",
         "--batch-size", "16", "--seconds", "2", "--warmup", "1", "--json", str(out), *flags],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text()), result.stdout


def test_bench_measures_each_server_and_all_together_and_names_their_limit(two_servers, tmp_path):
    report, printed = bench(two_servers, tmp_path, "--step-time", "1000", "--plot", str(tmp_path / "bench.png"))
    runs = report["runs"]
    assert [len(r["servers"]) for r in runs] == [1, 2]
    assert runs[-1]["servers"] == two_servers.addresses
    for run in runs:
        assert run["images"] > 0 and run["images_per_s"] > 0 and run["host_cpu_ms"] > 0
        assert run["limit"] in (bottleneck.SERVERS, bottleneck.READING, bottleneck.RECEIVING)  # (no link here)
        assert set(run["per_server"]) == set(run["servers"])
        for server in run["per_server"].values():
            assert server["workers"] == 1  # as the servers were started (Describe)
            assert 0 < server["workers_busy"] <= 1  # their decode workers worked
            assert server["images_per_s"] > 0 and server["busy_ms"] > 0
            assert server["limit"] == bottleneck.server_limit(server["workers_busy"], run["receiver_busy"], True)
        # what each server delivered adds up to what the loop read (orders complete around the edges)
        total = sum(s["images_per_s"] for s in run["per_server"].values())
        assert total == pytest.approx(run["images_per_s"], rel=0.35)
    # a step of 1000 s per batch is never waiting for these servers: not input-bound, and fewer would do
    assert report["step_images_per_s"] == pytest.approx(16 / 1000)
    assert any("not input-bound" in line for line in report["verdict"])
    assert "not input-bound" in printed and "servers" in printed.splitlines()[0]
    assert (tmp_path / "bench.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize(("clip_frames", "pool"), [(0, "AdaptiveAvgPool2d"), (4, "AdaptiveAvgPool3d")])
def test_a_models_step_is_timed(tmp_path, monkeypatch, clip_frames, pool):
    module = f"tinymodel{clip_frames}"  # (one module per case: an imported one is kept in sys.modules)
    (tmp_path / f"{module}.py").write_text(  # (a video model takes [B, 3, T, H, W]: a 2-D pool refuses it)
        "import torch\n"
        "def make():\n"
        f"    return torch.nn.Sequential(torch.nn.{pool}(1), torch.nn.Flatten(), torch.nn.Linear(3, 2))\n"
    )
    monkeypatch.chdir(tmp_path)  # where bench looks for the model's module, as from a training script's folder
    args = argparse.Namespace(step_time=None, model=f"{module}:make", device="cpu", batch_size=32, image_size=32,
                              clip_frames=clip_frames)
    rate, how = remoteloader_bench.step_images_per_s(args)
    assert rate > 0 and f"{module}:make on cpu" in how and "batch of 32" in how


def run_of(rates: list[float], limit: str) -> remoteloader_bench.Run:
    per_server = {f"s{i}:1": {"images_per_s": r} for i, r in enumerate(rates)}
    return remoteloader_bench.Run(servers=list(per_server), seconds=10, images=int(10 * sum(rates)),
                                  images_per_s=sum(rates), mb_per_s=sum(rates) * 0.15, host_cpu_ms=0.1,
                                  receiver_busy=0.9 if limit == bottleneck.RECEIVING else 0.2, limit=limit,
                                  per_server=per_server)


@pytest.mark.parametrize(
    ("limit", "consumed", "says", "never"),
    [
        (bottleneck.SERVERS, 3000, ["input-bound", "wait for data 67%", "About 4 more server(s) of this kind would"],
         ["not input-bound"]),
        (bottleneck.LINKS, 3000, ["About 4 more server(s) of this kind behind links of their own"], []),
        (bottleneck.RECEIVING, 3000, ["more servers would not help", "receiver='process'"], ["more server(s)"]),
        (bottleneck.SERVERS, 400, ["not input-bound (150% to spare)", "About 1 such server(s) would keep up"], []),
        (bottleneck.SERVERS, None, ["Give --step-time or --model"], ["input-bound"]),
    ],
)
def test_the_verdict_says_whether_the_job_is_input_bound_and_what_closes_the_gap(limit, consumed, says, never):
    verdict = " ".join(remoteloader_bench.verdict([run_of([500], limit), run_of([500, 500], limit)], consumed))
    for text in says:
        assert text in verdict, verdict
    for text in never:
        assert text not in verdict, verdict


def test_the_verdict_does_not_ask_for_more_servers_when_more_gave_nothing():
    """Two same-host servers slower than one: more of them would not help, whatever the average says."""
    runs = [run_of([900], bottleneck.SERVERS), run_of([420, 430], bottleneck.SERVERS)]
    verdict = " ".join(remoteloader_bench.verdict(runs, 3000))
    assert "More servers did not add throughput here (1 gave 900 images/s, 2 gave 850)" in verdict, verdict
    assert "more server(s) of this kind" not in verdict, verdict
    # Where they did add, the gain measured per added server sizes the advice: (3000 - 1500) / 600.
    runs = [run_of([900], bottleneck.SERVERS), run_of([750, 750], bottleneck.SERVERS)]
    verdict = " ".join(remoteloader_bench.verdict(runs, 3000))
    assert "About 3 more server(s) of this kind would close the gap (600 images/s each" in verdict, verdict


def test_bench_refuses_bad_flags_before_connecting_and_an_unreachable_server_in_one_line(tmp_path):
    parser = argparse.ArgumentParser()
    remoteloader_bench.add_arguments(parser)
    for flags, says in (
        (["--step-time", "0"], "--step-time=0.0: expected seconds per step, > 0"),
        (["--seconds", "-1"], "--seconds=-1.0: expected seconds, > 0"),
        (["--model", "nocolon"], "expected MODULE:FUNCTION"),
    ):
        with pytest.raises(SystemExit, match=re.escape(says)):
            remoteloader_bench.check(parser.parse_args(["127.0.0.1:1", *flags]))
    result = subprocess.run([sys.executable, "-m", "remoteloader.tools.cli", "bench", "127.0.0.1:1",
                             "--connect-timeout", "2"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode != 0 and "127.0.0.1:1" in result.stderr, result.stderr  # nothing listens there
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("busy", "receiver", "waited", "limit", "shared"),
    [
        ((0.95, 0.9), 0.2, 0.5, bottleneck.SERVERS, (False, False)),
        ((0.3, 0.2), 0.2, 0.5, bottleneck.LINKS, (False, False)),
        ((0.95, 0.9), 0.95, 0.5, bottleneck.RECEIVING, (False, False)),
        ((0.95, 0.9), 0.2, 0.01, bottleneck.STEP, (False, False)),
        ((0.95, 0.2), 0.2, 0.5, bottleneck.SERVERS, (False, False)),  # the busy server delivered most images
        # Idle workers and no link (same host, shared memory): reading or the main process, not "links".
        ((0.3, 0.2), 0.2, 0.5, bottleneck.READING, (True, True)),
        ((0.3, 0.2), 0.2, 0.5, bottleneck.READING, (True, False)),  # the same-host one delivered most
        ((0.3, 0.2), 0.2, 0.5, bottleneck.LINKS, (False, True)),
    ],
)
def test_the_likely_limit_rule(busy, receiver, waited, limit, shared):
    images = (300, 100)
    spans = {f"s{i}": bottleneck.ServerSpan(images=n, bytes=n * 1000, workers_busy=b, shared=h)
             for i, (n, b, h) in enumerate(zip(images, busy, shared))}
    assert bottleneck.likely_limit(spans, receiver, waited) == limit
    assert bottleneck.likely_limit(spans, receiver, waited, seconds=60) == limit
    # shorter than the servers' busy window: the input's part cannot be told (the step's can)
    short = bottleneck.likely_limit(spans, receiver, waited, seconds=2)
    assert short == (bottleneck.STEP if limit == bottleneck.STEP else bottleneck.UNKNOWN)


def test_spans_average_the_servers_busy_share_over_their_images():
    before = {"a": {"samples": 100, "bytes": 10, "busy_samples": 50.0}}
    after = {"a": {"samples": 300, "bytes": 30, "busy_samples": 230.0, "shared_memory": False},
             "b": {"samples": 10, "bytes": 5, "busy_samples": 2.0, "shared_memory": True}}  # joined since
    spans = bottleneck.spans(before, after)
    assert spans["a"] == bottleneck.ServerSpan(images=200, bytes=20, workers_busy=0.9, shared=False)
    assert spans["b"] == bottleneck.ServerSpan(images=10, bytes=5, workers_busy=0.2, shared=True)


def test_each_epoch_line_names_its_likely_limit(two_servers, run_bounded):
    from remoteloader.client import RemoteLoader

    with RemoteLoader(two_servers.addresses, batch_size=16, image_size=64) as loader:
        run_bounded(loader)  # as fast as the servers go: the input is the limit
        loader.set_epoch(1)
        run_bounded(loader, on_batch=lambda *_: time.sleep(0.3))  # a slow step: the servers wait for it
        fast, slow = loader.stats()["epochs"]
    assert fast["wait_fraction"] > bottleneck.WAITED and fast["limit"] != bottleneck.STEP
    assert set(fast["workers_busy"]) == set(two_servers.addresses)
    assert all(0 < busy <= 1 for busy in fast["workers_busy"].values())
    assert 0 < fast["receiver_busy"] < 1.5
    assert slow["wait_fraction"] < bottleneck.WAITED and slow["limit"] == bottleneck.STEP


def test_the_receivers_cpu_leaves_out_the_time_of_children_this_process_reaped():
    # A thread's /proc stat carries its process's reaped children's CPU time: counted per
    # grpc thread, a training script that had run (and reaped) servers read as hundreds of
    # receiver CPU seconds per second.
    from remoteloader.client import cpu

    burn = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    with open("/proc/self/comm") as f:
        every_thread = (f.read().strip(),)  # threads inherit the process's name
    own = time.process_time()  # this process's threads, without its children
    assert cpu.process_cpu(os.getpid()) >= own + 0.9  # the process's figure does count them
    assert cpu.named_threads_cpu(every_thread) <= own + 0.1


def test_bench_names_a_slow_link_as_the_limit(tmp_path):
    reason = shaped_links.available()
    if reason:
        pytest.skip(f"shaped links cannot be made here: {reason}")
    data = make_imagefolder(tmp_path / "data", ["a", "b"], 60, size=(160, 200))
    out = tmp_path / "bench.json"
    # 64-px crops are 12 KB: 20 Mbit/s carries about 200 a second, a fraction of what one decode
    # worker renders, so the worker waits for the link and says so
    code = shaped_links.main(["--rates", "20", "--data", str(data), "--bench", "--image-size", "64",
                              "--batch-size", "16", "--seconds", "2", "--warmup", "1.5", "--json", str(out)])
    assert code == 0
    (run,) = json.loads(out.read_text())["runs"]
    (server,) = run["per_server"].values()
    assert run["limit"] == bottleneck.LINKS and server["limit"] == bottleneck.LINKS
    assert 0 < server["workers_busy"] < bottleneck.BUSY
    assert 0.5 < run["mb_per_s"] * 8 < 20 * 1.1  # what the link carried, within its rate


def test_bench_reads_as_a_named_job_and_says_how_much_of_it_came_from_shared_decodes(two_servers, tmp_path):
    report, printed = bench(two_servers, tmp_path, "--job", "bench-probe", "--share")
    last = report["runs"][-1]
    assert f"shared decodes: {last['images_shared']} of the {last['images']} images" in printed
    for i in range(len(two_servers)):  # each server was told the job's name, and that it may share (no ", exclusive")
        two_servers.wait_for_log(i, r"job bench-probe \(weight 1 a stream\)$", 10)
