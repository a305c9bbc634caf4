"""Command line: ``remoteloader serve|demo|pack`` and ``remoteloader-server``."""

from __future__ import annotations

import argparse
import sys

from remoteloader.server import config as config_module


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
    from remoteloader.server.app import run

    try:
        run(config)
    except (ValueError, OSError) as exc:  # bad data, token, certificates or port: say so, no traceback
        print(f"remoteloader-server: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="remoteloader", description="Remote data feeding for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run a loader server (same flags as remoteloader-server)", add_help=False)
    demo = sub.add_parser("demo", help="train a small CNN fed by two local loader servers")
    from remoteloader.server import demo as demo_module

    demo_module.add_arguments(demo)
    pack = sub.add_parser("pack", help="write WebDataset tar shards from an ImageFolder tree")
    from remoteloader.server import pack as pack_module

    pack_module.add_arguments(pack)
    probe = sub.add_parser("probe", help="exit 0 when a loader server's gRPC health is SERVING")
    from remoteloader.server import probe as probe_module

    probe_module.add_arguments(probe)
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        return serve_main(argv[1:], prog="remoteloader serve")
    args = parser.parse_args(argv)
    if args.command == "demo":
        try:
            return demo_module.run(args)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the servers were stopped on the way out
            print("interrupted; loader servers stopped", file=sys.stderr)
            return 130
    if args.command == "probe":
        return probe_module.run(args)
    return pack_module.run(args)


if __name__ == "__main__":
    sys.exit(main())
