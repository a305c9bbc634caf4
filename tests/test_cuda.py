"""The CUDA feeding path: values, stream/event discipline, and bounded pinned memory.

Skipped where torch sees no GPU (CI never has one).
"""

from __future__ import annotations

import pytest
import torch

from remoteloader.client import RemoteLoader
from remoteloader.server.synthetic import make_imagefolder

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


def test_reusing_pinned_buffers_right_after_handout_never_tears_a_batch(server):
    """Scribble over every free pinned buffer as soon as a batch is handed out, and keep the
    consumer stream busy reading the batch: with the event discipline the batch still equals
    the CPU path's; a buffer returned before its copy finished would show 255s."""
    reference = epoch(server, device="cpu", pipeline="eval", normalize=None)
    with RemoteLoader(server, batch_size=16, image_size=48, pipeline="eval", shuffle=True, seed=1, drop_last=False,
                      return_ids=True, device="cuda", prefetch=2) as loader:
        pool = loader._delivery.pool
        sums = []
        for images, labels, ids in loader:
            with pool._lock:
                for buffer in pool._free:
                    buffer.fill_(255)
            busy = torch.randn(2048, 2048, device="cuda")
            for _ in range(8):  # hold the consumer stream while the next copies run
                busy = busy @ busy / 2048
            sums.append((images.double().sum().item(), ids))
        torch.cuda.synchronize()
    for (total, ids), (x, _, ref_ids) in zip(sums, reference):
        assert torch.equal(ids, ref_ids)
        assert total == x.double().sum().item()


def test_no_pinned_or_device_memory_growth_over_epochs(server):
    with RemoteLoader(server, batch_size=16, image_size=48, normalize=(MEAN, STD), device="cuda") as loader:
        pool = loader._delivery.pool
        readings = []
        for epoch_index in range(6):
            for images, labels in loader:
                pass
            del images, labels
            torch.cuda.synchronize()
            readings.append((len(pool._free), torch.cuda.memory_allocated()))
            it = iter(loader)  # abandon an epoch half-way: its buffers must come back too
            next(it)
            del it
        assert all(free == pool.count for free, _ in readings), readings
        assert readings[-1][1] <= readings[1][1], readings


def test_cuda_device_must_exist():
    with pytest.raises(ValueError, match="cuda"):
        RemoteLoader("127.0.0.1:1", device=f"cuda:{torch.cuda.device_count()}")
