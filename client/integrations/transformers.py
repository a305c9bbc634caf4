"""Hugging Face ``transformers.Trainer`` fed by RemoteLoaders: ``RemoteTrainer``.

    from remoteloader.integrations.transformers import RemoteTrainer

    trainer = RemoteTrainer(model=model, args=TrainingArguments(...), train_loader=train, eval_loader=val)
    trainer.train()                               # or train(resume_from_checkpoint=True)

Trainer builds a ``DataLoader`` from a dataset; ``RemoteTrainer`` takes its batches from the
loaders instead, and changes what that needs, nothing else:

* batches: each ``(images, labels)`` batch becomes the model's keyword arguments (``input_names``,
  default ``pixel_values`` and ``labels``);
* epochs: Trainer calls ``set_epoch(epoch)`` at each epoch's start, which the loader follows
  (``client/epoch.py``); each evaluation plays epoch 0 of the evaluation loader, the same batches
  every time;
* checkpoints: each checkpoint folder holds the training loader's ``state_dict()`` (one file per
  process, as Trainer's RNG states: ``remoteloader_state.json``, or ``remoteloader_state_<rank>.json``
  with several), written before Trainer writes its own files;
* resume: ``train(resume_from_checkpoint=...)`` loads that state before training, so the resumed
  epoch continues at its next batch, without Trainer's ``skip_first_batches`` (which rebuilds a
  ``DataLoader`` from a dataset the loader does not have, and would decode and drop every batch
  already trained). Trainer's own count of what was trained (its epoch and the batches into it)
  is checked against the loaded position: a mismatch is an error, never another sequence.
  ``ignore_data_skip=True`` starts the resumed epoch over, as Trainer does with its loaders.

Batch sizes are the loaders' (``per_device_*_batch_size`` are not used for batches; Trainer's
logs and sample counts use the training loader's). ``auto_find_batch_size`` is refused: a
loader's batch size is fixed when it is made.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from remoteloader.client.loader import RemoteLoader

try:
    from transformers import Trainer
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as exc:  # an optional extra: the client needs none of it
    raise ImportError(
        f"remoteloader.integrations.transformers needs Hugging Face transformers 5 ({exc}): "
        f"pip install 'remoteloader[transformers]'"
    ) from exc

__all__ = ["RemoteTrainer", "model_inputs"]

InputNames = Sequence[str | None] | Mapping[str, str] | Callable[[Any], Mapping[str, Any]]


def state_file(world_size: int, process_index: int) -> str:
    """The name of a process's loader state in a checkpoint folder (as Trainer names its RNG states)."""
    return "remoteloader_state.json" if world_size <= 1 else f"remoteloader_state_{process_index}.json"


def model_inputs(names: InputNames) -> Callable[[Any], dict[str, Any]]:
    """What turns a loader's batch into the model's keyword arguments.

    Args:
        names: For tuple batches (``(images, labels)``, ``(images, labels, ids)`` with
            ``return_ids=True``), the argument each element goes to, in order, None to drop one:
            e.g. ``("pixel_values", "labels", None)``. For dict batches (targets, docs/targets.md),
            a mapping from the batch's keys to argument names; keys not named are dropped. Or a
            callable taking a batch and returning the arguments.
    """
    if callable(names):
        return lambda batch: dict(names(batch))
    if isinstance(names, Mapping):
        keys = dict(names)
        if not keys or not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
            raise ValueError(
                f"input_names={names!r}: expected {{batch key: argument name}}, e.g. {{'images': 'pixel_values'}}"
            )
        return lambda batch: _from_dict(batch, keys)
    if isinstance(names, str) or not all(n is None or isinstance(n, str) for n in names) or not any(names):
        raise ValueError(
            f"input_names={names!r}: expected an argument name (or None) for each element of a batch, "
            f"e.g. ('pixel_values', 'labels'), a mapping for dict batches, or a callable"
        )
    order = tuple(names)
    return lambda batch: _from_tuple(batch, order)


def _from_tuple(batch: Any, names: tuple[str | None, ...]) -> dict[str, Any]:
    if not isinstance(batch, tuple):
        raise ValueError(
            f"input_names={names!r} names the elements of tuple batches, and this loader's batches are "
            f"{type(batch).__name__}s (with keys {sorted(batch) if isinstance(batch, dict) else '?'}): pass a "
            f"mapping from those keys to the model's arguments, or a callable"
        )
    if len(batch) != len(names):
        raise ValueError(
            f"input_names={names!r} names {len(names)} elements, and the batches have {len(batch)} "
            f"((images, labels{', ids' if len(batch) == 3 else ''})): name each, None for one the model does not take"
        )
    return {name: value for name, value in zip(names, batch) if name is not None}


