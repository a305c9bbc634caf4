"""Delivery on the CPU: fresh buffers per batch, and the normalization the CUDA path also uses."""

from __future__ import annotations

import numpy as np
import torch

from remoteloader.client.device import HostDelivery, host_buffer, normalize_images

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def reference(images: torch.Tensor) -> torch.Tensor:
    x = images.permute(0, 3, 1, 2).double() / 255
    return (x - torch.tensor(MEAN, dtype=torch.float64).view(1, 3, 1, 1)) / torch.tensor(STD, dtype=torch.float64).view(1, 3, 1, 1)


def test_normalize_matches_the_formula_in_nchw_channels_last():
    images = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (4, 9, 7, 3), dtype=np.uint8))
    out = normalize_images(images, (MEAN, STD), torch.float32)
    assert out.shape == (4, 3, 9, 7) and out.dtype == torch.float32
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out.double(), reference(images), atol=1e-5, rtol=0)
    half = normalize_images(images, (MEAN, STD), torch.bfloat16)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), reference(images), atol=0.02, rtol=0.01)


def test_without_normalize_the_uint8_batch_is_handed_over_as_is():
    images = torch.zeros((2, 3, 3, 3), dtype=torch.uint8)
    assert normalize_images(images, None, torch.float32) is images


def test_host_buffers_are_fresh_writable_and_sized():
    small, big = host_buffer(2, 8, 8), host_buffer(64, 224, 224)  # big takes the huge-page mapping
    for buf, n in ((small, 2), (big, 64)):
        assert buf.dtype == torch.uint8 and tuple(buf.shape[1:]) == (buf.shape[1], buf.shape[2], 3)
        assert buf.shape[0] == n
        buf.fill_(7)
        assert int(buf.sum()) == 7 * buf.numel()
    other = host_buffer(64, 224, 224)
    assert other.data_ptr() != big.data_ptr()  # a batch the user keeps is never overwritten
    delivery = HostDelivery(None, torch.float32)
    assert delivery.allocate(1, 4, 4).shape == (1, 4, 4, 3)
