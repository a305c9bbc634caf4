"""Loader servers as local subprocesses: the one launcher of the demo, the benchmarks and the tests.

``LocalServer`` runs exactly the command a container runs (``remoteloader-server`` flags),
waits for its ``listening on HOST:PORT`` line and stops it with SIGTERM (drain), then
SIGKILLs its process group: its decode workers and forkserver go with it. It can start again
on the ports it bound first. Each run is a ``ServerProcess``, which keeps what the server wrote
(and appends it to a log file when given one).

Ports are best left to the server: it binds them itself (``--port 0``, ``--metrics-port -1``,
``--health-port -1``) and says which it got, in its readiness line and the INFO lines logged
before it; a port picked here and released for the server to bind could be taken in between.

Rules every run follows, so that a server behaves the same whoever starts it:
    * It runs the flags it is given: inherited ``REMOTELOADER_*`` variables are dropped
      (pass ``env`` to set some); its output is unbuffered, so lines arrive as written.
    * It has its own session: the group id is the server's pid, and only what it started is
      in that group. The group is SIGKILLed before the server is reaped, so that id cannot
      have been reused by then.
    * On Linux, a ``LocalServer``'s server also gets SIGTERM if its parent dies without
      stopping it.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time

from remoteloader.server.config import (
    ANY_PORT,
    CANNOT_BIND,
    ENV_PREFIX,
    HEALTH_ON,
    LISTENING,
    METRICS_ON,
    bracketed,
)
from remoteloader.tools import signals

READY = re.compile(re.escape(LISTENING) + r" (\S+):(\d+)")  # the server's readiness line: the address it bound
# Logged (at INFO) before it, when on: the ports it bound for metrics and for health alone.
METRICS = re.compile(re.escape(METRICS_ON) + r" http://\S+:(\d+)/metrics")
HEALTH = re.compile(re.escape(HEALTH_ON) + r" \S+:(\d+)")
MAX_LINES = 100_000  # output lines kept per run (all of them are in the log file)


class ServerStartError(RuntimeError):
    """A server exited, or said nothing of listening, before its ready timeout; carries its output."""


def server_command() -> list[str]:
    """``remoteloader-server`` run by this interpreter (no console script needed)."""
    return [sys.executable, "-m", "remoteloader.server.cli"]


def _last_value(args: list[str], flag: str) -> str | None:
    """The value of the last ``flag VALUE`` or ``flag=VALUE`` in ``args`` (None: not there)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without its ``REMOTELOADER_*`` settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env.update(extra or {})
    env.update(PYTHONUNBUFFERED="1", NO_ALBUMENTATIONS_UPDATE="1")  # no update check over the network
    return env


