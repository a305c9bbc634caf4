"""A real Azure Blob endpoint on 127.0.0.1 for the tests: Azurite, Microsoft's Azure Storage emulator.

Azurite comes from the npm registry; ``install_azurite`` puts it in a cache folder once
(``npm install azurite``) and raises ``Unavailable`` with the reason where npm or the registry
is missing (the tests skip with it). ``LocalAzure`` starts its Blob service on port 0 of
127.0.0.1 (it says which port it got), with telemetry off, its data in a folder, and the
containers asked for, created with its well-known development account; ``env()`` gives the
standard variables (``AZURE_STORAGE_USE_EMULATOR``, ``AZURITE_BLOB_STORAGE_URL``,
``AZURE_STORAGE_ACCOUNT_NAME``, ``AZURE_STORAGE_ACCOUNT_KEY``) a loader server reads.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import http.client
import os
import pathlib
import re
import shutil
import subprocess
import time

from remoteloader.tools.local_process import LocalProcess

ACCOUNT = "devstoreaccount1"  # Azurite's development account and its published key
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
VERSION = "3.35.0"  # the Azurite the tests were written against
LISTENING = re.compile(r"Blob service (?:is )?successfully listens on http://127\.0\.0\.1:(\d+)")


class Unavailable(RuntimeError):
    """The emulator cannot be had here (no npm, no registry): the reason, for a test's skip."""


def install_azurite(cache: str | os.PathLike, timeout: float = 300.0) -> str:
    """The ``azurite-blob`` command, installed under ``cache`` from the npm registry if it is not there."""
    folder = pathlib.Path(cache)
    binary = folder / "node_modules" / ".bin" / "azurite-blob"
    if binary.is_file():
        return str(binary)
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise Unavailable("Azurite needs node and npm, and they are not installed")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        command = [npm, "install", "--no-audit", "--no-fund", "--prefix", str(folder), f"azurite@{VERSION}"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"npm install azurite took over {timeout:g}s (is the npm registry reachable?)") from None
    if done.returncode != 0 or not binary.is_file():
        raise Unavailable(f"npm install azurite failed (is the npm registry reachable?): {done.stderr[-1000:]}")
    return str(binary)


class LocalAzure(LocalProcess):
    """Azurite's Blob service on 127.0.0.1 with the given containers.

    Args:
        folder: Where its data and log live.
        containers: Containers created at start.
        cache: Where Azurite is installed (kept across runs).
    """

    LOG = "azurite.log"

    def __init__(
        self, folder: str | os.PathLike, containers: tuple[str, ...] = ("data",), cache: str | os.PathLike | None = None
    ):
        self.folder = pathlib.Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.containers = containers
        home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        self.cache = pathlib.Path(cache or os.path.join(home, "remoteloader-test", f"azurite-{VERSION}"))
        self.port = 0
        self._process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The standard Azure variables that point a loader server at this emulator."""
        return {
            "AZURE_STORAGE_USE_EMULATOR": "true",
            "AZURITE_BLOB_STORAGE_URL": self.endpoint,
            "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": KEY,
        }

    def start(self, timeout: float = 60.0) -> LocalAzure:
        """Starts Azurite (installing it first if needed) and creates the containers."""
        binary = install_azurite(self.cache)
        logged = len(self.log())
        process = self._launch(
            [
                binary,
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                "0",
                "--location",
                str(self.folder / "data"),
                "--disableTelemetry",
                "--skipApiVersionCheck",
                "--silent",
            ]
        )
        deadline = time.monotonic() + timeout
        while not self.port:
            found = LISTENING.search(self.log()[logged:])
            if found:
                self.port = int(found.group(1))
            elif process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"Azurite did not start:\n{self.log()[-3000:]}")
            else:
                time.sleep(0.1)
        for container in self.containers:
            self.create_container(container)
        return self

    def create_container(self, name: str) -> None:
        """Creates a container (a request signed with the development account's key)."""
        headers = {"x-ms-date": email.utils.formatdate(usegmt=True), "x-ms-version": "2021-08-06"}
        canonical = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
        signed = "PUT\n" + "\n" * 11 + canonical + f"/{ACCOUNT}/{ACCOUNT}/{name}\nrestype:container"
        signature = base64.b64encode(hmac.new(base64.b64decode(KEY), signed.encode(), hashlib.sha256).digest())
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            connection.request(
                "PUT",
                f"/{ACCOUNT}/{name}?restype=container",
                body=b"",
                headers={**headers, "Authorization": f"SharedKey {ACCOUNT}:{signature.decode()}"},
            )
            answer = connection.getresponse()
            body = answer.read()
        finally:
            connection.close()
        if answer.status not in (201, 409):  # (409: it exists)
            raise RuntimeError(f"Azurite refused to create container {name}: {answer.status} {body[:500]!r}")
