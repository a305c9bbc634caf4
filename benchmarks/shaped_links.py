"""Replicas behind shaped links: images/s, each link's utilization and each server's share.

Each configuration runs two (or more) replicas of one synthetic shard, each in a network
namespace of its own behind a veth pair whose server->trainer direction ``tc tbf`` shapes to
the rate given (``remoteloader.tools.shaped_links``, no root needed), bound off the loopback
with a token, and reads a warm-up epoch and a timed one. Printed per configuration: the
images/s of the timed epoch, the utilization of the links' combined capacity by the samples
delivered (each once), and each server's share of the samples beside its ideal share (its
rate over the sum of the rates).

    python benchmarks/shaped_links.py                       # 1:5 and 1:10, 224 px, batch 256
    python benchmarks/shaped_links.py --rates 60,300 --rates 50,500 --image-size 224
"""

from __future__ import annotations

import argparse
import json
import sys

from remoteloader.tools import shaped_links


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", action="append", help="Mbit/s per server, comma-separated (repeatable)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--samples", type=int, default=6000, help="samples of the synthetic shard (an epoch)")
    parser.add_argument("--loader-args", default="{}", help="JSON of further RemoteLoader arguments")
    parser.add_argument("--json", help="write the reports to this file")
    args = parser.parse_args()
    reason = shaped_links.available()
    if reason:
        print(f"shaped links cannot be made here: {reason}", file=sys.stderr)
        return 2
    configurations = [[float(v) for v in r.split(",")] for r in (args.rates or ["50,250", "50,500"])]
    reports = []
    print(f"{'links Mbit/s':>14} {'ratio':>6} {'images/s':>9} {'utilization':>11}  shares (ideal)")
    for rates in configurations:
        report = shaped_links.measure(
            rates,
            samples=args.samples,
            image_size=args.image_size,
            batch_size=args.batch_size,
            loader_args=json.loads(args.loader_args),
        )
        reports.append(report)
        assert report["samples"] == report["distinct"], "a sample came twice"
        shares = ", ".join(f"{s['share']:.3f} ({s['ideal_share']:.3f})" for s in report["servers"].values())
        print(
            f"{'+'.join(f'{r:g}' for r in rates):>14} {f'1:{max(rates) / min(rates):g}':>6} "
            f"{report['images_per_s']:9.0f} {report['utilization']:10.1%}  {shares}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
