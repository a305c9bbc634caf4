"""Shared fixtures: real loader-server subprocesses on 127.0.0.1 (``Cluster``) and small helpers.

A ``Cluster`` starts ``remoteloader-server`` processes, waits (bounded) for each one's
``listening on HOST:PORT`` line, and can stop (SIGTERM), kill (SIGKILL), restart (same
port, same data) and add servers. Every server runs in its own process group, so its
decode workers and forkserver go with it; whatever is still running at teardown is
terminated, then killed. When a test fails, the tail of every live server's stderr is
attached to the report.

Fixtures:
    cluster: a fresh, empty Cluster for one test (tests that stop, kill or restart servers).
    module_cluster: an empty Cluster shared by one test module (tests that only read from it).
    free_port: a function returning a TCP port on 127.0.0.1 that nothing listens on.
    run_bounded: a function running one epoch of a loader, failing the test if it hangs.
    eval_reference: a function computing, locally, what the "eval" preset makes of a file.
"""

from __future__ import annotations

import atexit
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref

import pytest

READY_TIMEOUT = 30.0  # seconds a server may take to index its data and bind
STOP_TIMEOUT = 30.0  # seconds a SIGTERMed server may take to drain and exit
DEFAULT_ARGS = ("--workers", "1", "--grace", "5", "--log-level", "INFO")
_LISTENING = re.compile(r"listening on (\S+):(\d+)")
_CANNOT_BIND = "cannot bind"

_LIVE: "weakref.WeakSet[Cluster]" = weakref.WeakSet()


def server_command() -> list[str]:
    """The ``remoteloader-server`` console script of this interpreter, or its equivalent."""
    script = pathlib.Path(sys.executable).with_name("remoteloader-server")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-c", "import sys; from remoteloader.server.cli import serve_main; sys.exit(serve_main())"]


def _server_env() -> dict[str, str]:
    # The caller's REMOTELOADER_* settings must not change the servers the tests start.
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTELOADER_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["NO_ALBUMENTATIONS_UPDATE"] = "1"
    return env


