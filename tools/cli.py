"""``remoteloader serve|bench|demo|pack|probe``: one command for the tools that may use both sides.

``serve`` hands its flags as they are to the server's own entry point (``remoteloader-server``,
``remoteloader.server.cli``). Each other subcommand is a module with ``add_arguments(parser)``
and ``run(args) -> exit code``, imported only when it is the one asked for: on a client-only
install (``pip install remoteloader``, no ``server`` extra) ``probe``, ``bench`` and
``demo --connect`` work, and the rest say in one line that they need the extra (exit 2).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from remoteloader.server.cli import missing_server_extra, serve_main

# Subcommand: (module, help).
COMMANDS = {
    "bench": (
        "remoteloader.tools.bench",
        "measure what loader servers deliver to this host, what limits it, and whether training is input-bound",
    ),
    "demo": ("remoteloader.tools.demo", "train a small CNN fed by two local loader servers"),
    "pack": (
        "remoteloader.tools.pack",
        "write WebDataset tar shards from an ImageFolder tree, a folder of class folders of videos or a COCO "
        "annotation file",
    ),
    "probe": ("remoteloader.tools.probe", "exit 0 when a loader server's gRPC health is SERVING"),
}


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand; returns its exit code."""
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
                return missing_server_extra(exc, f"remoteloader {name}")
            module.add_arguments(command)
    args = parser.parse_args(argv)
    assert module is not None  # parse_args exits on anything but a known subcommand, and serve returned above
    try:
        return module.run(args)
    except ModuleNotFoundError as exc:  # e.g. the demo's local servers and dataset need the server extra
        return missing_server_extra(exc, f"remoteloader {args.command}")


if __name__ == "__main__":
    sys.exit(main())
