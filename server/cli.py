"""``remoteloader-server``: parse the server's flags and ``REMOTELOADER_*`` variables, then serve.

The server's own entry point (the container's ENTRYPOINT); ``remoteloader serve`` is the same
command under the tools' dispatcher (``remoteloader.tools.cli``).
"""

from __future__ import annotations

import argparse
import signal
import sys

from remoteloader.server import config as config_module

# The ``server`` extra's modules (pyproject.toml). The client (``pip install remoteloader``)
# has none of them: the command imports them only once its flags are parsed.
SERVER_EXTRA = {"cv2", "simplejpeg", "albumentations", "uvloop", "tqdm", "prometheus_client"}


def missing_server_extra(exc: ModuleNotFoundError, prog: str) -> int:
    """One line for a server dependency that is not installed, and exit code 2; anything else
    is a bug: raised."""
    if (exc.name or "").partition(".")[0] not in SERVER_EXTRA:
        raise exc
    print(
        f"{prog} needs the server extra: pip install 'remoteloader[server]' (no module named {exc.name!r})",
        file=sys.stderr,
    )
    return 2


class _StoppedWhileStarting(Exception):
    """SIGTERM or SIGINT before the server serves (it then drains instead: app.run)."""


def _stop_while_starting(signum: int, _frame: object) -> None:
    raise _StoppedWhileStarting(signal.Signals(signum).name)


def serve_main(argv: list[str] | None = None, prog: str = "remoteloader-server") -> int:
    """Runs one loader server until SIGTERM or Ctrl-C; returns the exit code (2: bad flags, data,
    token, certificates or port, said in one line).

    A stop signal while it starts (importing, indexing its data, starting its workers) ends it
    at once with code 0: as PID 1 in a container a signal without a handler is ignored, and
    ``docker stop`` would wait out its whole grace period and kill it."""
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, _stop_while_starting)
    try:
        return _serve(argv, prog)
    except _StoppedWhileStarting as exc:
        print(f"{prog}: stopped while starting ({exc})", file=sys.stderr)
        return 0


def _serve(argv: list[str] | None, prog: str) -> int:
    parser = argparse.ArgumentParser(prog=prog, description="Serve image shards as augmented uint8 batches over gRPC.")
    config_module.add_arguments(parser)
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
        return missing_server_extra(exc, prog)
    try:
        run(config)
    except (ValueError, OSError) as exc:  # bad data, token, certificates or port: say so, no traceback
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(serve_main())
