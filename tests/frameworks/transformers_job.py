"""Hugging Face Trainer over RemoteLoaders (RemoteTrainer), for tests/test_frameworks.py: what each
rank trained and evaluated.

    python transformers_job.py CONFIG_JSON                                 # one process
    torchrun --nproc-per-node 2 transformers_job.py CONFIG_JSON           # two gloo processes

CONFIG: ``servers``, ``out`` (a folder), ``runs``: a list of trainings, run one after another in
this process, each with ``name``, ``epochs`` or ``max_steps``, and optionally ``accumulate``
(gradient_accumulation_steps, default 1), ``save`` ("epoch", or N: a checkpoint every N optimizer
steps, into ``out/<name>``; default none), ``eval`` (evaluate when each epoch ends) and
``resume`` (a checkpoint folder to resume from), ``refused`` (the run is expected to raise
ValueError, whose message is recorded as ``error``). The model is a small ResNet made from its
config (nothing downloaded); ids ride along as a third input that ``compute_loss`` takes off.

Each rank of each run writes ``out/<name>-rank<R>.json``: ``train``, one ``[epoch, ids, pixels
digest]`` per batch trained (micro-batches, with accumulation), ``eval``, one ``[evaluation, ids]``
per batch evaluated, ``global_step``, ``len``, the training loader's length, and ``delivered``,
the batches it delivered (a resumed run decodes none that it does not train).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys

import torch
from transformers import ResNetConfig, ResNetForImageClassification, TrainerCallback, TrainingArguments

from remoteloader.client import RemoteLoader
from remoteloader.integrations.transformers import RemoteTrainer

config = json.loads(sys.argv[1])
torch.set_num_threads(1)  # a tiny model on a shared CPU: more threads only wait for each other


def make_loader(train: bool) -> RemoteLoader:
    return RemoteLoader(
        config["servers"],
        batch_size=4,
        image_size=16,
        pipeline="train" if train else "eval",
        shuffle=train,
        seed=11,
        normalize=([0.5] * 3, [0.25] * 3),
        return_ids=True,
        connect_timeout=30,
        prefetch=2,
    )


class Recorder(TrainerCallback):
    """Which epoch Trainer is in (its state's, at each epoch's start) and how many evaluations ran."""

    def __init__(self):
        self.epoch = 0
        self.evaluations = 0

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.epoch = math.floor(state.epoch + 1e-6) if state.epoch else 0

    def on_evaluate(self, args, state, control, **kwargs):
        self.evaluations += 1


class RecordingTrainer(RemoteTrainer):
    def __init__(self, *args, recorder: Recorder, **kwargs):
        super().__init__(*args, callbacks=[recorder], **kwargs)
        self.recorder = recorder
        self.record: dict[str, list] = {"train": [], "eval": []}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs.pop("ids").tolist()
        if model.training:
            images = inputs["pixel_values"].detach().cpu().contiguous().numpy()
            digest = hashlib.blake2b(images.tobytes(), digest_size=8).hexdigest()
            self.record["train"].append([self.recorder.epoch, ids, digest])
        else:
            self.record["eval"].append([self.recorder.evaluations, ids])
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


for run in config["runs"]:
    torch.manual_seed(0)
    model = ResNetForImageClassification(
        ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4)
    )
    save = run.get("save")
    args = TrainingArguments(
        output_dir=os.path.join(config["out"], run["name"]),
        num_train_epochs=run.get("epochs", 1),
        max_steps=run.get("max_steps", -1),
        gradient_accumulation_steps=run.get("accumulate", 1),
        learning_rate=1e-3,
        eval_strategy="epoch" if run.get("eval") else "no",
        save_strategy="epoch" if save == "epoch" else ("steps" if save else "no"),
        save_steps=save if isinstance(save, int) else 500,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        logging_strategy="no",
        seed=0,
        dataloader_num_workers=0,
    )
    train, val = make_loader(train=True), make_loader(train=False)
    trainer = RecordingTrainer(
        model=model,
        args=args,
        train_loader=train,
        eval_loader=val if run.get("eval") else None,
        input_names=("pixel_values", "labels", "ids"),
        recorder=Recorder(),
    )
    try:
        trainer.train(resume_from_checkpoint=run.get("resume"))
        error = None
    except ValueError as exc:
        if not run.get("refused"):
            raise
        error = str(exc)
    record = {
        **trainer.record,
        "error": error,
        "global_step": trainer.state.global_step,
        "len": len(train),
        "delivered": train.stats()["batches"],
    }
    with open(os.path.join(config["out"], f"{run['name']}-rank{args.process_index}.json"), "w") as f:
        json.dump(record, f)
    train.close()
    val.close()
if torch.distributed.is_initialized():  # (left to exit, gloo's threads may abort the process: SIGABRT)
    torch.distributed.destroy_process_group()
