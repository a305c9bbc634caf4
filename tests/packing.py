"""What the pack and tar tests share: the real `remoteloader pack` CLI and its helpers (the
`packed` fixture that uses them is in conftest.py)."""

from __future__ import annotations

import io
import os
import pathlib
import subprocess
import sys
import tarfile

CLASSES = ["ant", "bee", "cat"]
PER_CLASS = 8  # 24 samples
SIZE = 16
SHARDS = 3


def pack_command(*args) -> tuple[list[str], dict[str, str]]:
    """The real CLI's command line and an environment without REMOTELOADER_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTELOADER_")}
    return [sys.executable, "-m", "remoteloader.tools.cli", "pack", *map(str, args)], env


def pack_cli(*args, timeout: float = 60) -> subprocess.CompletedProcess:
    command, env = pack_command(*args)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def shard_size_for(src: pathlib.Path, shards: int) -> int:
    """A --shard-size giving about ``shards`` shards (pack counts data + 1536 bytes of headers)."""
    total = sum(p.stat().st_size + 1536 for p in src.rglob("*.jpg"))
    return total // shards + 1


def members(path: pathlib.Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()]


def write_tar(path: pathlib.Path, entries: list[tuple[str, bytes]]) -> pathlib.Path:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path
