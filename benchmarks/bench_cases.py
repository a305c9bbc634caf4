"""`remoteloader bench` on three configurations: enough servers, too few, and a slow link.

Each runs real loader servers on the benchmark's ImageNet-like JPEGs (packed shards, see
``_common``) and prints `remoteloader bench`'s table and verdict, as a user would see them:

  enough     two servers of one decode worker, a training step of 0.4 s per batch of 64
  too-few    one server of one worker, a step of 0.02 s per batch (3200 images/s)
  slow-link  one server behind a 100 Mbit/s link (a network namespace, ``tc tbf``, off the
             loopback, with a token: ``remoteloader.tools.shaped_links --bench``), a step of
             0.4 s per batch

    python benchmarks/bench_cases.py [--cases enough too-few slow-link] [--seconds 8]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

from remoteloader.tools import shaped_links  # noqa: E402
from remoteloader.tools.local import LocalServer  # noqa: E402

CASES = {  # servers, --step-time, link Mbit/s (None: the loopback)
    "enough": (2, 0.4, None),
    "too-few": (1, 0.02, None),
    "slow-link": (1, 0.4, 100.0),
}


def bench(addresses: list[str], step_time: float, args: argparse.Namespace) -> int:
    argv = [sys.executable, "-m", "remoteloader.tools.cli", "bench", ",".join(addresses), "--batch-size", "64",
            "--step-time", str(step_time), "--seconds", str(args.seconds)]
    return subprocess.call(argv)


def run_case(name: str, data: pathlib.Path, args: argparse.Namespace) -> int:
    count, step_time, rate = CASES[name]
    print(f"\n## {name}: {count} server(s) of 1 worker"
          + (f" behind a {rate:g} Mbit/s link" if rate else " on 127.0.0.1")
          + f", a step of {step_time:g} s per batch of 64\n", flush=True)
    if rate:
        reason = shaped_links.available()
        if reason:
            print(f"skipped: shaped links cannot be made here: {reason}")
            return 0
        return shaped_links.main(["--rates", str(rate), "--data", str(data), "--bench", "--batch-size", "64",
                                  "--step-time", str(step_time), "--seconds", str(args.seconds)])
    servers = [LocalServer(data, args=["--workers", "1", "--log-level", "WARNING"]).start(120) for _ in range(count)]
    try:
        return bench([s.address for s in servers], step_time, args)
    finally:
        for server in servers:
            server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), help="default: all three")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured per configuration")
    parser.add_argument("--data", type=pathlib.Path, default=_common.DEFAULT_DATA, help="cached ImageFolder")
    parser.add_argument("--images", type=int, default=2000, help="images in --data (default 2000), packed once")
    args = parser.parse_args()
    root = _common.ensure_dataset(args.data, args.images)
    data = _common.served_data(root, "packed", _common.default_cores())
    return max(run_case(name, data, args) for name in args.cases)


if __name__ == "__main__":
    sys.exit(main())