def _from_dict(batch: Any, keys: dict[str, str]) -> dict[str, Any]:
    if not isinstance(batch, dict):
        raise ValueError(
            f"input_names={keys!r} maps the keys of dict batches, and this loader's are "
            f"{type(batch).__name__}s: name their elements in order instead, e.g. ('pixel_values', 'labels')"
        )
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"input_names maps {missing}, which the batches do not have (they have {sorted(batch)})")
    return {name: batch[key] for key, name in keys.items()}


class _Resume(NamedTuple):
    """A position loaded from a checkpoint, which Trainer's own count must agree with."""

    checkpoint: str
    epoch: int
    position: int


class LoaderInputs:
    """A loader as Trainer iterates it: its batches as the model's keyword arguments.

    ``len`` and ``set_epoch`` are the loader's; there is no ``dataset`` (Trainer counts samples by
    it, and Accelerate's ``skip_first_batches`` rebuilds a DataLoader from it). ``resume``: the
    position loaded into the loader, checked at Trainer's first ``set_epoch``.
    """

    def __init__(self, loader: RemoteLoader, to_inputs: Callable[[Any], dict[str, Any]], resume: _Resume | None = None):
        self.loader = loader
        self._to_inputs = to_inputs
        self._resume = resume
        self._skipped: int | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            yield self._to_inputs(batch)

    def skip(self, batches: int) -> None:
        """Trainer resumes ``batches`` into its epoch (``get_resumed_dataloader``)."""
        self._skipped = batches

    def set_epoch(self, epoch: int) -> None:
        resume, self._resume = self._resume, None
        skipped = self._skipped or 0
        if resume is not None and (epoch, skipped) != (resume.epoch, resume.position):
            raise ValueError(
                f"{resume.checkpoint}: its RemoteLoader state is at batch {resume.position} of epoch {resume.epoch}, "
                f"and Trainer resumes at batch {skipped} of epoch {epoch} (from its global step, "
                f"gradient_accumulation_steps and {len(self)} batches per epoch): was the checkpoint written with "
                f"other TrainingArguments, or another loader? Resume with the ones that wrote it"
            )
        self.loader.set_epoch(epoch)


