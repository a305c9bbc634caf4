"""Prunes the server image's site-packages to what the loader server uses, then proves it still works.

deploy/Dockerfile runs it as root right after ``pip install ".[server]"``, in the same RUN (what
it deletes never reaches a layer), while the build's binutils are still installed::

    python deploy/prune_site_packages.py            # prune, then verify: exit 1 if anything broke
    python deploy/prune_site_packages.py --dry-run  # print what would go; change nothing
    python deploy/prune_site_packages.py --check    # verify only

What goes, and why that is safe (docs/deploy.md, "Image size", has the measured sizes):

* **scipy's subpackages that the server never loads.** scipy is 140 MB of the image, and the
  server reaches it only through albumentations 2.0, which uses ``scipy.special`` (a Bessel
  function of RingingOvershoot). The keep-list is derived, not written here: a child process
  imports the server and runs every pipeline it offers (``--probe``), and a subpackage stays if
  it is in that process's ``sys.modules`` or is named by an import statement (in any function,
  run or not) of a distribution that requires scipy. A later albumentations that uses more of
  scipy keeps more, with no edit here.
* **the libraries of scipy.libs that no extension module left links to** (read from their ELF
  DT_NEEDED entries): the Fortran runtime of the Fortran code removed above. Only in the folders
  of the distributions pruned above, whose libraries are there for their own extension modules.
* **``tests`` folders inside packages** (numpy's, scipy's, ...): test suites, which the
  packages do not import; one that holds a module the probe loaded would stay (and pip's
  vendored ones, in the base image's layer, stay).
* **DWARF debug information** (``strip --strip-debug``) of the extension modules that carry
  more than 1 MB of it (stringzilla, uvloop, zstandard's two backends, PyYAML, simsimd: 51 MB,
  seven times their code): only debuggers read it. Their symbol tables stay, so profilers still name native functions.
  Libraries in ``<name>.libs`` folders are left as auditwheel wrote them.

Nothing else goes. pip, setuptools and wheel stay: they are in the python:3.11-slim layer
(deleting them in a later layer only hides them, the image keeps their bytes), and the trainer
stage (FROM server) runs pip. Our own package keeps every file.

The verification (``--check``, and after every prune) runs the probe again in a fresh process:
it imports every module of remoteloader.server and remoteloader.protos, the CLI and health probe
of the HEALTHCHECK, every top-level module of each distribution remoteloader[server] requires,
runs each preset pipeline and a custom one (with RingingOvershoot) on a generated JPEG, fused,
plain and region-decoded, with boxes, keypoints and masks, round-trips the zstd and jpeg95
wires, and loads every stripped file. It fails (exit 1, so the build fails) if any of that
raises or if a loaded module's file was removed. Standard library only (and binutils' strip).
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import NamedTuple

# Distributions pruned to the subpackages the server loads, with why that is worth it. Only
# these: for any other package, "not imported by the probe" is no proof it is never imported
# (numpy and cv2 load submodules lazily, on code paths a probe cannot all reach).
PRUNED_BY_USE = {
    "scipy": "140 MB, of which the server uses scipy.special (through albumentations)",
}
TESTS_DIR = "tests"
OWN = "remoteloader"
# In the python:3.11-slim layer: deleting there would only hide files, and pip must stay whole.
BASE_IMAGE = ("pip", "setuptools", "wheel", "pkg_resources", "_distutils_hack")
STRIP_OVER = 1 << 20  # bytes of debug information that make stripping a file worth it


# ---- what the server uses ----------------------------------------------------------------------
def probe(stripped: list[str]) -> list[str]:
    """Exercises what a loader server runs; returns the files of every module it loaded."""
    import pkgutil

    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    for package in ("remoteloader.server", "remoteloader.protos"):
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, package + "."):
            importlib.import_module(info.name)
    importlib.import_module("remoteloader.tools.cli")  # `remoteloader probe`: the HEALTHCHECK
    importlib.import_module("remoteloader.tools.probe")
    for name in server_requirement_modules():
        importlib.import_module(name)
    _run_pipelines()
    _round_trip_wires()
    for path in stripped:  # loadable (whether or not the probe imported it)
        ctypes.CDLL(path, mode=os.RTLD_LAZY)
    return sorted(
        {os.path.realpath(f) for m in list(sys.modules.values()) if isinstance(f := getattr(m, "__file__", None), str)}
    )


def server_requirement_modules() -> list[str]:
    """The top-level modules of every distribution remoteloader[server] requires directly."""
    wanted = set()
    for requirement in importlib.metadata.requires(OWN) or []:
        name, _, marker = requirement.partition(";")
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        if extra is None or extra.group(1) == "server":
            wanted.add(_normalize(_requirement_name(name)))
    return sorted(
        module
        for module, distributions in importlib.metadata.packages_distributions().items()
        if module.isidentifier() and not module.startswith("_") and {_normalize(d) for d in distributions} & wanted
    )


def _requirement_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
    return match.group(0) if match else ""


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _run_pipelines() -> None:
    import albumentations as A
    import cv2
    import numpy as np

    from remoteloader.protos import CUSTOM_PIPELINE
    from remoteloader.server import pipelines, targets

    rng = np.random.default_rng(0)
    pixels = cv2.GaussianBlur(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8), (9, 9), 3)
    ok, encoded = cv2.imencode(".jpg", pixels)
    assert ok
    jpeg = encoded.tobytes()
    custom = json.dumps(
        A.to_dict(A.Compose([A.RandomResizedCrop(size=(48, 64)), A.RingingOvershoot(p=1), A.HorizontalFlip()]))
    )
    moving = (targets.BBOXES, targets.BBOX_LABELS, targets.KEYPOINTS, targets.MASK)
    for name in (*pipelines.PRESETS, CUSTOM_PIPELINE):
        for fields in ((), moving):
            spec = pipelines.PipelineSpec(
                name, 48, 64, albumentations_json=custom if name == CUSTOM_PIPELINE else "", fields=fields
            )
            pipeline = pipelines.Pipeline(spec, allow_custom=True)
            pipeline.check_output()  # a random image of two sizes, through the targets when asked
            for fused, verified in ((True, True), (True, False), (False, False)):
                if fields:  # as a worker renders a sample whose stream asked for targets
                    arrays = {
                        targets.BBOXES: np.asarray([[10, 20, 200, 180]], np.float32),
                        targets.BBOX_LABELS: np.zeros(1, np.int64),
                        targets.KEYPOINTS: np.asarray([[50, 60, 1]], np.float32),
                    }
                    out, _, mask = pipeline.with_targets(
                        jpeg, 7, arrays, lambda h, w: np.ones((h, w), np.uint8), verified=verified, fused=fused
                    )
                    assert mask is not None and mask.shape == (48, 64), (name, mask)
                else:
                    out = pipeline(jpeg, seed=7, fused=fused, verified=verified)
                assert out.shape == (48, 64, 3) and out.dtype == np.uint8, (name, out.shape, out.dtype)


def _round_trip_wires() -> None:
    import numpy as np

    from remoteloader.protos import wire

    pixels = np.tile(np.arange(64, dtype=np.uint8)[None, :, None], (48, 1, 3))
    for name in (wire.ZSTD, wire.JPEG95):
        data = wire.Encoder(name).image(pixels)
        assert data is not None, f"{name}: encoded no smaller than raw"
        out = np.empty_like(pixels)
        wire.decode_image(name, memoryview(data), out)
        assert np.abs(out.astype(int) - pixels).max() <= 8, name


def run_probe(stripped: list[str] | None = None) -> list[str]:
    """``probe()`` in a fresh interpreter (this one keeps nothing loaded); exits 1 on failure."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "loaded.json"
        command = [sys.executable, os.path.abspath(__file__), "--probe", str(out)]
        done = subprocess.run(command, input=json.dumps(stripped or []), text=True)
        if done.returncode != 0:
            raise SystemExit(f"prune_site_packages: the server probe failed (exit {done.returncode}); see above")
        return json.loads(out.read_text())


