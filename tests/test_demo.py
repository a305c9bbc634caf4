"""The main job: ``remoteloader demo`` trains through two local servers and cleans up after itself."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

DEMO = [sys.executable, "-m", "remoteloader.server.cli", "demo"]


def server_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "remoteloader.server.cli serve"], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def test_demo_trains_prints_figures_and_stops_its_servers(tmp_path):
    before = server_pids()
    result = subprocess.run(DEMO + ["--epochs", "3", "--images-per-class", "48", "--classes", "3",
                                    "--batch-size", "24", "--image-size", "32", "--data", str(tmp_path)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)%\s+([\d.]+)$", result.stdout, re.M)
    assert len(rows) == 3, result.stdout
    losses = [float(r[3]) for r in rows]
    assert all(int(r[1]) > 0 for r in rows)  # images/s
    assert losses[-1] < losses[0], f"the loss should fall: {losses}"
    assert re.search(r"accuracy \(eval pipeline, \d+ images\)", result.stdout)
    assert server_pids() <= before, "the demo left loader servers running"


def test_ctrl_c_stops_the_demo_and_its_servers(tmp_path):
    before = server_pids()
    proc = subprocess.Popen(DEMO + ["--epochs", "50", "--images-per-class", "40", "--image-size", "32",
                                    "--data", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if line.lstrip().startswith("0 ") or time.monotonic() > deadline:  # first epoch done: training
            break
    started = server_pids() - before
    assert started, "the demo should have started loader servers"
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(60)
    finally:
        proc.kill()
    assert code == 130
    time.sleep(0.5)
    assert not (server_pids() & started), "Ctrl-C left loader servers running"
    for pid in started:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
