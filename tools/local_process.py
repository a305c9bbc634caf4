"""What the local stores the tests run (SeaweedFS, Azurite, fake-gcs-server) share: a process in a
process group of its own with a log file in its folder, stopped with SIGTERM, then SIGKILL.

A subclass sets ``LOG`` (its log's name in ``folder``) and starts its process with ``_launch``
(in a session of its own, so that what it starts goes with it); ``with store:`` starts and
stops it.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
from typing import Any


class LocalProcess:
    """A local server process of the tests: its folder, its log, its stop."""

    LOG = ""
    folder: pathlib.Path
    _process: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> Any:
        raise NotImplementedError

    def _launch(self, command: list[str]) -> subprocess.Popen:
        """Starts ``command`` in a process group of its own, its output appended to the log."""
        with open(self.folder / self.LOG, "ab") as log:
            self._process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self._process

    def log(self) -> str:
        """Its log so far ("" before there is one)."""
        try:
            return (self.folder / self.LOG).read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        """Stops it (SIGTERM, then SIGKILL after ``timeout``), keeping its data for ``start``."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def kill(self) -> None:
        """Kills it at once (SIGKILL), as a crash would."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
