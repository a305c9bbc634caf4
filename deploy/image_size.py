"""Measures the server image and writes docs/deploy.md's "Image size" section from the figures,
so that the section is the last measurement and never a hand edit.

    python deploy/image_size.py measure remoteloader-server   # docker history + the image's site-packages
    python deploy/image_size.py render                        # the section again from image_size.json
    python deploy/image_size.py site-packages                 # this interpreter's site-packages, as JSON

``measure`` needs a Docker engine and the built image (``docker build -f deploy/Dockerfile --target
server -t remoteloader-server .``): it reads the engine's version, the image's size, its layers
(``docker history``) and the size of every distribution in its site-packages (this file's
``site-packages`` command, run in the image), writes them to deploy/image_size.json and renders
the section. ``render`` rewrites the section from the committed figures (tests/test_deploy.py
checks that the section is what it renders). Standard library only: it also runs inside the image.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import pathlib
import subprocess
import sys
import sysconfig

# (Run in the image as `python -c <this file>`, which has no __file__: then only site-packages is asked for.)
HERE = pathlib.Path(globals().get("__file__", "deploy/image_size.py")).resolve().parent
FIGURES = HERE / "image_size.json"
GUIDE = HERE.parent / "docs" / "deploy.md"
BEGIN = "<!-- image-size: written by deploy/image_size.py from deploy/image_size.json; do not edit by hand -->"
END = "<!-- /image-size -->"
MB = 1_000_000
# The section's rows: distributions by what they are, in this order; any other is in "the rest".
GROUPS = [
    ("OpenCV (`cv2`, its bundled FFmpeg, OpenBLAS...)", {"opencv-python-headless"}),
    ("numpy", {"numpy"}),
    ("scipy (albumentations' `scipy.special`; the rest pruned)", {"scipy"}),
    (
        "zstandard, stringzilla, uvloop, PyYAML, simsimd (debug information stripped)",
        {"zstandard", "stringzilla", "uvloop", "pyyaml", "simsimd"},
    ),
    ("pip, setuptools, wheel (the base image's)", {"pip", "setuptools", "wheel"}),
]
REST = "grpc, obstore, pydantic, albumentations, remoteloader, the rest"


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def site_packages(path: str | None = None) -> dict[str, int]:
    """Bytes on disk (apparent sizes, as an image layer counts them) of each distribution installed
    in ``path`` (default: this interpreter's purelib), from its RECORD; files no RECORD lists are
    "(unrecorded)"."""
    root = pathlib.Path(path or sysconfig.get_paths()["purelib"]).resolve()
    sizes: dict[str, int] = {}
    seen: set[pathlib.Path] = set()
    for distribution in importlib.metadata.distributions(path=[str(root)]):
        name = _canonical(distribution.metadata["Name"])
        total = 0
        for file in distribution.files or []:
            located = pathlib.Path(distribution.locate_file(file)).resolve()
            if located in seen or not located.is_relative_to(root) or not located.is_file():
                continue
            seen.add(located)
            total += located.lstat().st_size
        sizes[name] = sizes.get(name, 0) + total
    unrecorded = sum(p.lstat().st_size for p in root.rglob("*") if p.is_file() and p.resolve() not in seen)
    if unrecorded:
        sizes["(unrecorded)"] = unrecorded
    return dict(sorted(sizes.items()))


def _docker(*args: str) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True, timeout=300).stdout


def measure(image: str, base: str = "python:3.11-slim") -> dict:
    """The figures of a built image: engine, size, layers, base image size, site-packages by distribution."""
    layers = []
    for line in _docker(
        "history", "--no-trunc", "--human=false", "--format", "{{.Size}}\t{{.CreatedBy}}", image
    ).splitlines():
        size, _, created_by = line.partition("\t")
        layers.append({"bytes": int(size), "created_by": created_by[:160]})
    code = pathlib.Path(__file__).read_text()
    inside = _docker("run", "--rm", "--entrypoint", "python", image, "-c", code, "site-packages")
    return {
        "date": datetime.date.today().isoformat(),
        "engine": "Docker " + _docker("version", "--format", "{{.Server.Version}}").strip(),
        "how": f"docker build -f deploy/Dockerfile --target server -t {image} .",
        "image_bytes": int(_docker("image", "inspect", "--format", "{{.Size}}", image)),
        "base": base,
        "base_bytes": int(_docker("image", "inspect", "--format", "{{.Size}}", base)),
        "layers": layers,
        "site_packages": json.loads(inside),
    }


def _mb(value: int) -> str:
    return f"{value / MB:,.0f} MB"


def groups(sizes: dict[str, int]) -> list[tuple[str, int]]:
    """The section's rows: (what, bytes), the groups in order, then the rest."""
    rows, left = [], dict(sizes)
    for label, names in GROUPS:
        rows.append((label, sum(left.pop(n, 0) for n in names)))
    rows.append((REST, sum(left.values())))
    return rows


def _cell(command: str) -> str:
    """A Dockerfile step as a table cell: shortened, without the characters a Markdown table or code span ends at."""
    return command.replace("|", "/").replace("`", "'")[:100]


def own_layers(figures: dict) -> list[dict]:
    """The rows of ``docker history`` (newest first) that the Dockerfile added over the base image:
    as many of the newest as add up to the image's size less the base's."""
    own, total = [], figures["image_bytes"] - figures["base_bytes"]
    for row in figures.get("layers", []):
        if total < MB:  # the base's layers add up to its size exactly: what is left is rounding
            break
        own.append(row)
        total -= row["bytes"]
    return own


def render(figures: dict) -> str:
    """The "Image size" section's generated part, from ``figures``."""
    sizes = figures["site_packages"]
    site = sum(sizes.values())
    layer = figures["image_bytes"] - figures["base_bytes"]
    lines = [
        BEGIN,
        f"The server image {'would weigh about' if figures.get('estimate') else 'weighs'} "
        f"**{_mb(figures['image_bytes'])}** (uncompressed, what `docker image ls` "
        f"shows): {_mb(figures['base_bytes'])} of `{figures['base']}` and {_mb(layer)} of its own layers, "
        f"nearly all site-packages ({_mb(site)} with the base image's pip). Measured on {figures['date']} "
        f"with {figures['engine']}: {figures['how']}.",
    ]
    if figures.get("note"):
        lines += ["", figures["note"]]
    own = own_layers(figures)
    if own:
        lines += ["", "| its own layers (`docker history`, 1 MB or more) | size |", "| --- | ---: |"]
        lines += [f"| `{_cell(row['created_by'])}` | {_mb(row['bytes'])} |" for row in own if row["bytes"] >= MB]
    before = figures.get("site_packages_before")  # a measurement outside an image can see both
    if before:
        lines += ["", "| site-packages | before the prune | after |", "| --- | ---: | ---: |"]
        lines += [
            f"| {label} | {_mb(old)} | {_mb(new)} |" for (label, old), (_, new) in zip(groups(before), groups(sizes))
        ]
        lines += [f"| **all** | **{_mb(sum(before.values()))}** | **{_mb(site)}** |", END]
    else:
        lines += ["", "| site-packages, after the prune | size |", "| --- | ---: |"]
        lines += [f"| {label} | {_mb(value)} |" for label, value in groups(sizes)]
        lines += [f"| **all** | **{_mb(site)}** |", END]
    return "\n".join(lines) + "\n"


def write_guide(figures: dict, guide: pathlib.Path = GUIDE) -> None:
    text = guide.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END) + 1
    guide.write_text(text[:start] + render(figures) + text[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    measured = sub.add_parser("measure", help="measure a built image, write image_size.json and the guide")
    measured.add_argument("image", nargs="?", default="remoteloader-server")
    measured.add_argument("--base", default="python:3.11-slim")
    sub.add_parser("render", help="rewrite the guide's section from image_size.json")
    listed = sub.add_parser("site-packages", help="print this interpreter's site-packages sizes as JSON")
    listed.add_argument("path", nargs="?", default=None)
    args = parser.parse_args(argv)
    if args.command == "site-packages":
        print(json.dumps(site_packages(args.path), indent=1))
        return 0
    if args.command == "measure":
        figures = measure(args.image, args.base)
        FIGURES.write_text(json.dumps(figures, indent=1) + "\n")
    figures = json.loads(FIGURES.read_text())
    write_guide(figures)
    print(render(figures), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
