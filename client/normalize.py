"""uint8 NHWC batches to normalized floating NCHW (channels_last): (x / 255 - mean) / std.

One affine formula, ``x * scale + shift`` per channel, for both paths: ``normalize_images``
runs it with torch (on the GPU), ``normalize_host`` with numpy in cache-sized pieces (on
the CPU, in the consumer's thread).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

# (mean, std) per channel on the 0..1 scale, as RemoteLoader validated them.
Normalize = tuple[Sequence[float], Sequence[float]]


def normalize_images(images: torch.Tensor, normalize: Normalize | None, dtype: torch.dtype) -> torch.Tensor:
    """uint8 NHWC -> dtype NCHW (channels_last memory), (x / 255 - mean) / std."""
    if normalize is None:
        return images
    scale, shift = _affine(tuple(normalize[0]), tuple(normalize[1]), images.device)
    # permute is a view: NHWC memory read as NCHW has channels_last strides already.
    x = images.permute(0, 3, 1, 2).to(torch.float32)
    x = torch.addcmul(shift.view(1, 3, 1, 1), x, scale.view(1, 3, 1, 1))
    return x.to(dtype).contiguous(memory_format=torch.channels_last)


# Elements per piece: 96 KiB of float32 output, inside L2 with its input, and under torch's
# parallel grain (32768 elements), so the per-piece cast to bfloat16/float16 stays in this
# thread: above it, each cast woke torch's OpenMP threads (measured 7-20x slower).
HOST_CHUNK = 3 * 8192


def normalize_host(images: np.ndarray, out: torch.Tensor, normalize: Normalize) -> torch.Tensor:
    """uint8 NHWC ``images`` -> ``out`` (same shape, floating dtype), (x / 255 - mean) / std.

    The CPU twin of ``normalize_images``: one thread, in pieces that stay in cache, with the
    per-channel factors laid out as long as a piece, so numpy's loops run over contiguous
    memory rather than broadcasting a 3-vector. Measured on a 256x224x224 batch: 0.1 CPU ms
    per image, against 0.73-0.87 for the torch expression (a fresh 154 MB tensor per step,
    and OpenMP threads that spin). Returns ``out`` viewed as NCHW (channels_last strides).
    """
    if not (images.flags.c_contiguous and out.is_contiguous() and out.shape == images.shape):
        raise ValueError(
            f"normalize_host: expected contiguous {images.shape} input and output, got "
            f"{out.shape} {'' if out.is_contiguous() else 'non-'}contiguous output"
        )
    dtype = np.float64 if out.dtype == torch.float64 else np.float32
    scale, shift = _host_affine(tuple(normalize[0]), tuple(normalize[1]), dtype)
    src = images.reshape(-1)
    direct = out.dtype in (torch.float32, torch.float64)
    # bfloat16/float16 (no numpy dtype): computed in float32, then cast piece by piece (small: one thread)
    dst = out.numpy().reshape(-1) if direct else None
    scratch = np.empty(0 if direct else HOST_CHUNK, np.float32)
    for start in range(0, src.size, HOST_CHUNK):
        piece = src[start : start + HOST_CHUNK]
        n = piece.size
        target = dst[start : start + n] if dst is not None else scratch[:n]
        np.multiply(piece, scale[:n], out=target, dtype=target.dtype)
        np.add(target, shift[:n], out=target)
        if dst is None:
            out.view(-1)[start : start + n].copy_(torch.from_numpy(target))
    return out.permute(0, 3, 1, 2)


@functools.lru_cache(maxsize=16)
def _host_affine(
    mean: tuple[float, ...], std: tuple[float, ...], dtype: type[np.floating]
) -> tuple[np.ndarray, np.ndarray]:
    scale, shift = _affine_terms(mean, std)
    return np.tile(np.array(scale, dtype), HOST_CHUNK // 3), np.tile(np.array(shift, dtype), HOST_CHUNK // 3)


@functools.lru_cache(maxsize=16)
def _affine(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / 255 - mean) / std as x * scale + shift, built once per device (no copy per batch)."""
    scale, shift = _affine_terms(mean, std)
    return (
        torch.tensor(scale, dtype=torch.float32, device=device),
        torch.tensor(shift, dtype=torch.float32, device=device),
    )


def _affine_terms(mean: tuple[float, ...], std: tuple[float, ...]) -> tuple[list[float], list[float]]:
    """The per-channel scale and shift of (x / 255 - mean) / std = x * scale + shift."""
    return [1.0 / (255.0 * s) for s in std], [-m / s for m, s in zip(mean, std)]
