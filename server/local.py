"""Loader servers as local subprocesses: for the demo, benchmarks and tests.

``LocalServer`` runs exactly the command a container runs (``remoteloader-server``
flags), waits for its ``listening on`` line and stops it with SIGTERM (drain) on exit;
on Linux the server also gets SIGTERM if its parent dies without stopping it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque

from remoteloader.client.receiver import die_with_parent

_READY = re.compile(r"listening on (\S+):(\d+)")


class LocalServer:
    """A ``remoteloader-server`` subprocess.

    Args:
        data: Shard paths (``--data``).
        port: Port to bind; 0 picks a free one (``.port`` says which once started).
        args: Further server flags, e.g. ``["--workers", "2"]``.
        env: Extra environment variables.
    """

    def __init__(self, data: list[str] | str, port: int = 0, host: str = "127.0.0.1",
                 args: list[str] | None = None, env: dict[str, str] | None = None):
        self.data = [str(data)] if isinstance(data, (str, os.PathLike)) else [str(d) for d in data]
        self.host = host
        self.port = port
        self.args = list(args or [])
        self.env = env
        self.process: subprocess.Popen | None = None
        self.log: deque[str] = deque(maxlen=400)
        self._ready = threading.Event()

    @property
    def command(self) -> list[str]:
        data = ["--data", *self.data] if self.data else []
        return [sys.executable, "-m", "remoteloader.server.cli", "serve", *data,
                "--host", self.host, "--port", str(self.port), *self.args]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "LocalServer":
        env = {**os.environ, **(self.env or {}), "PYTHONUNBUFFERED": "1"}
        self._ready.clear()
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        env=env, text=True, start_new_session=True,
                                        preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
        threading.Thread(target=self._pump, args=(self.process,), daemon=True).start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self.process.poll() is not None or time.monotonic() > deadline:
                output = "\n".join(self.log)
                self.kill()
                raise RuntimeError(f"loader server {' '.join(self.command)} did not start:\n{output}")
        return self

    def _pump(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self.log.append(line.rstrip())
            match = _READY.search(line)
            if match and not self._ready.is_set():
                self.port = int(match.group(2))
                self._ready.set()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (graceful drain), then SIGKILL if it does not exit in time; returns the exit code."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.returncode

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(10)

    def __enter__(self) -> "LocalServer":
        return self if self.process is not None and self.process.poll() is None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
