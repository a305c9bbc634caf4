"""A detection batch in the form torchvision's detection models and references take.

``RemoteLoader(batch_format="torchvision")`` yields ``(images, targets)``:

* ``images``: a list of ``[3, H, W]`` float tensors on the 0..1 scale, as torchvision's
  models normalize themselves (with the loader's ``normalize``: normalized, its ``dtype``);
* ``targets``: a list of dicts, one per image, with torchvision's keys: ``boxes`` float32
  ``[N, 4]`` (x1, y1, x2, y2 in pixels), ``labels`` int64 ``[N]``, ``image_id`` int64 (the
  source's, e.g. COCO's ``images[].id``, else the global sample id), ``area`` float32 ``[N]``
  (each box's, in output pixels), ``iscrowd`` int64 ``[N]`` (zeros: crowd annotations are not
  boxes) and ``masks`` uint8 ``[N, H, W]`` when the loader asks for that field; the other
  fields it asks for keep their names (``orig_size``, ``to_orig``, ``keypoints``, ...).

``boxes_to_orig`` takes predicted boxes back to the source image with a target's
``to_orig``, for COCO evaluation of letterboxed images.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from remoteloader.protos import targets as tg

if TYPE_CHECKING:
    from remoteloader.client.options import LoaderOptions

# Fields that become torchvision's keys (the rest keep their names; the class label and the
# semantic mask are not detection targets).
_RENAMED = {tg.BBOXES: "boxes", tg.BBOX_LABELS: "labels", tg.MASKS: "masks", tg.IMAGE_ID: "image_id"}
_LEFT_OUT = (tg.LABEL, tg.MASK)


def torchvision_form(
    images: torch.Tensor, targets: dict[str, Any], ids: torch.Tensor, options: LoaderOptions
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The batch's images and per-image target dicts (module docstring)."""
    if options.output.normalize is None:  # uint8 NHWC: float NCHW on the 0..1 scale
        images = images.permute(0, 3, 1, 2).to(options.output.dtype).div_(255)
    out: list[dict[str, torch.Tensor]] = []
    device = images.device
    for row in range(len(images)):
        one: dict[str, torch.Tensor] = {}
        for name, column in targets.items():
            if name in _LEFT_OUT or column[row] is None:
                continue
            one[_RENAMED.get(name, name)] = column[row]
        boxes = one.get("boxes")
        if boxes is None:  # (a sample that failed under on_error=callable: kept as zeros)
            boxes = one["boxes"] = torch.zeros((0, 4), dtype=torch.float32, device=device)
            one["labels"] = torch.zeros(0, dtype=torch.int64, device=device)
        image_id = one.get("image_id")
        one["image_id"] = (
            image_id.reshape(()).to(torch.int64) if image_id is not None else ids[row].to(device, torch.int64)
        )
        one["area"] = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
        one["iscrowd"] = torch.zeros(len(boxes), dtype=torch.int64, device=device)
        out.append(one)
    return list(images.unbind(0)), out


def boxes_to_orig(boxes: torch.Tensor, to_orig: torch.Tensor) -> torch.Tensor:
    """Boxes (x1, y1, x2, y2) in output pixels as boxes in the source image's pixels, given the
    sample's ``to_orig`` (sx, sy, tx, ty); a mirrored axis gives its corners back in order."""
    sx, sy, tx, ty = to_orig.to(boxes.dtype).unbind(0)
    xs = boxes[:, 0::2] * sx + tx
    ys = boxes[:, 1::2] * sy + ty
    return torch.stack([xs.min(dim=1).values, ys.min(dim=1).values, xs.max(dim=1).values, ys.max(dim=1).values], dim=1)
