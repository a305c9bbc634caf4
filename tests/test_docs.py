"""The README documents what the code does: its commands, every server flag, and CI runs its test command."""

from __future__ import annotations

import dataclasses
import pathlib
import re

from remoteloader.server.config import ServerConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1).strip().splitlines()
    assert len(first_block) == 2, first_block
    demo, tests = first_block
    assert demo.endswith("remoteloader demo")
    assert "pytest" in tests and "[server,test]" in tests
    assert README.index("```bash") < README.index("## "), "the commands come before any section"
    assert tests in (ROOT / ".ci" / "run").read_text()


def test_every_server_flag_is_in_the_readme_table():
    table = README[README.index("| flag | default | meaning |"):]
    for field in dataclasses.fields(ServerConfig):
        flag = "--" + field.name.replace("_", "-")
        assert f"`{flag}" in table or f"`{flag}`" in table or f", `{flag}`" in table, f"{flag} is not documented"