class ServerProcess:
    """One incarnation of a server process and what it wrote to stderr."""

    def __init__(self, argv: list[str], log_path: pathlib.Path):
        self.argv = argv
        self.log_path = log_path
        self.lines: list[str] = []
        self.port: int | None = None
        self.host: str | None = None
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._eof = threading.Event()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, env=_server_env(), start_new_session=True)
        self._reader = threading.Thread(target=self._read, name=f"server-stderr-{self.proc.pid}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log_path, "w", encoding="utf-8", errors="replace") as log:
            for raw in self.proc.stderr:
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                log.write(line + "\n")
                log.flush()
                with self._lock:
                    self.lines.append(line)
                if self.port is None:
                    match = _LISTENING.search(line)
                    if match:
                        self.host, self.port = match.group(1), int(match.group(2))
                        self._ready.set()
        self._eof.set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr(self) -> str:
        with self._lock:
            return "\n".join(self.lines)

    def wait_ready(self, timeout: float) -> int:
        """Waits for the ``listening on`` line; returns the port. Raises with the log if it never comes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._ready.wait(0.05):
                return self.port
            if self.proc.poll() is not None:
                self._eof.wait(2)  # let the reader collect the last lines
                if self._ready.is_set():
                    return self.port
                raise ServerStartError(f"server exited with code {self.proc.returncode} before listening "
                                       f"({' '.join(self.argv)}); stderr:\n{self.stderr()}")
        raise ServerStartError(f"server pid {self.pid} did not log 'listening on' within {timeout:g}s "
                               f"({' '.join(self.argv)}); stderr:\n{self.stderr()}")

    def wait_for_log(self, pattern: str, timeout: float) -> re.Match:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                for line in self.lines:
                    match = regex.search(line)
                    if match:
                        return match
            if time.monotonic() >= deadline:
                raise TimeoutError(f"server pid {self.pid} logged nothing matching {pattern!r} within {timeout:g}s; "
                                   f"stderr:\n{self.stderr()}")
            time.sleep(0.05)

    def signal(self, sig: int, group: bool = False) -> None:
        try:
            if group:
                os.killpg(self.pid, sig)  # start_new_session: the group id is the server's pid
            elif self.alive():
                self.proc.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def reap(self) -> None:
        """Kills whatever is left of the process group and closes the pipe (idempotent)."""
        if self.alive():
            self.signal(signal.SIGKILL)
            self.wait(10)
        self.signal(signal.SIGKILL, group=True)  # decode workers and the forkserver
        self._eof.wait(5)
        if self.proc.stderr is not None and self._eof.is_set():
            self.proc.stderr.close()


class ServerStartError(RuntimeError):
    pass


class Server:
    """A server slot of a Cluster: its data and arguments, and its current process."""

    def __init__(self, index: int, data: list[str], args: tuple[str, ...]):
        self.index = index
        self.data = data
        self.args = args
        self.port = 0  # 0 until the first start has bound one; then kept across restarts
        self.process: ServerProcess | None = None
        self.incarnations: list[ServerProcess] = []

    @property
    def address(self) -> str:
        if not self.port:
            raise RuntimeError(f"server {self.index} has not started yet")
        return f"127.0.0.1:{self.port}"


class Cluster:
    """N real loader servers on 127.0.0.1, each a subprocess with its own data.

    Args:
        log_dir: Where each server incarnation's stderr is also written.
        args: Extra server flags for every server (after the defaults, so they win).
        ready_timeout: Seconds each server may take to log ``listening on``.
    """

    def __init__(self, log_dir: pathlib.Path, args: tuple[str, ...] = (), ready_timeout: float = READY_TIMEOUT):
        self.log_dir = pathlib.Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.args = tuple(args)
        self.ready_timeout = ready_timeout
        self.servers: list[Server] = []
        self._closed = False
        _LIVE.add(self)

    # ---- starting ---------------------------------------------------------------------
    def add(self, data, *args: str, wait: bool = True) -> int:
        """Starts a server on ``data`` (a path or a list of paths) at a free port; returns its index."""
        return self.add_many([data], *args, wait=wait)[0]

    def add_many(self, datas: list, *args: str, wait: bool = True) -> list[int]:
        """Starts one server per entry of ``datas`` at once, then waits for all of them."""
        if self._closed:
            raise RuntimeError("cluster is closed")
        indices = []
        for data in datas:
            paths = [str(p) for p in (data if isinstance(data, (list, tuple)) else [data])]
            server = Server(len(self.servers), paths, self.args + tuple(args))
            self.servers.append(server)
            self._launch(server, port=0)
            indices.append(server.index)
        if wait:
            for i in indices:
                self.wait_ready(i)
        return indices

    def _launch(self, server: Server, port: int) -> ServerProcess:
        argv = server_command() + ["--data", *server.data, "--host", "127.0.0.1", "--port", str(port),
                                   *DEFAULT_ARGS, *server.args]
        log_path = self.log_dir / f"server{server.index}.{len(server.incarnations)}.log"
        process = ServerProcess(argv, log_path)
        server.process = process
        server.incarnations.append(process)
        return process

    def wait_ready(self, i: int, timeout: float | None = None) -> int:
        server = self.servers[i]
        port = server.process.wait_ready(self.ready_timeout if timeout is None else timeout)
        if server.port and port != server.port:
            raise ServerStartError(f"server {i} came back on port {port}, expected {server.port}")
        server.port = port
        return port

    def restart(self, i: int, timeout: float | None = None) -> None:
        """Starts server ``i`` again on the same port with the same data (stopping it first if it runs).

        A port just released may take a moment to be bindable again: retries "cannot bind"
        until the ready timeout.
        """
        server = self.servers[i]
        if server.process is not None and server.process.alive():
            self.stop(i)
        if server.process is not None:
            server.process.reap()
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            process = self._launch(server, port=server.port)
            try:
                self.wait_ready(i, timeout=max(1.0, deadline - time.monotonic()))
                return
            except ServerStartError:
                process.reap()
                if _CANNOT_BIND not in process.stderr() or time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    # ---- stopping ---------------------------------------------------------------------
    def stop(self, i: int, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM (the server drains), waits for the exit; returns the exit code.

        Raises TimeoutError (after killing it) if it does not exit within ``timeout``.
        """
        process = self._process(i)
        process.signal(signal.SIGTERM)
        code = process.wait(timeout)
        if code is None:
            process.reap()
            raise TimeoutError(f"server {i} (pid {process.pid}) did not exit within {timeout:g}s of SIGTERM; "
                               f"stderr:\n{process.stderr()}")
        process.reap()
        return code

    def kill(self, i: int) -> int:
        """SIGKILL to the server and its decode workers at once (a crashed host); returns the exit code."""
        process = self._process(i)
        process.signal(signal.SIGKILL, group=True)
        process.signal(signal.SIGKILL)
        code = process.wait(10)
        process.reap()
        return code

    def close(self) -> None:
        """Stops every server: SIGTERM to all, a bounded wait, then SIGKILL (idempotent, never raises)."""
        if self._closed:
            return
        self._closed = True
        processes = [p for s in self.servers for p in s.incarnations]
        for p in processes:
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in processes:
            p.wait(max(0.1, deadline - time.monotonic()))
        for p in processes:
            p.reap()
        _LIVE.discard(self)

    # ---- looking ----------------------------------------------------------------------
    def _process(self, i: int) -> ServerProcess:
        process = self.servers[i].process
        if process is None:
            raise RuntimeError(f"server {i} was never started")
        return process

    def address(self, i: int) -> str:
        return self.servers[i].address

    @property
    def addresses(self) -> list[str]:
        """Every server's address, in the order they were added (stopped ones included)."""
        return [s.address for s in self.servers]

    @property
    def target(self) -> str:
        """All addresses comma-separated, as RemoteLoader accepts them."""
        return ",".join(self.addresses)

    def alive(self, i: int) -> bool:
        process = self.servers[i].process
        return process is not None and process.alive()

    def pid(self, i: int) -> int:
        return self._process(i).pid

    def stderr(self, i: int) -> str:
        """What the current incarnation of server ``i`` wrote to stderr so far."""
        return self._process(i).stderr()

    def wait_for_log(self, i: int, pattern: str, timeout: float = 10.0) -> re.Match:
        return self._process(i).wait_for_log(pattern, timeout)

    def __len__(self) -> int:
        return len(self.servers)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def report(self, tail: int = 60) -> str:
        parts = []
        for s in self.servers:
            for n, p in enumerate(s.incarnations):
                state = "running" if p.alive() else f"exited {p.proc.returncode}"
                lines = p.stderr().splitlines()[-tail:]
                parts.append(f"--- server {s.index} incarnation {n} (pid {p.pid}, port {p.port}, {state}, "
                             f"data {s.data}) ---\n" + "\n".join(lines))
        return "\n".join(parts)


@atexit.register
def _kill_leftovers() -> None:  # a crash of the test process itself
    for cluster in list(_LIVE):
        cluster.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for cluster in list(_LIVE):
            text = cluster.report()
            if text:
                report.sections.append((f"remoteloader server stderr ({report.when})", text))


@pytest.fixture
def cluster(tmp_path):
    """A fresh, empty Cluster for one test: ``cluster.add(data)`` starts a server."""
    with Cluster(tmp_path / "server-logs") as c:
        yield c


@pytest.fixture(scope="module")
def module_cluster(tmp_path_factory):
    """An empty Cluster shared by the tests of one module (they must not stop its servers)."""
    with Cluster(tmp_path_factory.mktemp("server-logs")) as c:
        yield c


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def free_port():
    """Returns a function giving a port on 127.0.0.1 that nothing listens on (just released)."""
    return _free_port


def _eval_reference(path, size: int | tuple[int, int]):
    """What the "eval" preset makes of a file: scale so that the image covers size/0.875 on both
    sides (for a square size: the short side becomes size/0.875), then center crop.

    Computed locally with OpenCV at full decode resolution; the server may decode JPEGs at
    a reduced DCT scale first, so compare with a tolerance.
    """
    import cv2
    import numpy as np

    h, w = (size, size) if isinstance(size, int) else size
    image = cv2.imdecode(np.fromfile(str(path), np.uint8), cv2.IMREAD_COLOR)
    assert image is not None, f"cannot decode {path} locally"
    image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
    ch, cw = round(h / 0.875), round(w / 0.875)
    ih, iw = image.shape[:2]
    scale = max(ch / ih, cw / iw)
    nh, nw = max(ch, round(ih * scale)), max(cw, round(iw * scale))
    image = cv2.resize(image, (nw, nh), interpolation=cv2.INTER_LINEAR)
    top, left = (nh - h) // 2, (nw - w) // 2
    return image[top:top + h, left:left + w]


def pixels_by_id(batches) -> dict:
    """{sample id: HWC uint8 pixels} of (images, labels, ids) batches; each id must come once."""
    out = {}
    for images, _labels, ids in batches:
        for image, i in zip(images.numpy(), ids.tolist()):
            assert i not in out, f"sample {i} delivered twice"
            out[i] = image
    return out


def outcome_in_fork(function, seconds: float = 20.0) -> str:
    """What ``function()`` did in a forked child: "returned", or its error's text; fails the
    test if the child has not finished within ``seconds`` (a hang)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave at once (no exit hooks of the parent's)
        try:
            function()
            outcome = b"returned"
        except BaseException as exc:
            outcome = f"{type(exc).__name__}: {exc}".encode()[:500]
        os.write(write, outcome)
        os._exit(0)
    os.close(write)
    try:
        deadline = time.monotonic() + seconds
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"the forked child hung (over {seconds:g}s)")
            time.sleep(0.05)
        return os.read(read, 1000).decode()
    finally:
        os.close(read)


def _run_bounded(loader, seconds: float = 60.0, on_batch=None) -> list[tuple]:
    """Iterates one epoch of ``loader``; fails the test (closing the loader) if it takes over ``seconds``.

    A loader that never finishes (a retry loop, a lost chunk) then fails fast with a clear
    message instead of hanging until the per-test timeout. ``on_batch(n, batch)`` runs
    after each batch arrives, mid-epoch.
    """
    fired = threading.Event()

    def fire() -> None:
        fired.set()
        loader.close()  # the iterating thread sees the I/O thread stop and raises

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    batches = []
    try:
        for item in loader:
            batches.append(tuple(item))
            if on_batch is not None:
                on_batch(len(batches) - 1, batches[-1])
    except Exception:
        if fired.is_set():
            pytest.fail(f"the epoch did not finish within {seconds:g}s (the loader was closed)")
        raise
    finally:
        timer.cancel()
    if fired.is_set():
        pytest.fail(f"the epoch did not finish within {seconds:g}s (the loader was closed)")
    return batches


@pytest.fixture(scope="session")
def run_bounded():
    """Returns ``f(loader, seconds=60, on_batch=None) -> [batch, ...]``: one epoch, failing the test if it hangs."""
    return _run_bounded


@pytest.fixture(scope="session")
def eval_reference():
    """Returns ``f(path, size) -> uint8 HWC RGB``, the expected eval-preset output for a file."""
    return _eval_reference
