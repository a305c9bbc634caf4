"""LocalServer, the one launcher of the demo, the benchmarks and the tests' Cluster: it runs the flags it
is given and leaves nothing behind."""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest

from remoteloader.tools.local import LocalServer
from remoteloader.tools.textures import make_imagefolder

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def test_stop_drains_and_leaves_no_process_of_its_group(tmp_path, monkeypatch):
    root = make_imagefolder(tmp_path / "data", ["a", "b"], 3, size=(32, 32), seed=0)
    monkeypatch.setenv("REMOTELOADER_WORKERS", "not-a-number")  # inherited: must not reach the server
    log = tmp_path / "server.log"
    server = LocalServer(root, args=["--workers", "2"], log_path=log).start()
    pgid = server.process.pid
    assert len(group_members(pgid)) >= 3, "the server and its two workers"
    # torch is installed here, and no server process loads it (albumentations would: 1.2 s and
    # its memory per process, for helpers a server never uses; server/pipelines.py).
    for pid in group_members(pgid):
        with open(f"/proc/{pid}/maps") as maps:
            assert "libtorch" not in maps.read(), f"server process {pid} loaded torch"
    assert server.stop() == 0  # SIGTERM: drained, exit 0
    deadline = time.monotonic() + 5  # SIGKILLed workers take a moment to go
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group_members(pgid) == []
    assert "listening on" in log.read_text() and "listening on" in server.log_tail()
    assert server.stop() == 0  # idempotent


def test_a_busy_metrics_port_is_a_one_line_error_and_stops_everything(tmp_path):
    """A busy --metrics-port ends start-up with one line naming it and exit 2: the gRPC server
    is stopped (left to the garbage collector, it printed a traceback from a closed event loop)
    and no decode worker is left running."""
    import signal
    import socket
    import subprocess

    root = make_imagefolder(tmp_path / "data", ["a", "b"], 2, size=(32, 32), seed=0)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        command = LocalServer(root, args=["--workers", "1", "--metrics-port", str(port)]).command
        env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTELOADER_")}
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                   start_new_session=True)
        try:
            _, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    assert process.returncode == 2, err
    assert f"cannot bind the metrics port {port} on 127.0.0.1: Address already in use" in err, err
    assert "Traceback" not in err and "Exception ignored" not in err and "listening on" not in err, err
    deadline = time.monotonic() + 5
    while group_members(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group_members(process.pid) == [], "decode workers outlived the server"


@pytest.mark.timeout(60)
def test_free_metrics_and_health_ports_are_bound_by_the_server_reported_and_kept_on_restart(tmp_path):
    """--metrics-port -1 and --health-port -1: the server binds free ports and logs them; the
    launcher reads them and a restart binds them again. 0 stays "off"; -2 names itself."""
    import urllib.request

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from remoteloader.server.config import ServerConfig

    for flag in ("metrics_port", "health_port"):
        with pytest.raises(ValueError, match=f"{flag}=-2: expected 0..65535 .* or -1 \\(a free port\\)"):
            ServerConfig(synthetic=8, **{flag: -2})
    root = make_imagefolder(tmp_path / "data", ["a", "b"], 2, size=(32, 32), seed=0)
    server = LocalServer(root, args=["--workers", "1", "--metrics-port", "-1", "--health-port", "-1"]).start()
    try:
        ports = (server.port, server.metrics_port, server.health_port)
        assert all(ports) and len(set(ports)) == 3, ports
        for _ in range(2):
            with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as reply:
                assert b"remoteloader_images_served_total" in reply.read()
            with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            server.restart()
            assert (server.port, server.metrics_port, server.health_port) == ports
    finally:
        server.stop()
    off = LocalServer([], args=["--synthetic", "8", "--workers", "1"]).start()
    try:
        assert (off.metrics_port, off.health_port) == (None, None)
        assert "Prometheus" not in off.process.stderr() and "gRPC health alone" not in off.process.stderr()
    finally:
        off.stop()


def test_stop_signals_repeated_as_the_server_exits_leave_exit_code_0():
    """A supervisor that sends SIGTERM again while the server exits (the race behind a flaky
    drain test): the process still ends with 0, not by the signal."""
    import signal
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTELOADER_")}
    command = [sys.executable, "-m", "remoteloader.server.cli", "--synthetic", "8", "--workers", "1", "--port", "0"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        while "listening on" not in line:
            line = process.stderr.readline()
            assert line, "the server ended before listening"
        process.send_signal(signal.SIGTERM)
        while "stopped" not in line:
            line = process.stderr.readline()
            assert line, "the server ended without saying it stopped"
        while process.poll() is None:  # again and again until it is gone
            process.send_signal(signal.SIGTERM)
            time.sleep(0.001)
    finally:
        if process.poll() is None:
            process.kill()
        process.stderr.close()
    assert process.wait() == 0


@pytest.mark.timeout(120)
def test_start_up_errors_say_what_is_wrong_in_one_line_of_ours(tmp_path):
    """A missing path, images without class folders and a busy port: one line, ours, naming
    the fix; no gRPC C-core log line before it. And --help shows no empty default."""
    import socket
    import subprocess
    import sys

    from remoteloader.tools.textures import encode_jpeg

    loose = tmp_path / "loose"
    loose.mkdir()
    for i in range(3):
        (loose / f"{i}.jpg").write_bytes(encode_jpeg(np.zeros((16, 16, 3), np.uint8), 90))
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTELOADER_")}
    server = [sys.executable, "-m", "remoteloader.server.cli"]

    def fails(*args: str) -> str:
        result = subprocess.run([*server, *args], capture_output=True, text=True, env=env, timeout=60)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("remoteloader-server: error: "), result.stderr
        return lines[0]

    assert "'" + str(tmp_path / "nowhere") + "' does not exist" in fails("--data", str(tmp_path / "nowhere"))
    line = fails("--data", str(loose), "--port", "0")
    assert "holds 3 image(s) directly, not in class folders" in line and "one folder per class" in line
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = fails("--synthetic", "8", "--workers", "1", "--port", str(port))
        assert f"cannot bind 127.0.0.1:{port}: the port is in use" in line and "--port" in line
        line = fails("--synthetic", "8", "--workers", "1", "--port", "0", "--health-port", str(port))
        assert f"cannot bind 127.0.0.1:{port}: the port is in use" in line and "--health-port" in line
    usage = subprocess.run([*server, "--help"], capture_output=True, text=True, env=env, timeout=60).stdout
    usage = " ".join(usage.split())
    assert "(default )" not in usage and not re.search(r"\(default[: ][^()]*\) \(default", usage), usage


@pytest.mark.parametrize("host, written", [("::1", "[::1]"), ("[::1]", "[::1]"), ("fd00::5", "[fd00::5]"),
                                           ("127.0.0.1", "127.0.0.1"), ("loaders.local", "loaders.local")])
def test_ipv6_hosts_are_bracketed_before_the_port(host, written):
    # (No server on ::1 here: network tests stay on 127.0.0.1.) gRPC reads the port after
    # the last colon: --host ::1 bound "::1:50051" as [::0.1.0.0]:443 before.
    from remoteloader.server.config import bracketed
    from remoteloader.tools import local

    assert bracketed(host) == written
    # What a server on it prints, LocalServer (the demo, the benchmarks) reads back and dials.
    match = local.READY.search(f"remoteloader-server listening on {bracketed(host)}:50051")
    assert match and match.group(1) == written and match.group(2) == "50051"
    assert local.LocalServer([], port=50051, host=host).address == f"{written}:50051"
