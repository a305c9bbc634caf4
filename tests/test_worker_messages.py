"""The messages between the server's main process and its decode workers (server/worker_messages.py):
each survives the pipe's pickling as itself, and a real worker process (worker_process.main)
renders what a RenderTask names, answers with a TaskDone, forgets pipelines and stops when told."""

from __future__ import annotations

import multiprocessing as mp
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

from remoteloader.protos import limits
from remoteloader.server import worker_process
from remoteloader.server.pipelines import Pipeline, PipelineSpec
from remoteloader.server.shared_memory import PLAIN_READ, Arena
from remoteloader.server.worker_messages import (
    DefinePipeline,
    ForgetPipelines,
    RenderTask,
    Stop,
    TaskDone,
    TaskSample,
    WorkerSettings,
)
from remoteloader.tools.textures import encode_jpeg, make_image

pytestmark = pytest.mark.timeout(120)

TRAIN = PipelineSpec("train", 24, 32)
EVAL = PipelineSpec("eval", 16, 16)


def sample(path: str, length: int, failure: str = "") -> TaskSample:
    return TaskSample(path=path, offset=0, length=length, cache_mode=PLAIN_READ, cache_offset=0, verified=False,
                      targets=b"", source=-1, failure=failure)


MESSAGES = [
    WorkerSettings(slots=2, slot_bytes=4096, allow_custom=False, max_pixels=10**8, cache_bytes=0, region_decode=True,
                   indexed_ns=1, sources=(("module:factory", "{}"),)),
    DefinePipeline(3, PipelineSpec("train", 64, 48, "", ("bboxes", "bbox_labels"), "zstd")),
    RenderTask(task_id=7, slot=1, first=8, spec_id=3, samples=[sample("/data/a.jpg", 1000), sample("/d/b", 5, "gone")],
               seeds=[2**64 - 1, 0], chunk=16),
    ForgetPipelines(),
    Stop(),
    TaskDone(7, [(1, "gone")], [b"\x0a\x00", b""]),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_comes_out_of_the_pipe_as_it_went_in(message):
    back = pickle.loads(bytes(ForkingPickler.dumps(message)))
    assert type(back) is type(message) and back == message
    if isinstance(message, RenderTask):
        assert all(type(s) is TaskSample for s in back.samples)


def test_the_empty_messages_are_told_apart_by_type_not_by_equality():
    """Empty NamedTuples equal each other (and ()): the worker must dispatch on the type."""
    assert ForgetPipelines() == Stop() and type(ForgetPipelines()) is not type(Stop())


def test_a_worker_process_renders_the_samples_a_task_names_and_forgets_pipelines_when_told(tmp_path):
    rng = np.random.default_rng(0)
    data = encode_jpeg(make_image(1, 4, rng, 60, 80), 90)
    path = tmp_path / "image.jpg"
    path.write_bytes(data)
    samples = [sample(str(path), len(data)), sample(str(path), len(data)), sample(str(path), len(data), "fetch: 404")]
    seeds = [11, 12, 13]
    per_sample = limits.sample_bytes(TRAIN.height, TRAIN.width)
    arena = Arena(2, 4 * per_sample)
    ctx = mp.get_context("forkserver")
    task_read, task_write = ctx.Pipe(duplex=False)
    result_read, result_write = ctx.Pipe(duplex=False)
    settings = WorkerSettings(slots=2, slot_bytes=arena.slot_bytes, allow_custom=False, max_pixels=10**8,
                              cache_bytes=0, region_decode=True, indexed_ns=0, sources=())
    worker = ctx.Process(target=worker_process.main, args=(task_read, result_write, arena.for_child(), None, settings),
                         daemon=True)
    worker.start()
    task_read.close()
    result_write.close()

    def answer() -> TaskDone:
        assert result_read.poll(60), "the worker did not answer"
        return result_read.recv()

    try:
        task_write.send(DefinePipeline(0, TRAIN))
        # From the slot's second sample on, as the second task of a chunk of 4 would be.
        task_write.send(RenderTask(task_id=5, slot=1, first=1, spec_id=0, samples=samples, seeds=seeds, chunk=4))
        done = answer()
        assert type(done) is TaskDone and done.task_id == 5
        assert done.errors == [(2, "fetch: 404")] and done.targets == []
        pixels = np.frombuffer(arena.view(1, 4 * per_sample), np.uint8).reshape(4, TRAIN.height, TRAIN.width, 3)
        expected = Pipeline(TRAIN)
        for i in (0, 1):  # each with its own seed
            assert np.array_equal(pixels[1 + i], expected(data, seeds[i])), i
        assert not np.array_equal(pixels[1], pixels[2])
        assert not pixels[3].any()  # the sample whose bytes could not be fetched: zeros

        task_write.send(ForgetPipelines())  # id 0 is free again: now another pipeline
        task_write.send(DefinePipeline(0, EVAL))
        task_write.send(RenderTask(task_id=6, slot=0, first=0, spec_id=0, samples=samples[:1], seeds=[0], chunk=1))
        done = answer()
        assert done == TaskDone(6, [], [])
        size = limits.sample_bytes(EVAL.height, EVAL.width)
        rendered = np.frombuffer(arena.view(0, size), np.uint8).reshape(EVAL.height, EVAL.width, 3)
        assert np.array_equal(rendered, Pipeline(EVAL)(data, 0))

        task_write.send(Stop())
        worker.join(30)
        assert worker.exitcode == 0
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join(5)
        task_write.close()
        result_read.close()
        arena.close()
