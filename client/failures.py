"""The loader's ``on_error``: what becomes of a batch with samples a server could not serve.

A server that cannot decode a sample sends zeros in its place and says why
(``SampleFailure``). ``"raise"`` ends the pass with a LoaderError listing them; ``"warn"`` and
``"skip"`` drop those rows from the batch (warning first); a callable is given the failures
and the batch is kept as it is. A batch left with no rows is dropped, with a warning: that
rank then yields fewer batches than ``len(loader)``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from remoteloader.client.batches import LoaderError
from remoteloader.client.delivery import Delivered
from remoteloader.client.option_groups import ErrorHandler, OnError


def apply(on_error: ErrorHandler, batch: Delivered) -> Delivered | None:
    """``batch`` as the training loop gets it under ``on_error`` (None: none of its rows is left)."""
    if not batch.failures:
        return batch
    keep = _rows_to_keep(on_error, batch)
    if keep is None:
        return batch
    keep_on = keep.to(batch.images.device)
    rows = keep.tolist()
    targets: dict[str, Any] = {
        name: [v for v, k in zip(value, rows) if k] if isinstance(value, list) else value[keep_on]
        for name, value in batch.targets.items()
    }
    ids = batch.ids[keep]
    if len(ids) == 0:
        warnings.warn(
            f"batch {batch.seq}: none of its {len(keep)} samples could be served, so it "
            f"is left out and this rank yields fewer batches than len(loader); under DDP the "
            f"ranks then disagree (on_error='raise' or a callable keeps every batch)",
            stacklevel=5,
        )
        return None
    return dataclasses.replace(
        batch, images=batch.images[keep_on], labels=batch.labels[keep_on], ids=ids, targets=targets
    )


def _rows_to_keep(on_error: ErrorHandler, batch: Delivered) -> torch.Tensor | None:
    """Applies on_error; returns the rows to keep (None: keep the batch as is)."""
    failures = batch.failures
    if callable(on_error):
        on_error(list(failures))
        return None
    text = "; ".join(f"id {f.sample_id} {f.key!r} on {f.server}: {f.reason}" for f in failures[:10])
    more = f" (and {len(failures) - 10} more)" if len(failures) > 10 else ""
    if on_error is OnError.RAISE:
        raise LoaderError(
            f"{len(failures)} sample(s) of batch {batch.seq} could not be served: {text}{more}. "
            f"Pass on_error='skip' or 'warn' to train without them."
        )
    if on_error is OnError.WARN:
        warnings.warn(f"skipping {len(failures)} sample(s) that could not be served: {text}{more}", stacklevel=5)
    bad = {f.sample_id for f in failures}
    return torch.tensor([i not in bad for i in batch.ids.tolist()], dtype=torch.bool)
