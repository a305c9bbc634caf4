"""What the start-up check that every key names one sample costs (formats/keys.py, issue 42).

Builds ``--samples`` keys over ``--shards`` shards in memory, in two layouts: ImageNet-like
names unique across shards (``n<class>/n<class>_<i>.JPEG``: the check finds nothing and changes
nothing), and TFRecord record numbers that every file repeats (``record-00000000``...: every
shard's keys then carry its file, and the keys are checked again so). Reports the CPU seconds
of ``make_unique`` (the machine's other load does not count), the best of ``--rounds``.

    python benchmarks/sample_keys.py [--samples 1000000] [--shards 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

from remoteloader.server.catalog import KeyTable, Shard
from remoteloader.server.formats.keys import make_unique


def shards(count: int, per_shard: int, repeated: bool) -> list[Shard]:
    out = []
    for s in range(count):
        table = KeyTable()
        for i in range(per_shard):
            table.add(f"record-{i:08d}" if repeated else f"n{s:08d}/n{s:08d}_{i}.JPEG", 0, 0, 1)
        out.append(Shard(f"train-{s:05d}-of-{count:05d}.tfrecord", table, [], f"id-{s}"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    per_shard = args.samples // args.shards
    for repeated in (False, True):
        best = float("inf")
        for _ in range(args.rounds):
            built = shards(args.shards, per_shard, repeated)
            started = time.process_time()
            make_unique(built)
            best = min(best, time.process_time() - started)
        layout = "record numbers repeated in every file" if repeated else "names unique across files"
        print(f"{args.shards * per_shard:,} keys in {args.shards} shards, {layout}: {best:.2f} s CPU "
              f"(e.g. {built[1].key(0)!r})")


if __name__ == "__main__":
    main()
