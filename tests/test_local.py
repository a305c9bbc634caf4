"""LocalServer, the launcher of the demo and the benchmarks: it runs the flags it is given
and leaves nothing behind."""

from __future__ import annotations

import os
import time

import pytest

from remoteloader.server.local import LocalServer
from remoteloader.server.synthetic import make_imagefolder

pytestmark = pytest.mark.timeout(120)


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
    assert server.stop() == 0  # SIGTERM: drained, exit 0
    deadline = time.monotonic() + 5  # SIGKILLed workers take a moment to go
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group_members(pgid) == []
    assert "listening on" in log.read_text() and "listening on" in server.log_tail()
    assert server.stop() == 0  # idempotent
