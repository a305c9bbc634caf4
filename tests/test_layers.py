"""The layers hold: protos imports neither side, the client and the server never import each
other, and only the tools (and the benchmarks, outside the package) use both. Inside the client,
the loader sits over the receivers, over the engine, over the links and reassembly, over the
chunk checks: a lower room never reaches up (e.g. reassembly into the engine's scheduling).

The contracts are import-linter's, in pyproject.toml ([tool.importlinter]). The repository
has no remoteloader/ folder (pyproject's package-dir maps client/, server/, protos/ and tools/
onto it, and client/integrations/ onto remoteloader.integrations), so the packages are copied
as package-dir installs them into a temporary directory and checked there. Every import counts,
those inside functions too.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

# import-linter is in the test extra: without it the contracts would go unchecked, so its
# absence fails here (a contract that can be skipped is not enforced).
import importlinter  # noqa: F401
import pytest
import tomllib

pytestmark = pytest.mark.timeout(120)

ROOT = pathlib.Path(__file__).resolve().parents[1]
# {package: folder}, as setuptools installs them
LAYOUT: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
LINT = "import sys\nfrom importlinter.cli import lint_imports\nsys.exit(lint_imports(config_filename=sys.argv[1], " \
       "no_cache=True, no_logo=True))\n"


def stage(root: pathlib.Path) -> pathlib.Path:
    """The sources as the installed ``remoteloader`` package, under ``root``: each folder of
    package-dir where its package goes, less the subfolders installed as another package."""
    package = root / "remoteloader"
    package.mkdir()
    (package / "__init__.py").write_text("")
    mapped = {pathlib.Path(folder): name for name, folder in LAYOUT.items()}
    for name, folder in LAYOUT.items():
        target = root.joinpath(*name.split("."))
        if target.exists():  # a subpackage, copied with its parent's folder
            continue

        def ignore(directory: str, names: list[str], name: str = name, folder: str = folder) -> list[str]:
            here = pathlib.Path(directory).relative_to(ROOT)
            package_here = ".".join([name, *here.relative_to(folder).parts])
            return [n for n in names if n == "__pycache__" or n.endswith((".so", ".c"))
                    or mapped.get(here / n, f"{package_here}.{n}") != f"{package_here}.{n}"]

        shutil.copytree(ROOT / folder, target, ignore=ignore)
    return package


def lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LINT, str(ROOT / "pyproject.toml")], cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True,
                          timeout=100)


def test_import_contracts_are_kept(tmp_path):
    stage(tmp_path)
    result = lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = len(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"])
    assert contracts >= 4 and f"{contracts} kept, 0 broken" in result.stdout, result.stdout


@pytest.mark.parametrize("module, line, broken", [
    ("client/plan.py", "from remoteloader.server import config", "remoteloader.client is not allowed to import "
                                                                 "remoteloader.server"),
    ("server/metrics.py", "def f():\n    import remoteloader.tools.local", "remoteloader.server is not allowed to "
                                                                          "import remoteloader.tools"),
    ("protos/codec.py", "import remoteloader.client", "remoteloader.protos is not allowed to import "
                                                      "remoteloader.client"),
    ("client/assembly.py", "def f():\n    from remoteloader.client import engine",
     "remoteloader.client.assembly -> remoteloader.client.engine"),
    ("client/chunks.py", "from remoteloader.client.assembly import Order", "remoteloader.client.chunks -> "
                                                                           "remoteloader.client.assembly"),
    ("client/receiver_service.py", "from remoteloader.client import process_receiver",
     "remoteloader.client.receiver_service -> remoteloader.client.process_receiver"),
    ("client/loader.py", "def f():\n    from remoteloader.integrations import transformers",
     "remoteloader.client is not allowed to import remoteloader.integrations"),
    ("integrations/transformers.py", "from remoteloader.server import config",
     "remoteloader.integrations is not allowed to import remoteloader.server"),
])
def test_a_forbidden_import_breaks_a_contract(tmp_path, module, line, broken):
    """The check can fail: one import across a layer, even inside a function, is reported."""
    path = stage(tmp_path) / module
    path.write_text(path.read_text() + f"\n\n{line}\n")
    result = lint(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert broken in result.stdout, result.stdout