# ---- what can go -------------------------------------------------------------------------------
def site_dirs() -> list[Path]:
    return sorted({Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")})


def plan(loaded: list[str], sites: list[Path]) -> list[Path]:
    """The folders and files to remove (none inside another), given the files the probe loaded."""
    loaded_paths = [Path(f) for f in loaded]
    removals: list[Path] = []
    for distribution in PRUNED_BY_USE:
        removals += unused_subpackages(distribution, loaded_paths)
    for distribution in PRUNED_BY_USE:
        removals += _unlinked_libraries(distribution, removals)
    for site in sites:
        removals += _tests_folders(site, loaded_paths)
    chosen = set(removals)
    return sorted(p for p in chosen if not any(parent in chosen for parent in p.parents))


def _package_dir(top: str) -> Path | None:
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def unused_subpackages(top: str, loaded: list[Path]) -> list[Path]:
    """``top``'s subpackage folders that the probe did not load and that no import statement of
    a distribution requiring ``top`` names (albumentations: ``from scipy import special``), in
    any function, run by the probe or not.

    ``top``'s own function-level imports are not followed: they serve functions the server does
    not call (scipy.special's orthogonal-polynomial roots import scipy.linalg; albumentations
    calls special.j1, which the probe runs), and following them keeps most of scipy."""
    root = _package_dir(top)
    if root is None:
        return []
    subpackages = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    keep = {p.relative_to(root).parts[0] for p in loaded if root in p.parents and len(p.relative_to(root).parts) > 1}
    for distribution in _dependents(top):
        for source in _python_files(distribution):
            keep |= _imported_subpackages(source, top)
    return [root / name for name in sorted(subpackages - keep)]


def _dependents(top: str) -> list[importlib.metadata.Distribution]:
    return [
        d
        for d in importlib.metadata.distributions()
        if any(_normalize(_requirement_name(r)) == _normalize(top) for r in d.requires or [])
    ]


def _python_files(distribution: importlib.metadata.Distribution) -> list[Path]:
    return [Path(str(distribution.locate_file(f))).resolve() for f in distribution.files or [] if f.suffix == ".py"]


def _imported_subpackages(source: Path, top: str) -> set[str]:
    """The ``top.<name>`` each import statement of a file names: ``import top.x``, ``from top.x
    import y``, ``from top import x`` (x may be a subpackage). Docstrings and comments do not count."""
    try:
        tree = ast.parse(source.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if len(parts) > 1 and parts[0] == top:
                names.add(parts[1])
    return names


def _unlinked_libraries(top: str, removals: list[Path]) -> list[Path]:
    """Libraries in ``top``'s auditwheel folder (``<top>.libs``) that no extension module of
    ``top`` left after ``removals`` needs, directly or through another library there."""
    root = _package_dir(top)
    if root is None or not (libs := root.parent / f"{top}.libs").is_dir():
        return []
    users = [f for f in root.rglob("*.so*") if f.is_file() and not any(r == f or r in f.parents for r in removals)]
    bundled = {f.name: f for f in libs.iterdir() if f.is_file()}
    needed: set[str] = set()
    todo = list(users)
    while todo:
        names = elf(todo.pop()).needed
        if names is None:  # an ELF this reader does not understand: keep every library
            return []
        for name in names:
            if name in bundled and name not in needed:
                needed.add(name)
                todo.append(bundled[name])
    return [bundled[name] for name in sorted(set(bundled) - needed)]


def _tests_folders(site: Path, loaded: list[Path]) -> list[Path]:
    """Every ``tests`` folder inside a package (its parent has an ``__init__.py``) of ``site``,
    except in our own package, the base image's and those holding a module the probe loaded."""
    found = []
    for folder, dirs, _ in os.walk(site):
        here = Path(folder)
        if here == site:
            dirs[:] = [d for d in dirs if d not in (OWN, *BASE_IMAGE) and not d.endswith((".dist-info", ".libs"))]
        if TESTS_DIR in dirs and (here / "__init__.py").exists():
            dirs.remove(TESTS_DIR)
            if not any(here / TESTS_DIR in p.parents for p in loaded):
                found.append(here / TESTS_DIR)
    return found


def debug_heavy(sites: list[Path]) -> dict[Path, int]:
    """Extension modules (outside ``*.libs`` folders and our package) with over STRIP_OVER bytes
    of debug sections, and how many."""
    found = {}
    for site in sites:
        for folder, dirs, files in os.walk(site):
            if Path(folder) == site:
                dirs[:] = [d for d in dirs if d != OWN and not d.endswith(".libs")]
            for name in files:
                if name.endswith(".so"):
                    path = Path(folder, name)
                    debug = elf(path).debug
                    if debug > STRIP_OVER and not path.is_symlink():
                        found[path] = debug
    return found


class Elf(NamedTuple):
    needed: list[str] | None  # DT_NEEDED names ([] for a non-ELF; None: unreadable)
    debug: int  # bytes in .debug_* sections


def elf(path: Path) -> Elf:
    """Reads what this script needs of a 64-bit little-endian ELF file's headers."""
    try:
        with open(path, "rb") as f:
            header = f.read(64)
            if header[:4] != b"\x7fELF":
                return Elf([], 0)
            if header[4] != 2 or header[5] != 1:
                return Elf(None, 0)
            (phoff, shoff) = struct.unpack_from("<QQ", header, 0x20)
            phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from("<HHHHH", header, 0x36)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            loads, dynamic = [], None
            for i in range(phnum):
                kind, _, offset, vaddr, _, filesz, _, _ = struct.unpack_from("<IIQQQQQQ", table, i * phentsize)
                if kind == 1:  # PT_LOAD
                    loads.append((vaddr, offset, filesz))
                elif kind == 2:  # PT_DYNAMIC
                    dynamic = (offset, filesz)
            names: list[str] = []
            if dynamic is not None:
                f.seek(dynamic[0])
                raw = f.read(dynamic[1])
                entries = []
                for k in range(0, len(raw) - 15, 16):
                    tag, value = struct.unpack_from("<qQ", raw, k)
                    if tag == 0:  # DT_NULL
                        break
                    entries.append((tag, value))
                strtab = next(value for tag, value in entries if tag == 5)  # DT_STRTAB, an address
                base = next(off + strtab - va for va, off, size in loads if va <= strtab < va + size)
                for tag, value in entries:
                    if tag == 1:  # DT_NEEDED, an offset in the string table
                        f.seek(base + value)
                        names.append(f.read(4096).split(b"\0", 1)[0].decode())
            debug = 0
            if shoff and shnum and shstrndx < shnum:
                f.seek(shoff)
                sections = [struct.unpack_from("<IIQQQQ", f.read(shentsize)) for _ in range(shnum)]
                _, _, _, _, str_offset, str_size = sections[shstrndx]
                f.seek(str_offset)
                strings = f.read(str_size)
                for name, kind, _, _, _, size in sections:
                    if strings[name:].startswith((b".debug", b".zdebug")) and kind != 8:  # not SHT_NOBITS
                        debug += size
            return Elf(names, debug)
    except (OSError, struct.error, StopIteration, UnicodeDecodeError):
        return Elf(None, 0)


# ---- doing it ----------------------------------------------------------------------------------
def _size(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    return sum(f.lstat().st_size for f in path.rglob("*") if f.is_file() or f.is_symlink())


def _owner(path: Path, sites: list[Path]) -> str:
    for site in sites:
        if site in path.parents:
            return path.relative_to(site).parts[0]
    return str(path.parent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print what would be removed; change nothing")
    mode.add_argument("--check", action="store_true", help="only verify that the server works as installed")
    mode.add_argument("--probe", metavar="OUT", help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--json", metavar="OUT", help="also write the removal plan (paths) to OUT")
    args = parser.parse_args(argv)
    if args.probe:
        Path(args.probe).write_text(json.dumps(probe(json.loads(sys.stdin.read() or "[]"))))
        return 0
    sites = site_dirs()
    loaded = run_probe()
    if args.check:
        print(f"prune_site_packages: the server works ({len(loaded)} modules loaded)")
        return 0
    removals = plan(loaded, sites)
    if args.json:
        Path(args.json).write_text(json.dumps([str(p) for p in removals]))
    by_owner: dict[str, int] = {}
    for path in removals:
        by_owner[_owner(path, sites)] = by_owner.get(_owner(path, sites), 0) + _size(path)
    before = sum(_size(site) for site in sites)
    verb = "would remove" if args.dry_run else "removing"
    for owner, size in sorted(by_owner.items(), key=lambda item: -item[1]):
        print(f"prune_site_packages: {verb} {size / 1e6:6.1f} MB of {owner}")
    if not args.dry_run:
        for path in removals:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    strip = shutil.which("strip")
    heavy = debug_heavy(sites)
    for path, debug in sorted(heavy.items(), key=lambda item: -item[1]):
        verb = "would strip" if args.dry_run or strip is None else "stripping"
        print(f"prune_site_packages: {verb} {debug / 1e6:6.1f} MB of debug information from {path.name}")
    if args.dry_run:
        planned = sum(by_owner.values()) + sum(heavy.values())
        print(f"prune_site_packages: site-packages {before / 1e6:.1f} MB, {planned / 1e6:.1f} MB to go")
        return 0
    stripped: list[str] = []
    if heavy and strip is None:
        print("prune_site_packages: no `strip` on PATH (binutils): debug information stays", file=sys.stderr)
    elif heavy and strip is not None:
        stripped = [str(path) for path in heavy]
        subprocess.run([strip, "--strip-debug", *stripped], check=True)
    after = sum(_size(site) for site in sites)
    print(f"prune_site_packages: site-packages {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB; verifying")
    missing = [f for f in run_probe(stripped) if not os.path.exists(f)]
    if missing:
        print(f"prune_site_packages: the server loaded removed files: {missing[:5]}", file=sys.stderr)
        return 1
    print("prune_site_packages: the server works")
    return 0


if __name__ == "__main__":
    sys.exit(main())
