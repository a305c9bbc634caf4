"""The code stays lint-clean, formatted and type-checked (ruff, mypy), as pyproject.toml configures them.

mypy checks the code as it is installed (``remoteloader.client``, ``.server``, ``.protos``,
``.tools``): the repository keeps those folders at its top level, so the test stages them
under a ``remoteloader/`` directory of links and checks that package.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CODE = ["client", "protos", "server", "tools"]

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def run(*command: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *command], cwd=cwd, capture_output=True, text=True, timeout=280)


def test_ruff_finds_nothing():
    result = run("ruff", "check", "--no-cache", *CODE, "tests", "benchmarks")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_code_is_formatted_as_ruff_formats_it():
    result = run("ruff", "format", "--no-cache", "--check", "--diff", *CODE)
    assert result.returncode == 0, "run `ruff format client protos server tools`:\n" + result.stdout[-3000:]


def test_mypy_finds_nothing(tmp_path):
    package = tmp_path / "remoteloader"
    package.mkdir()
    for folder in CODE:
        os.symlink(ROOT / folder, package / folder)
    # client/integrations/ is installed as remoteloader.integrations (pyproject's package-dir; mypy's
    # exclude leaves out the client's copy of it)
    os.symlink(ROOT / "client" / "integrations", package / "integrations")
    packages = [*CODE, "integrations"]
    result = run("mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"),
                 *[arg for folder in packages for arg in ("-p", f"remoteloader.{folder}")], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
