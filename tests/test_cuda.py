"""The CUDA feeding path: values, stream/event discipline, and bounded pinned memory.

Skipped where torch sees no GPU (CI never has one).
"""

from __future__ import annotations

import pytest
import torch

from remoteloader.client import RemoteLoader
from remoteloader.tools.textures import make_imagefolder

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU: torch.cuda.is_available() is False"),
]

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.fixture(scope="module")
def server(tmp_path_factory, module_cluster):
    root = make_imagefolder(tmp_path_factory.mktemp("cuda") / "data", ["a", "b", "c"], 30, size=(60, 80), seed=3)
    index = module_cluster.add(root)
    return module_cluster.address(index)


def epoch(address, **kwargs):
    options = dict(batch_size=16, image_size=48, pipeline="eval", shuffle=True, seed=1, drop_last=False,
                   return_ids=True, normalize=(MEAN, STD))
    options.update(kwargs)
    with RemoteLoader(address, **options) as loader:
        return [(x.cpu() if x.is_cuda else x, y.cpu(), i) for x, y, i in loader]


def test_cuda_values_equal_the_cpu_path(server):
    cpu = epoch(server, device="cpu")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.02)):
        gpu = epoch(server, device="cuda", dtype=dtype)
        assert len(gpu) == len(cpu)
        for (xg, yg, ig), (xc, yc, ic) in zip(gpu, cpu):
            assert torch.equal(ig, ic) and torch.equal(yg, yc)
            assert xg.dtype == dtype and xg.shape == xc.shape
            torch.testing.assert_close(xg.float(), xc.float(), atol=tol, rtol=tol)


def test_batches_are_on_the_gpu_channels_last(server):
    with RemoteLoader(server, batch_size=16, image_size=48, normalize=(MEAN, STD), device="cuda",
                      dtype=torch.bfloat16) as loader:
        images, labels = next(iter(loader))
        assert images.is_cuda and labels.is_cuda
        assert images.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("receiver", ["thread", "process"])
def test_reusing_pinned_buffers_right_after_release_never_tears_a_batch(server, receiver):
    """Scribble over each pinned buffer (pool buffer or receiver slot) the moment the delivery
    releases it, while the consumer stream is kept busy: with the event discipline the batch
    still equals the CPU path's; a buffer released before its copy finished would show 255s."""
    reference = epoch(server, device="cpu", pipeline="eval", normalize=None)
    with RemoteLoader(server, batch_size=16, image_size=48, pipeline="eval", shuffle=True, seed=1, drop_last=False,
                      return_ids=True, device="cuda", prefetch=2, receiver=receiver) as loader:
        delivery = loader._delivery
        release = delivery.release

        def scribble_then_release(view):
            view.fill_(255)
            release(view)

        delivery.release = scribble_then_release
        sums = []
        for images, _labels, ids in loader:
            busy = torch.randn(2048, 2048, device="cuda")
            for _ in range(8):  # hold the consumer stream while the next copies run
                busy = busy @ busy / 2048
            sums.append((images.double().sum().item(), ids))
        torch.cuda.synchronize()
    assert len(sums) == len(reference)
    for (total, ids), (x, _, ref_ids) in zip(sums, reference):
        assert torch.equal(ids, ref_ids)
        assert total == x.double().sum().item()


@pytest.mark.parametrize("receiver", ["thread", "process"])
def test_no_pinned_or_device_memory_growth_over_epochs(server, receiver):
    with RemoteLoader(server, batch_size=16, image_size=48, normalize=(MEAN, STD), device="cuda",
                      receiver=receiver, prefetch=2) as loader:
        pool = loader._delivery.pool  # thread: the pinned pool; process: the receiver's slots
        readings = []
        for _ in range(6):
            count = sum(len(labels) for _images, labels in loader)
            assert count == loader.num_samples // 16 * 16, "a full epoch after an abandoned one"
            torch.cuda.synchronize()
            readings.append((len(pool._free) if pool is not None else 0, torch.cuda.memory_allocated()))
            it = iter(loader)  # abandon an epoch half-way: its buffers must come back too
            next(it)
            del it
        if pool is not None:
            assert all(free == pool.count for free, _ in readings), readings
        assert readings[-1][1] <= readings[1][1], readings


def test_cuda_device_must_exist():
    with pytest.raises(ValueError, match="cuda"):
        RemoteLoader("127.0.0.1:1", device=f"cuda:{torch.cuda.device_count()}")
