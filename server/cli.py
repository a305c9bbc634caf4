"""Command line: ``remoteloader serve|demo|pack`` and ``remoteloader-server``."""

from __future__ import annotations

import argparse
import importlib
import sys

from remoteloader.server import config as config_module

# The ``server`` extra's modules (pyproject.toml). The client (``pip install remoteloader``)
# has none of them, so each subcommand imports its module only when it runs: ``probe`` and
# ``demo --connect`` need only the client's dependencies.
SERVER_EXTRA = {"cv2", "simplejpeg", "albumentations", "uvloop", "tqdm", "prometheus_client"}

# Subcommand: (module, help). ``serve`` is handed to serve_main with its flags as they are.
COMMANDS = {
    "demo": ("remoteloader.server.demo", "train a small CNN fed by two local loader servers"),
    "pack": ("remoteloader.server.pack", "write WebDataset tar shards from an ImageFolder tree"),
    "probe": ("remoteloader.server.probe", "exit 0 when a loader server's gRPC health is SERVING"),
}


def _missing_server_extra(exc: ModuleNotFoundError, prog: str) -> int:
    """One line for a server dependency that is not installed; anything else is a bug: raised."""
    if (exc.name or "").partition(".")[0] not in SERVER_EXTRA:
        raise exc
    print(f"{prog} needs the server extra: pip install 'remoteloader[server]' (no module named {exc.name!r})",
          file=sys.stderr)
    return 2


def _serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    config_module.add_arguments(parser)
    return parser


def serve_main(argv: list[str] | None = None, prog: str = "remoteloader-server") -> int:
    """``remoteloader-server``: run one loader server."""
    parser = _serve_parser(argparse.ArgumentParser(
        prog=prog, description="Serve image shards as augmented uint8 batches over gRPC."))
    args = parser.parse_args(argv)
    for name in config_module.unknown_variables():
        print(f"{prog}: warning: {name} is set but names no setting (see --help); ignored", file=sys.stderr)
    try:
        config = config_module.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        from remoteloader.server.app import run
    except ModuleNotFoundError as exc:
        return _missing_server_extra(exc, prog)
    try:
        run(config)
    except (ValueError, OSError) as exc:  # bad data, token, certificates or port: say so, no traceback
        print(f"remoteloader-server: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        return serve_main(argv[1:], prog="remoteloader serve")
    parser = argparse.ArgumentParser(prog="remoteloader", description="Remote data feeding for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run a loader server (same flags as remoteloader-server)", add_help=False)
    module = None
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text)
        if argv and argv[0] == name:  # only the one asked for: its flags, and its --help
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                return _missing_server_extra(exc, f"remoteloader {name}")
            module.add_arguments(command)
    args = parser.parse_args(argv)
    try:
        return module.run(args)
    except ModuleNotFoundError as exc:  # e.g. the demo's local servers and dataset need the server extra
        return _missing_server_extra(exc, f"remoteloader {args.command}")
    except KeyboardInterrupt:
        if args.command != "demo":
            raise
        print("interrupted; loader servers stopped", file=sys.stderr)  # Ctrl-C or SIGTERM: stopped on the way out
        return 130


if __name__ == "__main__":
    sys.exit(main())
