"""Regenerate the committed protobuf code: ``python -m remoteloader.protos.generate [--check]``.

The proto is staged at ``remoteloader/protos/loader.proto`` under a temporary include root so
that the generated code imports ``from remoteloader.protos import loader_pb2``. With
``--check`` nothing is written; the exit status is 1 when the committed files differ.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
GENERATED = ("loader_pb2.py", "loader_pb2.pyi", "loader_pb2_grpc.py")


def generate(out_dir: pathlib.Path) -> None:
    """Runs protoc (from grpcio-tools) on loader.proto, writing into ``out_dir``."""
    from grpc_tools import protoc  # test/dev dependency only

    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        staged = root / "remoteloader" / "protos"
        staged.mkdir(parents=True)
        shutil.copy(HERE / "loader.proto", staged / "loader.proto")
        gen = root / "gen"
        gen.mkdir()
        args = [
            "protoc",
            f"-I{root}",
            f"-I{pathlib.Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={gen}",
            f"--pyi_out={gen}",
            f"--grpc_python_out={gen}",
            "remoteloader/protos/loader.proto",
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        for name in GENERATED:
            shutil.copy(gen / "remoteloader" / "protos" / name, out_dir / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args(argv)
    if not args.check:
        generate(HERE)
        print(f"wrote {', '.join(GENERATED)} in {HERE}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(pathlib.Path(tmp))
        stale = [n for n in GENERATED if (pathlib.Path(tmp) / n).read_bytes() != (HERE / n).read_bytes()]
    if stale:
        print(f"stale generated code: {', '.join(stale)}; run python -m remoteloader.protos.generate", file=sys.stderr)
        return 1
    print("generated code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
