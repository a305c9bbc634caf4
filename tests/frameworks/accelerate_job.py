"""Accelerate training over a RemoteLoader, for tests/test_frameworks.py: what each rank trained on.

    python accelerate_job.py CONFIG_JSON                      # one process
    accelerate launch --multi_gpu --num_processes 2 accelerate_job.py CONFIG_JSON   # two gloo processes

CONFIG: ``servers``, ``out`` (a folder), ``phase``: "train" plays two epochs and saves the
Accelerate state (``out/state``) after ``save_at`` steps of epoch 1; "resume" is a fresh job
that loads it and plays the rest. The loader is made before the Accelerator (so before the
process group), passed through ``prepare`` and registered for checkpointing. Each rank
writes ``out/<phase>-rank<R>.json``: ``steps``, one ``[epoch, ids, pixels digest]`` per step,
``prepared``, whether ``prepare`` handed back the loader itself, and ``skip``, what
``accelerator.skip_first_batches`` said of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
from accelerate import Accelerator

from remoteloader.client import RemoteLoader

config = json.loads(sys.argv[1])
loader = RemoteLoader(
    config["servers"], batch_size=4, image_size=16, seed=11, return_ids=True, connect_timeout=30, prefetch=2
)
accelerator = Accelerator(cpu=True)
model = torch.nn.Linear(3, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
accelerator.register_for_checkpointing(prepared)
state_dir = os.path.join(config["out"], "state")
steps = []


def train(epoch: int, stop_after: int | None = None) -> None:
    for step, (images, labels, ids) in enumerate(prepared):
        loss = torch.nn.functional.cross_entropy(model(images.float().mean(dim=(1, 2)) / 255), labels)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps.append([epoch, ids.tolist(), hashlib.blake2b(images.numpy().tobytes(), digest_size=8).hexdigest()])
        if stop_after is not None and step + 1 == stop_after:
            accelerator.save_state(state_dir)


try:
    accelerator.skip_first_batches(prepared, 1)
    skip = "returned"
except AttributeError as exc:
    skip = str(exc)
if config["phase"] == "train":
    for epoch in range(2):
        train(epoch, stop_after=config["save_at"] if epoch == 1 else None)
else:
    accelerator.load_state(state_dir)
    train(prepared.epoch)
record = {"steps": steps, "prepared": prepared is loader, "skip": skip}
with open(os.path.join(config["out"], f"{config['phase']}-rank{accelerator.process_index}.json"), "w") as f:
    json.dump(record, f)
loader.close()
accelerator.wait_for_everyone()
accelerator.end_training()
if torch.distributed.is_initialized():  # (left to exit, gloo's threads may abort the process: SIGABRT)
    torch.distributed.destroy_process_group()
