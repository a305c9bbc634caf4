"""Lightning training over RemoteLoaders, for tests/test_frameworks.py: what each rank trained on.

    python lightning_job.py CONFIG_JSON

CONFIG: ``servers`` (the loader servers' addresses), ``out`` (a folder), ``runs``: a list of
fits, run one after another in this process, each with ``name``, ``devices`` (2: DDP on two CPU
processes), ``epochs``, ``loaders`` ("fit": made before the Trainer and passed to ``fit``, as
the loaders' ranks are not known yet; "hooks": made in the LightningModule's
``train_dataloader``/``val_dataloader``), and optionally ``ckpt_every`` (a ModelCheckpoint
every N training steps, into ``out/<name>-ckpt``), ``ckpt_epochs`` (the checkpoints Lightning
users keep most, once an epoch, into ``out/<name>-<kind>``: "val-end",
``ModelCheckpoint(every_n_epochs=1)``, which with validation loaders saves when validation ends;
"train-end", one saved when the training epoch ends, with ``save_last``; Lightning allows one
of them per Trainer) and ``resume`` (a checkpoint to resume from). No run calls ``set_epoch``:
Lightning's own calls are all the loaders get.

Each rank of each run writes ``out/<name>-rank<R>.json``: ``train``, one ``[epoch, ids, pixels
digest]`` per training step, and ``val``, one ``[epoch, sanity check?, ids]`` per validation step.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from remoteloader.client import RemoteLoader

config = json.loads(sys.argv[1])


def make_loader(train: bool) -> RemoteLoader:
    return RemoteLoader(
        config["servers"],
        batch_size=4,
        image_size=16,
        pipeline="train" if train else "eval",
        shuffle=train,
        seed=11,
        return_ids=True,
        connect_timeout=30,
        prefetch=2,
    )


class Model(L.LightningModule):
    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.net = torch.nn.Linear(3, 8)
        self.record: dict[str, list] = {"train": [], "val": []}

    def training_step(self, batch, index):
        images, labels, ids = batch
        digest = hashlib.blake2b(images.numpy().tobytes(), digest_size=8).hexdigest()
        self.record["train"].append([self.current_epoch, ids.tolist(), digest])
        return torch.nn.functional.cross_entropy(self.net(images.float().mean(dim=(1, 2)) / 255), labels)

    def validation_step(self, batch, index):
        _images, _labels, ids = batch
        self.record["val"].append([self.current_epoch, self.trainer.sanity_checking, ids.tolist()])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_fit_end(self):
        with open(os.path.join(config["out"], f"{self.name}-rank{self.global_rank}.json"), "w") as f:
            json.dump(self.record, f)


class HookModel(Model):
    def train_dataloader(self):
        return make_loader(train=True)

    def val_dataloader(self):
        return make_loader(train=False)


for run in config["runs"]:
    callbacks = []
    folder = os.path.join(config["out"], run["name"])
    if run.get("ckpt_every"):
        callbacks.append(
            ModelCheckpoint(
                dirpath=f"{folder}-ckpt", filename="{step}", every_n_train_steps=run["ckpt_every"], save_top_k=-1
            )
        )
    if run.get("ckpt_epochs") == "val-end":
        callbacks.append(
            ModelCheckpoint(dirpath=f"{folder}-val-end", filename="{epoch}", every_n_epochs=1, save_top_k=-1)
        )
    elif run.get("ckpt_epochs") == "train-end":
        callbacks.append(
            ModelCheckpoint(
                dirpath=f"{folder}-train-end",
                filename="{epoch}",
                every_n_epochs=1,
                save_top_k=-1,
                save_on_train_epoch_end=True,
                save_last=True,
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=run["devices"],
        strategy="ddp" if run["devices"] > 1 else "auto",
        max_epochs=run["epochs"],
        num_sanity_val_steps=2,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if run["loaders"] == "hooks":
        trainer.fit(HookModel(run["name"]), ckpt_path=run.get("resume"))
    else:
        train, val = make_loader(train=True), make_loader(train=False)
        trainer.fit(Model(run["name"]), train_dataloaders=train, val_dataloaders=val, ckpt_path=run.get("resume"))
