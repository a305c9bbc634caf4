"""The deliveries' CPU side: host_delivery (batch buffers the user owns until dropped) and
normalize (normalize_host, and normalize_images, which cuda_delivery runs on the GPU; the
CUDA path itself is in test_cuda.py)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from remoteloader.client.batches import Batch
from remoteloader.client.host_delivery import HostDelivery, HostPool
from remoteloader.client.normalize import HOST_CHUNK, normalize_host, normalize_images

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def reference(images: torch.Tensor) -> torch.Tensor:
    x = images.permute(0, 3, 1, 2).double() / 255
    mean, std = (torch.tensor(v, dtype=torch.float64).view(1, 3, 1, 1) for v in (MEAN, STD))
    return (x - mean) / std


def test_normalize_matches_the_formula_in_nchw_channels_last():
    images = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (4, 9, 7, 3), dtype=np.uint8))
    out = normalize_images(images, (MEAN, STD), torch.float32)
    assert out.shape == (4, 3, 9, 7) and out.dtype == torch.float32
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out.double(), reference(images), atol=1e-5, rtol=0)
    half = normalize_images(images, (MEAN, STD), torch.bfloat16)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), reference(images), atol=0.02, rtol=0.01)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.float64, 1e-12), (torch.bfloat16, 0.02),
                                         (torch.float16, 0.005)])
def test_host_normalize_matches_the_formula_across_pieces(dtype, atol):
    # 3 x 131 x 67 x 3 elements: more than one piece, and a last piece of odd length.
    images = np.random.default_rng(1).integers(0, 256, (3, 131, 67, 3), dtype=np.uint8)
    assert images.size > HOST_CHUNK and images.size % HOST_CHUNK % 3 == 0 and images.size % HOST_CHUNK
    out = torch.full((3, 131, 67, 3), float("nan"), dtype=dtype)
    result = normalize_host(images, out, (MEAN, STD))
    assert result.shape == (3, 3, 131, 67) and result.dtype == dtype and result.data_ptr() == out.data_ptr()
    assert result.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(result.double(), reference(torch.from_numpy(images)), atol=atol,
                               rtol=0 if dtype == torch.float64 else 0.01)  # float64: computed in float64
    # Within float32 rounding of the CUDA path's expression (which fuses multiply and add).
    torch.testing.assert_close(result, normalize_images(torch.from_numpy(images), (MEAN, STD), dtype))


def _received(delivery, seq, rng, n=16):
    images = delivery.allocate(n, 224, 224)
    images.copy_(torch.from_numpy(rng.integers(0, 256, (n, 224, 224, 3), dtype=np.uint8)))
    return Batch(seq, np.arange(n), images, images.numpy(), np.zeros(n, np.int64), 0, [], images.numel()), \
        images.clone()


def test_normalized_batches_go_to_recycled_memory_and_fill_all_of_it():
    delivery = HostDelivery((MEAN, STD), torch.float32, buffers=4)
    rng = np.random.default_rng(2)

    def batch(seq):
        return _received(delivery, seq, rng)

    first, _ = batch(0)
    out = delivery.finish(first).images
    address = out.data_ptr()
    out.fill_(float("nan"))  # what the user left in it must not survive
    del out, first
    second, raw = batch(1)
    reused = delivery.out_pool.reused
    again = delivery.finish(second).images
    assert delivery.out_pool.reused > reused and again.data_ptr() == address
    torch.testing.assert_close(again.double(), reference(raw), atol=1e-5, rtol=0)


def test_spare_normalized_batches_are_bounded_apart_from_the_receive_buffers():
    delivery = HostDelivery((MEAN, STD), torch.float32, buffers=10)
    rng = np.random.default_rng(3)
    held = [delivery.finish(_received(delivery, seq, rng, n=32)[0]).images for seq in range(6)]
    # One uint8 buffer, free again once normalized, received into six times.
    assert delivery.pool.free_batches() == 1 and delivery.pool.reused == 5
    del held  # six float32 batches, each 4x a uint8 one: two are kept for reuse
    assert delivery.out_pool.free_batches() == 2 and delivery.pool.free_batches() == 1


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="torch has one thread here")
def test_host_normalize_to_bfloat16_stays_in_the_calling_thread():
    # torch runs a copy_ of more than 32768 elements on its OpenMP threads, which spin:
    # each piece's cast must stay under that.
    tick = os.sysconf("SC_CLK_TCK")

    def cpu_by_thread():
        seen = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            seen[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
        return seen

    images = np.random.default_rng(4).integers(0, 256, (64, 224, 224, 3), dtype=np.uint8)
    out = torch.empty(images.shape, dtype=torch.bfloat16)
    normalize_host(images, out, (MEAN, STD))
    me = threading.get_native_id()
    before = cpu_by_thread()
    for _ in range(10):
        normalize_host(images, out, (MEAN, STD))
    after = cpu_by_thread()
    others = sum(v - before.get(k, 0.0) for k, v in after.items() if k != me)
    assert after[me] - before.get(me, 0.0) > 0.05  # the work was done (and measured) here
    assert others < 0.05, f"{others:.2f} CPU-s on other threads while normalizing to bfloat16"


def test_dropping_a_batch_runs_no_python_code():
    # Code run at the drop runs inside whatever the user's thread was doing: a Ctrl-C
    # delivered then is swallowed by Python, and a collection under the pool's lock
    # deadlocked. The pool takes dropped batches back when next asked for memory.
    import sys

    pool = HostPool(keep=2)
    batch = pool.take(64, 224, 224)
    view = batch.permute(0, 3, 1, 2)
    calls = []
    sys.setprofile(lambda frame, event, arg: calls.append((event, frame.f_code.co_name)))
    try:
        del batch, view
    finally:
        sys.setprofile(None)
    assert [c for c in calls if c[0] == "call"] == [], calls
    assert pool.free_batches() == 1


def test_a_batch_given_back_while_the_pool_is_locked_does_not_deadlock():
    # Dropped while this very thread holds the pool's lock (as in a garbage collection
    # started by an allocation under it).
    pool = HostPool(keep=2)
    batch = pool.take(64, 224, 224)
    address = batch.data_ptr()
    gave_back = threading.Event()

    def locked_then_collected():
        nonlocal batch
        with pool._lock:
            del batch  # runs the finalizer here, as a collection under the lock would
            gave_back.set()

    thread = threading.Thread(target=locked_then_collected, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert gave_back.is_set() and not thread.is_alive(), "giving a batch back blocked on the pool's lock"
    assert pool.take(64, 224, 224).data_ptr() == address and pool.reused == 1


def test_normalize_host_refuses_a_non_contiguous_output():
    images = np.zeros((2, 8, 8, 3), np.uint8)
    with pytest.raises(ValueError, match="contiguous"):
        normalize_host(images, torch.empty((2, 3, 8, 8), dtype=torch.float32).permute(0, 2, 3, 1), (MEAN, STD))


def test_without_normalize_the_uint8_batch_is_handed_over_as_is():
    images = torch.zeros((2, 3, 3, 3), dtype=torch.uint8)
    assert normalize_images(images, None, torch.float32) is images


def test_host_buffers_are_writable_and_sized():
    pool = HostPool(keep=2)
    small, big = pool.take(2, 8, 8), pool.take(64, 224, 224)  # big takes a mapping of its own
    for buf, n in ((small, 2), (big, 64)):
        assert buf.dtype == torch.uint8 and buf.shape == (n, buf.shape[1], buf.shape[2], 3)
        buf.fill_(7)
        assert int(buf.sum()) == 7 * buf.numel()
    assert HostDelivery(None, torch.float32, buffers=4).allocate(1, 4, 4).shape == (1, 4, 4, 3)


def test_a_batch_the_user_holds_is_never_reused():
    pool = HostPool(keep=4)
    kept = pool.take(64, 224, 224)
    view = kept[3:5].permute(0, 3, 1, 2)  # views and numpy arrays hold the memory too
    array = kept.numpy()
    kept.fill_(1)
    del kept
    others = [pool.take(64, 224, 224) for _ in range(3)]
    for other in others:
        other.fill_(2)
    assert pool.reused == 0
    assert int(view.sum()) == view.numel() and int(array.sum()) == array.size
    assert view.data_ptr() not in {o.data_ptr() + 3 * 224 * 224 * 3 for o in others}


def test_a_dropped_batch_is_received_into_again_and_the_free_list_is_bounded():
    pool = HostPool(keep=2)
    first = pool.take(64, 224, 224)
    address = first.data_ptr()
    del first
    again = pool.take(64, 224, 224)
    assert pool.reused == 1 and again.data_ptr() == address
    batches = [pool.take(64, 224, 224) for _ in range(5)] + [again]
    del again, batches
    assert pool.free_batches() == 2
    assert pool.take(32, 224, 224).shape[0] == 32  # another size gets its own mapping


def _resident_kib(address: int, nbytes: int) -> int:
    """KiB of [address, address + nbytes) resident in memory (/proc/self/smaps)."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            if "-" in line.split()[0] and ":" not in line.split()[0]:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                inside = start <= address < end
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1])
    return 0


def test_a_host_delivery_reserves_its_first_epochs_buffers_faulted_in_and_bounded():
    delivery = HostDelivery(None, torch.float32, buffers=3, batch=(64, 224, 224))
    assert delivery.pool.free_batches() == 3
    batches = [delivery.allocate(64, 224, 224) for _ in range(4)]
    assert delivery.pool.reused == 3  # the reserved mappings, before any fresh one
    first = batches[0]
    # Already resident when handed out: the kernel faulted the pages in when it was reserved.
    assert _resident_kib(first.data_ptr(), first.numel()) * 1024 >= first.numel()
    assert HostDelivery(None, torch.float32, buffers=3).pool.free_batches() == 0  # (no shape: nothing)
    small = HostDelivery(None, torch.float32, buffers=3, batch=(2, 32, 32))
    assert small.pool.free_batches() == 0  # under 4 MiB: torch's allocator serves them
