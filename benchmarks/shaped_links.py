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

With ``--wires``, each link rate (one server, real photos: the benchmark's photo-like JPEGs,
the "eval" pipeline) is read with each wire encoding, side by side: images/s, bytes per
image on the wire, and CPU per image of the server (its decode workers included) and of the
training process (which decodes the wire encoding on its I/O thread):

    python benchmarks/shaped_links.py --wires raw zstd jpeg95 --rates 50 --rates 100 --rates 200 --rates 400
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

from remoteloader.tools import shaped_links


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", action="append", help="Mbit/s per server, comma-separated (repeatable)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--samples", type=int, default=6000, help="samples of the synthetic shard (an epoch)")
    parser.add_argument("--loader-args", default="{}", help="JSON of further RemoteLoader arguments")
    parser.add_argument("--json", help="write the reports to this file")
    parser.add_argument("--wires", nargs="+", help="compare these wire encodings on each rate (one server, photos)")
    parser.add_argument("--photos", type=int, default=600, help="photos an epoch reads, with --wires")
    parser.add_argument("--workers", type=int, default=2, help="the server's decode workers, with --wires")
    args = parser.parse_args()
    reason = shaped_links.available()
    if reason:
        print(f"shaped links cannot be made here: {reason}", file=sys.stderr)
        return 2
    if args.wires:
        return wires(args)
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


def photos(count: int) -> pathlib.Path:
    """An ImageFolder of ``count`` of the benchmark's photos (links into its cached data set)."""
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import _common

    root = _common.ensure_dataset(_common.DEFAULT_DATA, max(count, 2000)) if not _common.read_manifest(
        _common.DEFAULT_DATA
    ) else _common.DEFAULT_DATA
    samples, classes = _common.list_samples(root)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="wire-photos-"))
    for path, label in samples[:: max(1, len(samples) // count)][:count]:
        (folder / classes[label]).mkdir(exist_ok=True)
        os.symlink(path, folder / classes[label] / pathlib.Path(path).name)
    return folder


def wires(args) -> int:
    folder = photos(args.photos)
    print(f"one server ({args.workers} decode workers), {args.photos} photos, eval {args.image_size} px, "
          f"batch {args.batch_size}, receiver thread, {os.cpu_count()} CPUs")
    print("| link Mbit/s | wire | images/s | KB/image on the wire | server CPU ms/image | trainer CPU ms/image |")
    print("| --- | --- | --- | --- | --- | --- |")
    reports = []
    for rates in [[float(v) for v in r.split(",")] for r in (args.rates or ["100"])]:
        for wire in args.wires:
            report = shaped_links.measure(
                rates,
                image_size=args.image_size,
                batch_size=args.batch_size,
                data=[folder],
                loader_args={**json.loads(args.loader_args), "wire": wire, "receiver": "thread"},
                server_args=["--workers", str(args.workers)],
            )
            report["wire"] = wire
            reports.append(report)
            assert report["samples"] == report["distinct"], "a sample came twice"
            print(f"| {'+'.join(f'{r:g}' for r in rates)} | {wire} | {report['images_per_s']:.0f} "
                  f"| {report['wire_bytes_per_image'] / 1e3:.1f} | {report['server_cpu_ms_per_image']:.2f} "
                  f"| {report['trainer_cpu_ms_per_image']:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
