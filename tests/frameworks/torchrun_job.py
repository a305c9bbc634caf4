"""A torchrun script with two RemoteLoaders, for tests/test_frameworks.py: one made before
``init_process_group`` (a common order in scripts), one after; each plays two epochs without
``set_epoch``.

    torchrun --nproc-per-node 2 torchrun_job.py CONFIG_JSON

CONFIG: ``servers``, ``out`` (a folder). Each rank writes ``out/rank<R>.json``: for "before" and
"after", one ``[epoch, ids]`` per batch, and ``len``, what ``len()`` said.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from remoteloader.client import RemoteLoader

config = json.loads(sys.argv[1])


def make_loader() -> RemoteLoader:
    return RemoteLoader(
        config["servers"], batch_size=4, image_size=16, seed=11, return_ids=True, connect_timeout=30, prefetch=2
    )


loaders = {"before": make_loader()}
dist.init_process_group("gloo")
loaders["after"] = make_loader()
record: dict[str, dict] = {}
for name, loader in loaders.items():
    batches = []
    for _ in range(2):
        epoch = loader.epoch
        batches += [[epoch, ids.tolist()] for _images, _labels, ids in loader]
    record[name] = {"batches": batches, "len": len(loader)}
    loader.close()
with open(os.path.join(config["out"], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
