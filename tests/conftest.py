"""Shared fixtures: real loader-server subprocesses on 127.0.0.1 (``Cluster``) and small helpers.

A ``Cluster`` starts ``remoteloader-server`` processes with the one launcher
(``remoteloader.tools.local.LocalServer``), waits (bounded) for each one's
``listening on HOST:PORT`` line, and can stop (SIGTERM), kill (SIGKILL), restart (same
ports, same data) and add servers. Every server runs in its own process group, so its
decode workers and forkserver go with it; whatever is still running at teardown is
terminated, then killed. When a test fails, the tail of every server's stderr is
attached to the report.

No test chooses a port for a server: each binds its own (``--port 0``, ``--metrics-port -1``,
``--health-port -1``) and says which it got (``cluster.address(i)``, ``cluster.metrics_port(i)``,
``cluster.health_port(i)``). A port picked here, released and handed to a server could be taken
by another test's server in between (xdist runs several at once).

Server counters settle after the client has its batches: a chunk is counted once its write
completes, which the server may learn after the client has the chunk, and never if the client
closes its stream meanwhile. Compare them with ``wait_until_equal``, which reads until they
reach the expected values, while the loader whose chunks they count is still open.

Fixtures:
    cluster: a fresh, empty Cluster for one test (tests that stop, kill or restart servers).
    module_cluster: an empty Cluster shared by one test module (tests that only read from it).
    closed_port: a function returning a TCP port on 127.0.0.1 that refuses connections; it is
        held (bound, never listening) until the test ends, so nothing else can take it.
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
import threading
import time
import urllib.request
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from packing import CLASSES, PER_CLASS, SHARDS, pack_cli, shard_size_for
from photos import NOT_BUILT, smooth_photo

from remoteloader.server import decode as dec
from remoteloader.tools.local import LocalServer, ServerProcess
from remoteloader.tools.textures import encode_jpeg, make_image, make_imagefolder

READY_TIMEOUT = 90.0  # seconds a server may take to index its data and bind (the suite runs 3 workers on 2 cores)
SETTLE_TIMEOUT = 30.0  # seconds server counters may take to reach what a finished client saw
ANY_PORT = "-1"  # --metrics-port / --health-port: the server binds a free one and logs it
STOP_TIMEOUT = 30.0  # seconds a SIGTERMed server may take to drain and exit
DEFAULT_ARGS = ("--workers", "1", "--grace", "5", "--log-level", "INFO")
# How a `python -m` command that caught Ctrl-C, cleaned up and returned 130 may end: with 130,
# or dying by SIGINT, which CPython does when the KeyboardInterrupt had ended a string exec on
# its way (an import's dataclass or namedtuple). A shell or container runtime reads 130 for both.
CTRL_C_EXITS = (130, -signal.SIGINT)

_LIVE: weakref.WeakSet[Cluster] = weakref.WeakSet()


class Cluster:
    """N real loader servers on 127.0.0.1, each a ``LocalServer`` (the demo's and benchmarks'
    launcher) with its own data.

    Args:
        log_dir: Where each server's output is also written (``server<i>.log``, every run).
        args: Extra server flags for every server (after the defaults, so they win).
        ready_timeout: Seconds each server may take to log ``listening on``.
    """

    def __init__(self, log_dir: pathlib.Path, args: tuple[str, ...] = (), ready_timeout: float = READY_TIMEOUT):
        self.log_dir = pathlib.Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.args = tuple(args)
        self.ready_timeout = ready_timeout
        self.servers: list[LocalServer] = []
        self._closed = False
        _LIVE.add(self)

    # ---- starting ---------------------------------------------------------------------
    def add(self, data, *args: str, wait: bool = True, env: dict[str, str] | None = None) -> int:
        """Starts a server on ``data`` (a path or a list of paths) at a free port; returns its index.
        ``env``: variables it gets (e.g. an object store's credentials)."""
        return self.add_many([data], *args, wait=wait, env=env)[0]

    def add_many(self, datas: list, *args: str, wait: bool = True, env: dict[str, str] | None = None) -> list[int]:
        """Starts one server per entry of ``datas`` at once, then waits for all of them."""
        if self._closed:
            raise RuntimeError("cluster is closed")
        indices = []
        for data in datas:
            paths = [str(p) for p in (data if isinstance(data, (list, tuple)) else [data])]
            # No death signal: it costs a fork (not a vfork) while the test's gRPC threads run;
            # teardown and the atexit hook below stop the servers.
            # Its own --cache-dir (fetched bytes, tar indexes), not this user's ~/.cache, unless given.
            cache = () if "--cache-dir" in args else ("--cache-dir", str(self.log_dir / f"cache{len(self.servers)}"))
            server = LocalServer(paths, args=[*DEFAULT_ARGS, *cache, *self.args, *args], env=env,
                                 log_path=self.log_dir / f"server{len(self.servers)}.log", die_with_parent=False)
            self.servers.append(server)
            server.launch()
            indices.append(len(self.servers) - 1)
        if wait:
            for i in indices:
                self.wait_ready(i)
        return indices

    def wait_ready(self, i: int, timeout: float | None = None) -> int:
        return self.servers[i].wait_ready(self.ready_timeout if timeout is None else timeout)

    def restart(self, i: int, timeout: float | None = None) -> None:
        """Starts server ``i`` again on the same port with the same data (stopping it first if it runs)."""
        self.servers[i].restart(self.ready_timeout if timeout is None else timeout)

    # ---- stopping ---------------------------------------------------------------------
    def stop(self, i: int, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM (the server drains), waits for the exit; returns the exit code.

        Raises TimeoutError (after killing it) if it does not exit within ``timeout``.
        """
        process = self._process(i)
        code = process.stop(timeout)
        if code is None:
            raise TimeoutError(f"server {i} (pid {process.pid}) did not exit within {timeout:g}s of SIGTERM; "
                               f"stderr:\n{process.stderr()}")
        return code

    def kill(self, i: int) -> int | None:
        """SIGKILL to the server and its decode workers at once (a crashed host); returns the exit code."""
        return self._process(i).kill()

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

    def metrics_port(self, i: int) -> int:
        """The port server ``i`` serves /metrics on (started with ``--metrics-port -1``, say)."""
        return _bound(self.servers[i].metrics_port, i, "--metrics-port")

    def health_port(self, i: int) -> int:
        """The port server ``i`` answers health alone on (started with ``--health-port -1``, say)."""
        return _bound(self.servers[i].health_port, i, "--health-port")

    def metrics(self, i: int) -> dict[str, float]:
        """Server ``i``'s /metrics now: ``name`` or ``name{labels}`` -> value."""
        return scrape(self.metrics_port(i))

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

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def report(self, tail: int = 60) -> str:
        parts = []
        for i, s in enumerate(self.servers):
            for n, p in enumerate(s.incarnations):
                state = "running" if p.alive() else f"exited {p.poll()}"
                parts.append(f"--- server {i} incarnation {n} (pid {p.pid}, port {p.port}, {state}, "
                             f"data {s.data}) ---\n" + p.log_tail(tail))
        return "\n".join(parts)


def _bound(port: int | None, i: int, flag: str) -> int:
    if not port:
        raise RuntimeError(f"server {i} reported no {flag} (start it with {flag} {ANY_PORT}, and INFO logs)")
    return port


def scrape(port: int) -> dict[str, float]:
    """The samples of ``http://127.0.0.1:PORT/metrics``: ``name`` or ``name{labels}`` -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([a-zA-Z_:][^\s{]*(?:\{.*\})?) (\S+)$", text, re.M)}


def wait_until_equal(read: Callable[[], Any], expected: Any, what: str, timeout: float = SETTLE_TIMEOUT) -> Any:
    """Calls ``read()`` until it returns ``expected``; fails the test with both values if it
    has not within ``timeout`` seconds. For server counters, which count a chunk once its write
    completes: a client can hold its last batch before the server has counted it (read them
    before closing that client: see the module's notes)."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if value == expected:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"{what}: {value!r}, expected {expected!r} (still after {timeout:g}s)")
        time.sleep(0.05)


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


@pytest.fixture
def closed_port():
    """Returns a function giving a port on 127.0.0.1 that refuses connections (at once: the
    kernel answers with a reset). Its socket is bound and never listens, and stays bound until
    the test ends, so that no server can take the port meanwhile (a port released at once could
    be another test's server's by the time it is connected to)."""
    held: list[socket.socket] = []

    def take() -> int:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        held.append(s)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

    yield take
    for s in held:
        s.close()


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


# A command run with FOLDER mounted read-only over itself (as compose :ro and Kubernetes readOnly mount
# data): READ_ONLY_MOUNT + [FOLDER, COMMAND...].
READ_ONLY_MOUNT = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                   'mount --bind -o ro "$1" "$1" && shift && exec "$@"', "sh"]  # then: FOLDER COMMAND...


def read_only_mounts(folder: pathlib.Path) -> str | None:
    """Why a read-only bind mount of ``folder`` cannot be made here (None when it can)."""
    probe = READ_ONLY_MOUNT + [str(folder), "sh", "-c", 'touch "$0/probe" 2>/dev/null && exit 1 || exit 0', str(folder)]
    try:
        result = subprocess.run(probe, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare is not available: {exc}"
    return None if result.returncode == 0 else f"cannot make a read-only bind mount: {result.stderr.strip()}"


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """An ImageFolder and its `remoteloader pack`ed shards (the real CLI), once per module:
    (src, dst, the pack run)."""
    root = tmp_path_factory.mktemp("tar-data")
    src = make_imagefolder(root / "src", CLASSES, PER_CLASS, size=(40, 56), seed=4, jitter=0.2)
    dst = root / "dst"
    result = pack_cli(src, dst, "--shard-size", shard_size_for(src, SHARDS))
    assert result.returncode == 0, result.stderr
    return src, dst, result


# ---- JPEGs for the decoding and pipeline tests (helpers: tests/photos.py) ---------------------
@pytest.fixture(scope="module")
def imagenet_like() -> list[bytes]:
    """ImageNet-sized JPEGs, landscape and portrait (with odd sides)."""
    rng = np.random.default_rng(11)
    shapes = [(375, 500), (500, 375), (333, 500), (375, 499)]
    return [encode_jpeg(make_image(i, 5, rng, h, w), 90) for i, (h, w) in enumerate(shapes)]


@pytest.fixture(scope="module")
def large_photos() -> list[tuple[bytes, int, int]]:
    rng = np.random.default_rng(3)
    photos = []
    for h, w in ((1500, 2000), (2000, 1500), (1501, 2003)):
        photos.append((encode_jpeg(smooth_photo(rng, h, w), 90), h, w))
    return photos


@pytest.fixture(params=["region", "whole"])
def decoder(request, monkeypatch) -> str:
    """Runs a test with the native region decoder (when built) and with whole-image decoding."""
    if request.param == "region":
        if dec._jpeg is None:
            pytest.skip(NOT_BUILT)
    else:
        monkeypatch.setattr(dec, "_jpeg", None)
    return request.param