class ServerProcess:
    """One run of a server command, in its own session, its output collected by a thread.

    Args:
        argv: The command: ``LocalServer.command``, or one wrapped in another (``unshare ...``).
        log_path: Also append the output to this file.
        env: Variables set on top of ``server_env()``.
        die_with_parent: SIGTERM to the server if this process dies (Linux). It costs a
            fork instead of a vfork: leave it off where other threads may hold locks (gRPC).
    """

    def __init__(
        self,
        argv: list[str],
        log_path: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        die_with_parent: bool = False,
    ):
        self.argv = list(argv)
        self.log_path = log_path
        self.host: str | None = None  # from the ready line
        self.port: int | None = None
        self.metrics_port: int | None = None  # from the lines before it (None: off, or logged below INFO)
        self.health_port: int | None = None
        self._lines: collections.deque[str] = collections.deque(maxlen=MAX_LINES)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._eof = threading.Event()
        # stderr carries the server's log; stdout joins it, so nothing it writes is lost.
        self.popen = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=server_env(env),
            text=True,
            errors="replace",
            start_new_session=True,
            preexec_fn=signals.die_with_parent if die_with_parent else None,
        )
        threading.Thread(target=self._read, name=f"server-output-{self.popen.pid}", daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        log = open(self.log_path, "a", encoding="utf-8") if self.log_path else None
        try:
            for raw in self.popen.stdout:
                line = raw.rstrip("\n")
                if log is not None:
                    log.write(line + "\n")
                    log.flush()
                with self._lock:
                    self._lines.append(line)
                if self._ready.is_set():
                    continue
                if match := METRICS.search(line):
                    self.metrics_port = int(match.group(1))
                elif match := HEALTH.search(line):
                    self.health_port = int(match.group(1))
                elif match := READY.search(line):
                    self.host, self.port = match.group(1), int(match.group(2))
                    self._ready.set()
        finally:
            if log is not None:
                log.close()
            self._eof.set()

    # ---- looking ----------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        """The exit code once the server has exited, else None. It is not reaped before
        ``reap()``, so that its group id stays its own until the group is killed."""
        if self.popen.returncode is not None:
            return self.popen.returncode
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped already
            return self.popen.poll()
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def alive(self) -> bool:
        return self.poll() is None

    def stderr(self) -> str:
        """All it wrote so far (the server writes only to stderr; stdout would be here too)."""
        with self._lock:
            return "\n".join(self._lines)

    def log_tail(self, lines: int = 30) -> str:
        with self._lock:
            return "\n".join(list(self._lines)[-lines:])

    def wait_ready(self, timeout: float) -> int:
        """Waits for the ``listening on`` line; returns the port (``metrics_port`` and
        ``health_port`` are known by then).

        Raises:
            ServerStartError: It exited first, or the line did not come within ``timeout`` (the
                server is left running: the caller decides).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._ready.wait(0.05):
                assert self.port is not None
                return self.port
            if not self.alive():
                self._eof.wait(2)  # let the reader collect the last lines
                if self._ready.is_set():
                    assert self.port is not None
                    return self.port
                raise ServerStartError(
                    f"server exited with code {self.poll()} before listening "
                    f"({' '.join(self.argv)}); stderr:\n{self.stderr()}"
                )
        raise ServerStartError(
            f"server pid {self.pid} did not log 'listening on' within {timeout:g}s "
            f"({' '.join(self.argv)}); stderr:\n{self.stderr()}"
        )

    def wait_for_log(self, pattern: str, timeout: float) -> re.Match:
        """The first line matching ``pattern``, waiting up to ``timeout`` for it (TimeoutError)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                for line in self._lines:
                    match = regex.search(line)
                    if match:
                        return match
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"server pid {self.pid} logged nothing matching {pattern!r} within {timeout:g}s; "
                    f"stderr:\n{self.stderr()}"
                )
            time.sleep(0.05)

    # ---- stopping ---------------------------------------------------------------------
    def signal(self, sig: int, group: bool = False) -> None:
        """Sends ``sig`` to the server, or to its whole process group; nothing once it is reaped."""
        if self.popen.returncode is not None:
            return
        try:
            if group:
                os.killpg(self.pid, sig)  # start_new_session: the group id is the server's pid
            else:
                self.popen.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout: float) -> int | None:
        """The exit code once the server exits within ``timeout``, else None (see ``poll``)."""
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return code

    def reap(self) -> None:
        """SIGKILLs what is left of the process group (decode workers, the forkserver), then
        collects the server's exit status and closes the pipe (idempotent)."""
        if self.popen.returncode is None:
            self.signal(signal.SIGKILL, group=True)
            self.signal(signal.SIGKILL)
            self.popen.wait(10)
        self._eof.wait(5)
        if self.popen.stdout is not None and self._eof.is_set():
            self.popen.stdout.close()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (the server drains), then ``reap()``; returns the exit code, or None when it
        did not exit within ``timeout`` and was killed."""
        if self.popen.returncode is not None:
            return self.popen.returncode
        self.signal(signal.SIGTERM)
        code = self.wait(timeout)
        self.reap()
        return code

    def kill(self) -> int | None:
        """SIGKILL to the server and its group at once (a crashed host); returns the exit code."""
        self.reap()
        return self.popen.returncode


class LocalServer:
    """A ``remoteloader-server`` on this machine: its data, flags and ports, and its current run.

    Args:
        data: Shard paths (``--data``); none for e.g. ``--synthetic N`` in ``args``.
        port: Port to bind; 0 picks a free one (``.port`` says which once started, and
            ``restart`` binds it again).
        host: ``--host``, and the host of ``.address``.
        args: Further server flags, e.g. ``["--workers", "2"]`` (after ``--host`` and ``--port``,
            so they win). ``--metrics-port -1`` and ``--health-port -1`` have it bind free ones:
            ``.metrics_port`` and ``.health_port`` say which once started (they are read from its
            INFO lines), and ``restart`` binds them again.
        env: Extra environment variables (``server_env``).
        log_path: Also append every run's output to this file.
        die_with_parent: The server gets SIGTERM if this process dies (Linux); see ``ServerProcess``.
    """

    def __init__(
        self,
        data: list[str] | str | os.PathLike,
        port: int = 0,
        host: str = "127.0.0.1",
        args: list[str] | tuple[str, ...] | None = None,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        die_with_parent: bool = True,
    ):
        self.data = [str(data)] if isinstance(data, (str, os.PathLike)) else [str(d) for d in data]
        self.host = host
        self.port = port
        self.args = [str(a) for a in args or []]
        self.env = env
        self.log_path = log_path
        self.die_with_parent = die_with_parent
        self.metrics_port: int | None = None  # bound by the first run (None: off)
        self.health_port: int | None = None
        self.process: ServerProcess | None = None  # the current run
        self.incarnations: list[ServerProcess] = []  # every run, oldest first

    @property
    def command(self) -> list[str]:
        data = ["--data", *self.data] if self.data else []
        # After a first run, the ports it bound (the last flag wins): a restart keeps them.
        bound = [
            arg
            for flag, port in (("--metrics-port", self.metrics_port), ("--health-port", self.health_port))
            if port
            for arg in (flag, str(port))
        ]
        return [*server_command(), *data, "--host", self.host, "--port", str(self.port), *self.args, *bound]

    @property
    def address(self) -> str:
        if not self.port:
            raise RuntimeError(f"the server on {self.data} has not bound a port yet (port=0 picks one when it starts)")
        return f"{bracketed(self.host)}:{self.port}"

    def launch(self) -> ServerProcess:
        """Starts a run without waiting for it (``wait_ready``)."""
        self.process = ServerProcess(self.command, self.log_path, self.env, self.die_with_parent)
        self.incarnations.append(self.process)
        return self.process

    def wait_ready(self, timeout: float = 60.0) -> int:
        """Waits for the current run's ``listening on`` line; returns the port it bound.

        Raises:
            ServerStartError: See ``ServerProcess.wait_ready``; also when it bound another port
                than the one it was given.
        """
        if self.process is None:
            raise RuntimeError(f"the server on {self.data} was never started")
        port = self.process.wait_ready(timeout)
        if self.port and port != self.port:
            raise ServerStartError(f"the server on {self.data} listens on port {port}, expected {self.port}")
        self.port = port
        self.metrics_port = self.process.metrics_port or self.metrics_port
        self.health_port = self.process.health_port or self.health_port
        for flag, bound in (("--metrics-port", self.metrics_port), ("--health-port", self.health_port)):
            if _last_value(self.args, flag) == str(ANY_PORT) and not bound:
                raise ServerStartError(
                    f"the server on {self.data} was asked for a free {flag} and logged none "
                    f"(the port is read from its INFO lines: not with --log-level WARNING or above)"
                )
        return port

    def start(self, timeout: float = 60.0) -> LocalServer:
        """Starts the server and waits until it listens; a server that does not is killed
        (ServerStartError, with its output)."""
        process = self.launch()
        try:
            self.wait_ready(timeout)
        except BaseException:
            process.kill()
            raise
        return self

    def restart(self, timeout: float = 60.0) -> None:
        """Starts the server again on the ports it bound, with the same data and flags (stopping
        it first if it runs). A port just released may take a moment to be bindable again:
        "cannot bind" is retried until ``timeout``."""
        if self.process is not None:
            self.process.stop()
        deadline = time.monotonic() + timeout
        while True:
            process = self.launch()
            try:
                self.wait_ready(max(1.0, deadline - time.monotonic()))
                return
            except ServerStartError:
                process.reap()
                if CANNOT_BIND not in process.stderr() or time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (graceful drain), then SIGKILL of its process group; returns the exit code
        (None if it never started). Idempotent."""
        if self.process is None:
            return None
        self.process.stop(timeout)
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL of the server's process group, then reap."""
        if self.process is not None:
            self.process.kill()

    def log_tail(self, lines: int = 30) -> str:
        return "" if self.process is None else self.process.log_tail(lines)

    def __enter__(self) -> LocalServer:
        return self if self.process is not None and self.process.alive() else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
