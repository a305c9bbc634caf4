"""RemoteLoader inside the frameworks people train with, each run for real in its own processes
(the scripts in tests/frameworks/): Lightning (loaders passed to fit and made in hooks, DDP on
two CPU processes, mid-epoch and end-of-epoch checkpoints of every kind Lightning writes, resumed
with no line from the user), Accelerate (prepare, save_state and load_state, one process and two
under `accelerate launch`), Hugging Face's Trainer (RemoteTrainer: epochs with evaluation, resumed
mid-epoch and at an epoch's end in a fresh process, accumulation, max_steps, torchrun) and
torchrun (loaders made before and after init_process_group).

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
# The checkpoints Lightning users keep most, written once an epoch ends, and the step each resumes at:
# ModelCheckpoint(every_n_epochs=1), which with validation loaders saves when validation ends (the
# full run's), and one saved when the training epoch ends, with last.ckpt (a run of 2 epochs: its
# last.ckpt is the end of epoch 1, resumed for a third). Lightning restores no loader state from them.
EPOCH_END_CHECKPOINTS = {"full-val-end/epoch=0.ckpt": EPOCH, "full-val-end/epoch=1.ckpt": 2 * EPOCH,
                         "short-train-end/epoch=0.ckpt": EPOCH, "short-train-end/last.ckpt": 2 * EPOCH}


@pytest.fixture(scope="module")
def lightning(servers, tmp_path_factory):
    """Runs the one-process Lightning job once: 3 epochs with a checkpoint every 4 steps and one at
    each epoch's end, 2 epochs with a checkpoint (and last.ckpt) when each training epoch ends, then
    resumed from three of the step checkpoints by fresh Trainers and loaders; returns its folder and
    a function running more."""
    out = tmp_path_factory.mktemp("lightning")

    def job(*runs: dict) -> None:
        config = {"servers": servers, "out": str(out), "runs": list(runs)}
        run([sys.executable, str(JOBS / "lightning_job.py"), json.dumps(config)], "the Lightning job")

    job({"name": "full", "devices": 1, "epochs": 3, "loaders": "fit", "ckpt_every": 4, "ckpt_epochs": "val-end"},
        {"name": "short", "devices": 1, "epochs": 2, "loaders": "fit", "ckpt_epochs": "train-end"},
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


def test_lightning_end_of_epoch_checkpoints_resume_exactly_in_a_fresh_process(lightning):
    """No loader state, no set_epoch in the script: Lightning's own set_epoch at each epoch start
    (on ``loader.batch_sampler.sampler``) makes the resumed epochs the uninterrupted run's."""
    out, job = lightning
    job(*[{"name": f"epoch-end{i}", "devices": 1, "epochs": 3, "loaders": "hooks" if i % 2 else "fit",
           "resume": str(out / path)} for i, path in enumerate(EPOCH_END_CHECKPOINTS)])
    full = read(out / "full-rank0.json")["train"]
    assert read(out / "short-rank0.json")["train"] == full[: 2 * EPOCH], "a run of 2 epochs is not the first 2"
    for i, (path, step) in enumerate(EPOCH_END_CHECKPOINTS.items()):
        resumed = read(out / f"epoch-end{i}-rank0.json")["train"]
        assert [s[:2] for s in resumed] == [s[:2] for s in full[step:]], f"resumed from {path}: other batches"
        assert resumed == full[step:], f"resumed from {path}: other pixels"


def test_lightning_reaches_the_loaders_set_epoch_and_finds_no_shuffling_sampler():
    """The two paths of Lightning's that the loader's ``batch_sampler`` is for, run as Lightning runs
    them (tests/test_epoch.py has the rules they reach): set_epoch at each epoch's start, and the
    check that a validation loader does not shuffle, which must not read it as a DataLoader's."""
    from lightning.fabric.utilities.data import _set_sampler_epoch
    from lightning.pytorch.utilities.data import _is_dataloader_shuffled

    from remoteloader.client.epoch import FrameworkEpochs

    class LoaderLike:
        def __init__(self, set_epoch):
            self.batch_sampler = FrameworkEpochs(set_epoch)

    epochs: list[int] = []
    _set_sampler_epoch(LoaderLike(epochs.append), 3)
    assert epochs == [3]
    assert _is_dataloader_shuffled(LoaderLike(epochs.append)) is False


