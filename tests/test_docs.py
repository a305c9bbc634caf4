"""The documentation documents what the code does: the README's commands, which CI runs; every server flag in
the operator guide; and a site (docs/, mkdocs.yml) that builds with --strict, so links and anchors cannot rot."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

from remoteloader.server.config import ServerConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1).strip().splitlines()
    assert len(first_block) == 2, first_block
    demo, tests = first_block
    assert demo.endswith("remoteloader demo")
    assert "pytest" in tests and "[server,test]" in tests
    assert README.index("```bash") < README.index("## "), "the commands come before any section"
    assert tests in (ROOT / ".ci" / "run").read_text()


def _documented_flags(guide: str) -> list[str]:
    """The flags the operator guide's table names, whole: each backquoted ``--name`` (``--name ARG``
    too) in the first cell of each of its rows, so that ``--source`` is not found in ``--source-args``."""
    table = guide[guide.index("| flag | default | meaning |") :].split("\n\n")[0]
    cells = [row.split("|")[1] for row in table.splitlines()[2:]]
    return [flag for cell in cells for flag in re.findall(r"`(--[a-z0-9-]+)(?: [^`]*)?`", cell)]


def test_every_server_flag_is_in_the_operator_guide_table():
    documented = _documented_flags((DOCS / "operator-guide.md").read_text())
    flags = ["--" + field.name.replace("_", "-") for field in dataclasses.fields(ServerConfig)]
    assert len(documented) == len(set(documented)), f"a flag is in the table twice: {documented}"
    assert not set(flags) - set(documented), f"not documented: {sorted(set(flags) - set(documented))}"
    assert not set(documented) - set(flags), f"documented but no flag: {sorted(set(documented) - set(flags))}"


def test_the_flag_table_is_matched_by_whole_flags():
    # (the check above must not find --source in `--source-args`, nor --max-streams in `--max-streams-per-client`)
    guide = "| flag | default | meaning |\n| --- | --- | --- |\n| `--source-args`, `--max-streams-per-client N` | | |\n"
    assert _documented_flags(guide) == ["--source-args", "--max-streams-per-client"]


def _nav_pages(nav) -> list[str]:
    """The files a mkdocs nav names, however deeply nested."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return [page for item in nav for page in _nav_pages(item)]


def test_every_page_under_docs_is_in_the_site_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs"
    nav = _nav_pages(config["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(set(nav)) == pages, f"in docs/ but not in nav: {sorted(set(pages) - set(nav))}; " + (
        f"in nav but not in docs/: {sorted(set(nav) - set(pages))}"
    )
    assert len(nav) == len(set(nav)), f"a page is in nav twice: {nav}"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
        + ["--config-file", str(ROOT / "mkdocs.yml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}\n{result.stdout}"
    return out


def test_the_site_builds_with_strict(site):
    # --strict (and mkdocs.yml's validation settings) fail on broken links and anchors and on pages left out of nav.
    for page in DOCS.rglob("*.md"):
        name = page.relative_to(DOCS).with_suffix("")
        built = site / "index.html" if name.as_posix() == "index" else site / name / "index.html"
        assert built.is_file(), f"{page} was not built"


@pytest.mark.parametrize("readme", ["README.md", "deploy/README.md"])
def test_the_readmes_links_into_the_docs_resolve(site, readme):
    # The READMEs are outside the site, so mkdocs does not check their links: this does, anchors included.
    path = ROOT / readme
    links = [link for link in MARKDOWN_LINK.findall(path.read_text()) if "://" not in link]
    assert links, f"{readme} links to nothing"
    for link in links:
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve()
        assert file.is_file(), f"{readme}: {link} is not a file"
        if anchor:
            assert file.suffix == ".md" and file.parent == DOCS, f"{readme}: {link}: anchors only into docs/"
            name = file.relative_to(DOCS).with_suffix("")
            built = site / "index.html" if name.as_posix() == "index" else site / name / "index.html"
            assert f'id="{anchor}"' in built.read_text(), f"{readme}: {link}: no such section"
