"""Writes (or checks) deploy/constraints.txt: the exact version of every distribution the server
image installs, so that an image built next month is the image measured (docs/deploy.md, "Image size").

deploy/Dockerfile installs ``pip install ".[server]" -c deploy/constraints.txt``; pyproject.toml gives
the ranges (each server dependency bounded to the major version the tests pass with), this file
the one point inside them that the image uses. Run it in the environment the tests passed in::

    python deploy/constraints.py           # rewrite deploy/constraints.txt from this environment
    python deploy/constraints.py --check   # exit 1 if it differs from this environment

The set is remoteloader's requirements with the ``server`` extra and theirs, recursively, as
installed here, with the environment markers of this interpreter (the image's: CPython 3.11,
Linux). tests/test_deploy.py checks that the file and pyproject.toml agree.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import pathlib
import sys

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PATH = pathlib.Path(__file__).with_name("constraints.txt")
HEADER = """\
# The server image's exact versions (deploy/Dockerfile: pip install ".[server]" -c deploy/constraints.txt):
# remoteloader[server]'s requirements and theirs, as installed where the tests passed.
# Written by `python deploy/constraints.py` (Python {python}, {platform}); do not edit by hand.
"""


def _wanted(requirement: Requirement, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    environment = default_environment()
    return any(requirement.marker.evaluate({**environment, "extra": extra}) for extra in (extras or {""}))


def closure(root: str = "remoteloader", extras: tuple[str, ...] = ("server",)) -> dict[str, str]:
    """Canonical name -> installed version of every distribution ``root[extras]`` needs here."""
    pinned: dict[str, str] = {}
    todo = [(root, set(extras))]
    while todo:
        name, wanted_extras = todo.pop()
        distribution = importlib.metadata.distribution(name)
        for text in distribution.requires or []:
            requirement = Requirement(text)
            key = canonicalize_name(requirement.name)
            if key in pinned or not _wanted(requirement, wanted_extras):
                continue
            pinned[key] = importlib.metadata.version(requirement.name)
            todo.append((requirement.name, set(requirement.extras)))
    pinned.pop(canonicalize_name(root), None)
    return dict(sorted(pinned.items()))


def render(pins: dict[str, str]) -> str:
    header = HEADER.format(python=".".join(map(str, sys.version_info[:2])), platform=sys.platform)
    return header + "".join(f"{name}=={version}\n" for name, version in pins.items())


def read(path: pathlib.Path = PATH) -> dict[str, str]:
    """Canonical name -> pinned version, from a constraints file of ``name==version`` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            if not sep:
                raise ValueError(f"{path}: {line!r} is not name==version")
            pins[canonicalize_name(name.strip())] = version.strip()
    return pins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    args = parser.parse_args(argv)
    pins = closure()
    if args.check:
        current = read()
        differ = sorted(set(pins.items()) ^ set(current.items()))
        for name, version in differ:
            where = "here" if pins.get(name) == version else PATH.name
            print(f"{name}=={version} ({where} only)")
        return 1 if differ else 0
    PATH.write_text(render(pins))
    print(f"{PATH}: {len(pins)} distributions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