class RemoteTrainer(Trainer):
    """A ``transformers.Trainer`` whose batches come from RemoteLoaders, resumed exactly.

    Args:
        model, args: As for ``Trainer``.
        train_loader: The RemoteLoader that ``train()`` plays (default None: ``train()`` says it
            needs one). Make it with ``normalize=`` (the model's mean and std, e.g. its image
            processor's ``image_mean``/``image_std``): models take float ``pixel_values``; and on
            a GPU, ``device=args.device``.
        eval_loader: The RemoteLoader that ``evaluate()`` and ``eval_strategy`` play (or a dict of
            them by name, as Trainer's ``eval_dataset``); default None. ``shuffle=False`` and an
            eval pipeline, as for any evaluation.
        input_names: The model's argument for each element of a batch (``model_inputs``); default
            ``("pixel_values", "labels")``.
        **kwargs: Any other ``Trainer`` argument (``compute_metrics``, ``callbacks``,
            ``optimizers``...), except ``train_dataset`` and ``eval_dataset``: the loaders are those.
    """

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        *,
        train_loader: RemoteLoader | None = None,
        eval_loader: RemoteLoader | Mapping[str, RemoteLoader] | None = None,
        input_names: InputNames = ("pixel_values", "labels"),
        **kwargs: Any,
    ):
        given = [name for name in ("train_dataset", "eval_dataset") if kwargs.get(name) is not None]
        if given:
            raise TypeError(
                f"RemoteTrainer takes train_loader= and eval_loader= (RemoteLoaders), not {' or '.join(given)}"
            )
        for name, loader in (("train_loader", train_loader), ("eval_loader", eval_loader)):
            loaders = loader.values() if isinstance(loader, Mapping) else [loader]
            wrong = [type(one).__name__ for one in loaders if one is not None and not isinstance(one, RemoteLoader)]
            if wrong:
                raise TypeError(f"RemoteTrainer: {name} must be a RemoteLoader, got {', '.join(wrong)}")
        self.to_inputs = model_inputs(input_names)
        self.train_loader = train_loader
        self._resume: _Resume | None = None
        kwargs.pop("train_dataset", None)
        kwargs.pop("eval_dataset", None)
        # Trainer checks that an eval_strategy has something to evaluate: the loader(s) are that.
        super().__init__(model=model, args=args, eval_dataset=eval_loader, **kwargs)
        if self.args.auto_find_batch_size:
            raise ValueError(
                "RemoteTrainer: auto_find_batch_size=True would retry with smaller batches, and a RemoteLoader's "
                "batch_size is fixed when it is made: make the loader with the batch size that fits"
            )

    # ---- batches ----------------------------------------------------------------------
    def get_train_dataloader(self) -> Any:
        if self.train_loader is None:
            raise ValueError("RemoteTrainer: training needs a train_loader (RemoteTrainer(..., train_loader=...))")
        resume, self._resume = self._resume, None
        return LoaderInputs(self.train_loader, self.to_inputs, resume)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """The evaluation loader (by name, with several), from epoch 0 at each evaluation; a
        dataset that is not a RemoteLoader gets Trainer's own DataLoader."""
        chosen = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(eval_dataset, str) and isinstance(self.eval_dataset, Mapping):
            chosen = self.eval_dataset[eval_dataset]
        if not isinstance(chosen, RemoteLoader):
            return super().get_eval_dataloader(eval_dataset)
        chosen.set_epoch(0)
        return LoaderInputs(chosen, self.to_inputs)

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """A RemoteLoader passed to ``predict()`` plays its epoch 0; a dataset gets Trainer's DataLoader."""
        if not isinstance(test_dataset, RemoteLoader):
            return super().get_test_dataloader(test_dataset)
        test_dataset.set_epoch(0)
        return LoaderInputs(test_dataset, self.to_inputs)

    def num_examples(self, dataloader: Any) -> int:
        """Samples an epoch of the loader plays on every rank (Trainer's logs, speed metrics)."""
        if isinstance(dataloader, LoaderInputs):
            return len(dataloader) * dataloader.loader.options.batches.batch_size * dataloader.loader.world_size
        return super().num_examples(dataloader)

    def get_total_train_batch_size(self, args: Any) -> int:
        total = super().get_total_train_batch_size(args)
        if self.train_loader is None:
            return total
        return (
            total // self._train_batch_size * self.train_loader.options.batches.batch_size
        )  # the loader's batches, not args'

    # ---- checkpoints and resume -------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # Trainer's own folder for this step (its _save_checkpoint names it so), with the loader's state
        # written first: a checkpoint with trainer_state.json always has it.
        if self.train_loader is not None:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, state_file(self.args.world_size, self.args.process_index))
            with open(path + ".tmp", "w") as f:
                json.dump(self.train_loader.state_dict(), f)
            os.replace(path + ".tmp", path)
        super()._save_checkpoint(model, trial)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """Trainer's ``train``; from a checkpoint, the training loader continues where it was saved."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)  # (None: Trainer says so)
            resume_from_checkpoint = resume_from_checkpoint if resume_from_checkpoint is not None else True
        if isinstance(resume_from_checkpoint, str) and not self.args.ignore_data_skip and self.train_loader is not None:
            self._resume = self._load_loader_state(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _load_loader_state(self, checkpoint: str) -> _Resume:
        path = os.path.join(checkpoint, state_file(self.args.world_size, self.args.process_index))
        if not os.path.isfile(path):
            found = (
                sorted(f for f in os.listdir(checkpoint) if f.startswith("remoteloader_state"))
                if os.path.isdir(checkpoint)
                else []
            )
            raise ValueError(
                f"{checkpoint} holds no RemoteLoader state for this process ({os.path.basename(path)}; found "
                f"{found or 'none'}): written by another Trainer, or with another number of processes. Resume it "
                f"with ignore_data_skip=True to start its epoch over, or with the number of processes that wrote it"
            )
        with open(path) as f:
            state = json.load(f)
        assert self.train_loader is not None
        self.train_loader.load_state_dict(state)
        loaded = self.train_loader.state_dict()  # (a state saved as its epoch ended says the next epoch)
        return _Resume(checkpoint, loaded["epoch"], loaded["position"])

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        """The loader itself: its loaded position is the one Trainer resumes at (checked at its
        ``set_epoch``), without decoding and dropping the batches already trained."""
        if not isinstance(dataloader, LoaderInputs):
            return super().get_resumed_dataloader(dataloader, num_batches)
        dataloader.skip(num_batches)
        return dataloader
