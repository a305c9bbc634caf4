"""RemoteLoader inside the frameworks people train with, each run for real in its own processes
(the scripts in tests/frameworks/): Lightning (loaders passed to fit and made in hooks, DDP on
two CPU processes, mid-epoch and end-of-epoch checkpoints), Accelerate (prepare, save_state and
load_state, one process and two under `accelerate launch`) and torchrun (loaders made before
and after init_process_group).

One module-wide Cluster: two servers of 24 images each (48 samples: 12 batches of 4, or 6 per
rank with two ranks).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from remoteloader.tools.textures import make_imagefolder

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

JOBS = pathlib.Path(__file__).parent / "frameworks"
TOTAL, BATCH = 48, 4
EPOCH = TOTAL // BATCH  # batches per epoch with one rank


@pytest.fixture(scope="module")
def servers(module_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("frameworks-data")
    started = module_cluster.add_many([make_imagefolder(root / "a", ["ant", "bee"], 12, size=(24, 24), seed=1),
                                       make_imagefolder(root / "b", ["cat", "dog"], 12, size=(24, 24), seed=2)])
    return ",".join(module_cluster.address(i) for i in started)


def run(command: list[str], what: str, seconds: float = 240) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds)
    assert done.returncode == 0, f"{what} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def read(path: pathlib.Path) -> dict:
    return json.loads(path.read_text())


def by_epoch(steps: list) -> dict[int, list[int]]:
    """{epoch: the ids of its batches in the order played}."""
    out: dict[int, list[int]] = {}
    for step in steps:
        out.setdefault(step[0], []).extend(step[1])
    return out


def assert_ranks_split_every_epoch(ranks: list[dict[int, list[int]]], epochs: int, what: str) -> None:
    """Every epoch: the ranks' samples are disjoint, cover every sample once, in equal numbers, and
    each epoch has another order than the one before."""
    for epoch in range(epochs):
        parts = [rank[epoch] for rank in ranks]
        assert len({len(p) for p in parts}) == 1, f"{what} epoch {epoch}: ranks played {[len(p) for p in parts]}"
        assert sorted(i for p in parts for i in p) == list(range(TOTAL)), f"{what} epoch {epoch}: not each once"
        if epoch:
            assert parts != [rank[epoch - 1] for rank in ranks], f"{what}: epoch {epoch} repeats epoch {epoch - 1}"


# ---- Lightning ------------------------------------------------------------------------------
CHECKPOINTS = (4, 12, 16)  # steps 4 and 16: mid-epoch (0 and 1); step 12: the end of epoch 0, after its last batch


@pytest.fixture(scope="module")
def lightning(servers, tmp_path_factory):
    """Runs the one-process Lightning job once: 3 epochs with a checkpoint every 4 steps, then
    resumed from three of them by fresh Trainers and loaders; returns its folder and a function
    running more."""
    out = tmp_path_factory.mktemp("lightning")

    def job(*runs: dict) -> None:
        config = {"servers": servers, "out": str(out), "runs": list(runs)}
        run([sys.executable, str(JOBS / "lightning_job.py"), json.dumps(config)], "the Lightning job")

    job({"name": "full", "devices": 1, "epochs": 3, "loaders": "fit", "ckpt_every": 4},
        *[{"name": f"resumed{step}", "devices": 1, "epochs": 3, "loaders": "hooks" if step == 16 else "fit",
           "resume": str(out / "full-ckpt" / f"step={step}.ckpt")} for step in CHECKPOINTS])
    return out, job


def test_lightning_fit_plays_every_sample_once_per_epoch_in_a_new_order_and_validates(lightning):
    out, _job = lightning
    record = read(out / "full-rank0.json")
    assert_ranks_split_every_epoch([by_epoch(record["train"])], 3, "Lightning fit")
    validation = [v for v in record["val"] if not v[1]]
    assert [v[2] for v in record["val"] if v[1]] and len(validation) == 3 * EPOCH, "validation did not run"
    for epoch in range(3):
        ids = [i for e, _sanity, batch in validation if e == epoch for i in batch]
        assert ids == list(range(TOTAL)), f"validation of epoch {epoch} is not every sample in order"


def test_lightning_checkpoints_mid_epoch_and_at_an_epoch_end_resume_exactly(lightning):
    out, _job = lightning
    full = read(out / "full-rank0.json")["train"]
    for step in CHECKPOINTS:
        resumed = read(out / f"resumed{step}-rank0.json")["train"]
        assert [s[:2] for s in resumed] == [s[:2] for s in full[step:]], f"resumed at step {step}: other batches"
        assert resumed == full[step:], f"resumed at step {step}: other pixels"


def test_lightning_ddp_ranks_are_disjoint_and_complete_with_loaders_passed_to_fit_or_made_in_hooks(lightning):
    out, job = lightning
    job({"name": "ddp-fit", "devices": 2, "epochs": 2, "loaders": "fit"},
        {"name": "ddp-hooks", "devices": 2, "epochs": 2, "loaders": "hooks"})
    for name in ("ddp-fit", "ddp-hooks"):
        records = [read(out / f"{name}-rank{r}.json") for r in range(2)]
        assert_ranks_split_every_epoch([by_epoch(r["train"]) for r in records], 2, name)
        validated = sorted(i for r in records for e, sanity, ids in r["val"] if e == 0 and not sanity for i in ids)
        assert validated == list(range(TOTAL)), f"{name}: validation is not split over the ranks"


# ---- Accelerate -----------------------------------------------------------------------------
@pytest.mark.parametrize("processes", [1, 2])
def test_accelerate_prepare_and_a_mid_epoch_save_state_resume_every_rank_exactly(servers, tmp_path, processes):
    if processes == 1:
        launch = [sys.executable]
    else:  # on CPU, --multi_gpu with Accelerator(cpu=True) starts two gloo processes
        # (port 0: Accelerate picks the port as it launches, not seconds before as a test would)
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                  "--main_process_ip", "127.0.0.1", "--main_process_port", "0"]
    save_at = 2
    for phase in ("train", "resume"):
        config = {"servers": servers, "out": str(tmp_path), "phase": phase, "save_at": save_at}
        run([*launch, str(JOBS / "accelerate_job.py"), json.dumps(config)], f"the Accelerate job ({phase})")
    trained = [read(tmp_path / f"train-rank{r}.json") for r in range(processes)]
    assert all(t["prepared"] for t in trained), "prepare() replaced the RemoteLoader"
    assert "no dataset" in trained[0]["skip"] and "load_state" in trained[0]["skip"], trained[0]["skip"]
    assert_ranks_split_every_epoch([by_epoch(t["steps"]) for t in trained], 2, f"Accelerate x{processes}")
    per_rank = EPOCH // processes
    for r in range(processes):  # rank 1 loads rank 0's state: the one file save_state writes
        resumed = read(tmp_path / f"resume-rank{r}.json")["steps"]
        assert resumed == trained[r]["steps"][per_rank + save_at:], f"rank {r} did not resume exactly"


# ---- torchrun -------------------------------------------------------------------------------
def test_torchrun_ranks_are_disjoint_with_the_loader_made_before_or_after_init_process_group(servers, tmp_path):
    config = {"servers": servers, "out": str(tmp_path)}
    # --standalone: its rendezvous store binds a free port itself, and the ranks meet on it.
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(JOBS / "torchrun_job.py"), json.dumps(config)], "torchrun")
    records = [read(tmp_path / f"rank{r}.json") for r in range(2)]
    for made in ("before", "after"):
        assert [r[made]["len"] for r in records] == [EPOCH // 2] * 2, f"made {made}: len() is not per rank"
        assert_ranks_split_every_epoch([by_epoch(r[made]["batches"]) for r in records], 2, f"made {made} init")
