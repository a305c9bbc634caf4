"""The forms a delivered batch takes for the training loop.

* ``(images, labels)``, or ``(images, labels, ids)`` with ``return_ids``: classification, when
  the loader's batches hold no targets (``fields`` None and the servers carry only labels);
* a dict of ``"images"`` and each field (``"label"`` a tensor, ``"mask"`` a uint8 [B, H, W]
  tensor, the other fields lists of per-sample tensors), and ``"ids"`` with ``return_ids``;
* ``batch_format="torchvision"``: torchvision's detection form (``torchvision_form.py``);
* with ``clip_frames``: a dict of ``"video"`` (``clips.as_video``), ``"label"``, the fields asked
  for (``"frame_indices"`` one tensor) and ``"ids"`` with ``return_ids``.
"""

from __future__ import annotations

from typing import Any

from remoteloader.client.clips import as_video, frame_indices
from remoteloader.client.delivery import Delivered
from remoteloader.client.options import LoaderOptions
from remoteloader.client.torchvision_form import torchvision_form
from remoteloader.protos import targets as tg


def _clip_batch(delivered: Delivered, options: LoaderOptions, fields: tuple[str, ...] | None) -> dict[str, Any]:
    """A batch of clips: "video", "label", the fields asked for, "ids" (client/clips.py)."""
    clip, images = options.clip, delivered.images
    assert clip is not None, "only for a loader of clips"
    video = as_video(images, clip, options.output.normalize is not None)
    batch: dict[str, Any] = {"video": video, tg.LABEL: delivered.labels}
    for name in fields or ():
        if name == tg.FRAME_INDICES:  # the same shape for every clip: one tensor [B, T] ([B, K, T])
            batch[name] = frame_indices(delivered.targets[name], clip, images.device)
        elif name != tg.LABEL:
            batch[name] = delivered.targets[name]
    if options.output.return_ids:
        batch["ids"] = delivered.ids
    return batch


def user_batch(delivered: Delivered, options: LoaderOptions, fields: tuple[str, ...] | None) -> tuple | dict[str, Any]:
    """``delivered`` in the loader's form; ``fields``: what a dict batch holds besides the images
    (None: tuples)."""
    images, labels, ids, targets = delivered.images, delivered.labels, delivered.ids, delivered.targets
    if options.clip is not None:
        return _clip_batch(delivered, options, fields)
    if options.output.batch_format == "torchvision":
        return torchvision_form(images, targets, ids, options)
    if fields is not None:
        batch: dict[str, Any] = {"images": images}
        for name in fields:
            batch[name] = labels if name == tg.LABEL else targets[name]
        if options.output.return_ids:
            batch["ids"] = ids
        return batch
    return (images, labels, ids) if options.output.return_ids else (images, labels)