def test_lightning_ddp_ranks_are_disjoint_and_complete_with_loaders_passed_to_fit_or_made_in_hooks(lightning):
    out, job = lightning
    job({"name": "ddp-fit", "devices": 2, "epochs": 2, "loaders": "fit", "ckpt_epochs": "val-end"},
        {"name": "ddp-hooks", "devices": 2, "epochs": 2, "loaders": "hooks"})
    for name in ("ddp-fit", "ddp-hooks"):
        records = [read(out / f"{name}-rank{r}.json") for r in range(2)]
        assert_ranks_split_every_epoch([by_epoch(r["train"]) for r in records], 2, name)
        validated = sorted(i for r in records for e, sanity, ids in r["val"] if e == 0 and not sanity for i in ids)
        assert validated == list(range(TOTAL)), f"{name}: validation is not split over the ranks"
    # resumed in a fresh process from the checkpoint of epoch 0's end: each rank plays its part of epoch 1
    job({"name": "ddp-resumed", "devices": 2, "epochs": 2, "loaders": "hooks",
         "resume": str(out / "ddp-fit-val-end" / "epoch=0.ckpt")})
    for r in range(2):
        full = read(out / f"ddp-fit-rank{r}.json")["train"]
        assert read(out / f"ddp-resumed-rank{r}.json")["train"] == full[EPOCH // 2:], f"DDP rank {r}: not epoch 1"


# ---- Hugging Face Trainer (RemoteTrainer) ----------------------------------------------------
# Runs of tests/frameworks/transformers_job.py: 12 batches an epoch, one process.
TRAINER_RUNS = [
    {"name": "full", "epochs": 3, "eval": True, "save": 4},  # checkpoints every 4 steps: 12 and 24 end epochs
    {"name": "accum", "epochs": 2, "accumulate": 5, "save": "epoch"},  # 5 + 5 + 2 batches: 3 steps an epoch
    {"name": "capped", "max_steps": 5, "accumulate": 5, "save": 2},  # stops 10 batches into epoch 1
]
# Resumed in a fresh process: (run, checkpoint, the batch of the run it resumes at).
TRAINER_RESUMES = {"mid-epoch": ("full", "checkpoint-16", 16), "epoch-end": ("full", "checkpoint-12", 12),
                   "accum-epoch": ("accum", "checkpoint-3", 12), "capped-mid": ("capped", "checkpoint-2", 10)}


@pytest.fixture(scope="module")
def trainer_runs(servers, tmp_path_factory):
    """The Trainer job's runs in one process, then resumed from their checkpoints in another."""
    out = tmp_path_factory.mktemp("transformers")

    def job(*runs: dict) -> None:
        config = {"servers": servers, "out": str(out), "runs": list(runs)}
        run([sys.executable, str(JOBS / "transformers_job.py"), json.dumps(config)], "the Trainer job")

    job(*TRAINER_RUNS)
    options = {r["name"]: r for r in TRAINER_RUNS}
    job(*[{**options[of], "save": None, "name": name, "resume": str(out / of / checkpoint)}
          for name, (of, checkpoint, _batch) in TRAINER_RESUMES.items()],
        # resumed with other TrainingArguments: Trainer would count another position than the loader's
        {**options["accum"], "save": None, "accumulate": 1, "name": "mismatch", "refused": True,
         "resume": str(out / "accum" / "checkpoint-3")})
    return out


def test_trainer_trains_every_sample_once_per_epoch_in_a_new_order_and_evaluates_after_each(trainer_runs):
    record = read(trainer_runs / "full-rank0.json")
    assert record["len"] == EPOCH and record["global_step"] == 3 * EPOCH
    assert_ranks_split_every_epoch([by_epoch(record["train"])], 3, "RemoteTrainer")
    for evaluation in range(3):  # the eval loader's batches in order, the same each time
        ids = [i for n, batch in record["eval"] if n == evaluation for i in batch]
        assert ids == list(range(TOTAL)), f"evaluation {evaluation} is not every sample once, in order"
    assert len(record["eval"]) == 3 * EPOCH, "an evaluation too many"


def test_trainer_resumes_mid_epoch_and_at_an_epochs_end_in_a_fresh_process_exactly(trainer_runs):
    for name, (of, checkpoint, batch) in TRAINER_RESUMES.items():
        assert (trainer_runs / of / checkpoint / "remoteloader_state.json").is_file(), f"{checkpoint}: no loader state"
        full, resumed = read(trainer_runs / f"{of}-rank0.json"), read(trainer_runs / f"{name}-rank0.json")
        assert [s[:2] for s in resumed["train"]] == [s[:2] for s in full["train"][batch:]], f"{name}: other batches"
        assert resumed["train"] == full["train"][batch:], f"{name}: other pixels"
        assert resumed["global_step"] == full["global_step"], name
        assert resumed["delivered"] == len(resumed["train"]), f"{name}: decoded batches it did not train"
    evaluated = read(trainer_runs / "mid-epoch-rank0.json")["eval"]
    assert [i for _n, batch in evaluated for i in batch] == list(range(TOTAL)) * 2, "resumed: not evaluated"
    refused = read(trainer_runs / "mismatch-rank0.json")
    assert "its RemoteLoader state is at batch 0 of epoch 1, and Trainer resumes at batch 3 of epoch 0" in (
        refused["error"] or ""), refused["error"]
    assert refused["train"] == [], "a resume that cannot be exact trained something"


def test_trainer_gradient_accumulation_max_steps_and_save_strategy_epoch_as_with_its_own_loaders(trainer_runs):
    full = read(trainer_runs / "full-rank0.json")["train"]
    accum, capped = read(trainer_runs / "accum-rank0.json"), read(trainer_runs / "capped-rank0.json")
    # 12 batches an epoch in steps of 5, 5 and 2: 3 optimizer steps an epoch, a checkpoint at each epoch's end
    assert accum["global_step"] == 6 and accum["train"] == full[: 2 * EPOCH]
    assert sorted(p.name for p in (trainer_runs / "accum").iterdir()) == ["checkpoint-3", "checkpoint-6"]
    # max_steps=5: epoch 0, then 2 steps (10 batches) of epoch 1
    assert capped["global_step"] == 5 and capped["train"] == full[: EPOCH + 10]
    assert capped["delivered"] == EPOCH + 10, "max_steps: batches decoded beyond the last step"


def test_trainer_under_torchrun_splits_every_epoch_over_the_ranks_and_resumes_each(servers, tmp_path):
    runs = [{"name": "ddp", "epochs": 2, "eval": True, "save": 3},  # 6 steps an epoch on each rank
            {"name": "ddp-resumed", "epochs": 2, "eval": True, "resume": str(tmp_path / "ddp" / "checkpoint-3")}]
    config = {"servers": servers, "out": str(tmp_path), "runs": runs}
    # --standalone: its rendezvous store binds a free port itself, and the ranks meet on it.
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(JOBS / "transformers_job.py"), json.dumps(config)], "the Trainer job under torchrun")
    records = [read(tmp_path / f"ddp-rank{r}.json") for r in range(2)]
    assert [r["len"] for r in records] == [EPOCH // 2] * 2 and [r["global_step"] for r in records] == [EPOCH] * 2
    assert_ranks_split_every_epoch([by_epoch(r["train"]) for r in records], 2, "RemoteTrainer under torchrun")
    for evaluation in range(2):
        ids = sorted(i for r in records for n, batch in r["eval"] if n == evaluation for i in batch)
        assert ids == list(range(TOTAL)), f"evaluation {evaluation} is not split over the ranks"
    for r in range(2):  # each rank's own state file, its own part of the rest
        assert (tmp_path / "ddp" / "checkpoint-3" / f"remoteloader_state_{r}.json").is_file()
        assert read(tmp_path / f"ddp-resumed-rank{r}.json")["train"] == records[r]["train"][3:], f"rank {r}"


def test_trainer_batches_become_the_models_arguments_or_say_what_they_hold():
    from remoteloader.integrations.transformers import model_inputs

    assert model_inputs(("pixel_values", "labels"))(("x", "y")) == {"pixel_values": "x", "labels": "y"}
    assert model_inputs(("pixel_values", "labels", None))(("x", "y", "ids")) == {"pixel_values": "x", "labels": "y"}
    assert model_inputs({"images": "pixel_values"})({"images": "x", "mask": "m"}) == {"pixel_values": "x"}
    assert model_inputs(lambda b: {"x": b[0]})(("x", "y")) == {"x": "x"}
    with pytest.raises(ValueError, match=r"names 2 elements, and the batches have 3 \(\(images, labels, ids\)\)"):
        model_inputs(("pixel_values", "labels"))(("x", "y", "ids"))
    with pytest.raises(ValueError, match=r"pass a mapping from those keys"):
        model_inputs(("pixel_values", "labels"))({"images": "x"})
    with pytest.raises(ValueError, match=r"input_names='pixel_values'"):
        model_inputs("pixel_values")


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
