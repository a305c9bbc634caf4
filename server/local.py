"""Loader servers as local subprocesses: for the demo, benchmarks and tests.

``LocalServer`` runs exactly the command a container runs (``remoteloader-server``
flags), waits for its ``listening on`` line and stops it with SIGTERM (drain) on exit,
then SIGKILLs its process group (workers included); on Linux the server also gets
SIGTERM if its parent dies without stopping it. It runs the flags it is given: inherited
``REMOTELOADER_*`` variables are dropped (pass ``env`` to set some).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque

from remoteloader.server.config import bracketed


_READY = re.compile(r"listening on (\S+):(\d+)")


def die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies, even by SIGKILL (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class LocalServer:
    """A ``remoteloader-server`` subprocess.

    Args:
        data: Shard paths (``--data``).
        port: Port to bind; 0 picks a free one (``.port`` says which once started).
        args: Further server flags, e.g. ``["--workers", "2"]``.
        env: Extra environment variables.
        log_path: Also write the server's output to this file.
    """

    def __init__(self, data: list[str] | str, port: int = 0, host: str = "127.0.0.1",
                 args: list[str] | None = None, env: dict[str, str] | None = None, log_path=None):
        self.data = [str(data)] if isinstance(data, (str, os.PathLike)) else [str(d) for d in data]
        self.host = host
        self.port = port
        self.args = list(args or [])
        self.env = env
        self.process: subprocess.Popen | None = None
        self.log: deque[str] = deque(maxlen=400)
        self.log_path = log_path
        self._ready = threading.Event()

    @property
    def command(self) -> list[str]:
        data = ["--data", *self.data] if self.data else []
        return [sys.executable, "-m", "remoteloader.server.cli", "serve", *data,
                "--host", self.host, "--port", str(self.port), *self.args]

    @property
    def address(self) -> str:
        return f"{bracketed(self.host)}:{self.port}"

    def start(self, timeout: float = 60.0) -> "LocalServer":
        env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTELOADER_")}
        env.update(self.env or {}, PYTHONUNBUFFERED="1")
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
        log_file = open(self.log_path, "a") if self.log_path else None
        try:
            for line in process.stdout:
                self.log.append(line.rstrip())
                if log_file is not None:
                    log_file.write(line)
                    log_file.flush()
                match = _READY.search(line)
                if match and not self._ready.is_set():
                    self.port = int(match.group(2))
                    self._ready.set()
        finally:
            if log_file is not None:
                log_file.close()

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(list(self.log)[-lines:])

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (graceful drain), then SIGKILL of its process group; returns the exit code.

        The server is reaped only after its group was killed, so the group id cannot have
        been reused by anything else when ``killpg`` runs.
        """
        if self.process is None or self.process.returncode is not None:
            return None if self.process is None else self.process.returncode
        try:
            self.process.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    break
            except ChildProcessError:
                break
            time.sleep(0.05)
        self.kill()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL of the server's process group (its own session: only what it started), then reap."""
        if self.process is not None and self.process.returncode is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.process.wait(10)

    def __enter__(self) -> "LocalServer":
        return self if self.process is not None and self.process.poll() is None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
