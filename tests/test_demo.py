"""The main job: ``remoteloader demo`` trains through two local servers and cleans up after itself."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import CTRL_C_EXITS

pytestmark = pytest.mark.slow

DEMO = [sys.executable, "-m", "remoteloader.tools.cli", "demo"]


def server_pids(*, parent: int | None = None, data: pathlib.Path | None = None) -> set[int]:
    """Loader servers running now: children of ``parent``, or serving data under ``data`` (not
    those of other tests, or of other suites running on the same machine)."""
    pattern = "remoteloader.server.cli --data" + (f" {re.escape(str(data))}" if data else "")
    parents = ["-P", str(parent)] if parent else []
    out = subprocess.run(["pgrep", *parents, "-f", pattern], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def test_demo_trains_prints_figures_and_stops_its_servers(tmp_path):
    result = subprocess.run(DEMO + ["--epochs", "3", "--images-per-class", "48", "--classes", "3",
                                    "--batch-size", "24", "--image-size", "32", "--data", str(tmp_path)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)%\s+([\d.]+)$", result.stdout, re.M)
    assert len(rows) == 3, result.stdout
    losses = [float(r[3]) for r in rows]
    assert all(int(r[1]) > 0 for r in rows)  # images/s
    assert losses[-1] < losses[0], f"the loss should fall: {losses}"
    assert re.search(r"accuracy \(eval pipeline, \d+ images\)", result.stdout)
    assert "batches read from the servers' shared memory (same host" in result.stdout  # its servers are local
    assert not server_pids(data=tmp_path), "the demo left loader servers running"


def test_detection_demo_trains_a_detector_that_beats_a_constant_box(tmp_path):
    # Quick flags: 600 images (480 to train on, 120 held out), 3 epochs of 15 batches (~15 s on 2 cores).
    result = subprocess.run(DEMO + ["--task", "detection", "--epochs", "3", "--images", "600",
                                    "--data", str(tmp_path)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "480 to train on, 120 held out" in out, out
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)%\s+([\d.]+)$", out, re.M)
    assert len(rows) == 3, out
    assert all(int(r[1]) > 0 for r in rows)  # images/s
    losses = [float(r[3]) for r in rows]
    assert losses[-1] < 0.7 * losses[0], f"the loss should fall: {losses}"
    found = re.search(r"mean IoU \(detection-eval, 120 held-out images, (\d+) boxes\): ([\d.]+); "
                      r"one constant box \(the mean true box\) gets ([\d.]+)", out)
    assert found, out
    boxes, iou, constant = int(found.group(1)), float(found.group(2)), float(found.group(3))
    assert boxes >= 120  # 1-3 shapes per image
    # The constant box is the mean of the true boxes themselves, scored against every true box with
    # no matching: an upper bound on what a model that ignores the image can get (an untrained one,
    # whose centre scores start low, predicts no box at all: IoU 0).
    assert 0.0 < constant < 0.2, out
    assert iou > constant + 0.3, f"mean IoU {iou} is not clearly above the constant box's {constant}"
    hits = re.search(r"boxes found \(IoU >= 0.5, right class\): ([\d.]+)%", out)
    assert hits and float(hits.group(1)) > 40, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["detection-0", "detection-1"]
    assert not server_pids(data=tmp_path), "the demo left loader servers running"


def test_video_demo_trains_a_3d_cnn_on_generated_clips_and_stops_its_servers(tmp_path):
    pytest.importorskip("av", reason="the video extra (pip install 'remoteloader[video]')")
    # The default dataset (4 classes x 16 H.264 videos, 8-frame clips of 32x32), 3 epochs: ~25 s on 2 cores.
    started = time.monotonic()
    result = subprocess.run(DEMO + ["--video", "--epochs", "3", "--data", str(tmp_path)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "64 videos, 8 batches of 8 clips (8 frames at stride 2, 32x32) per epoch" in out, out
    assert re.search(r"^epoch\s+clips/s\s+data wait\s+loss$", out, re.M), out
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+(\d+)%\s+([\d.]+)$", out, re.M)
    assert len(rows) == 3, out
    assert all(float(r[1]) > 0 for r in rows)  # clips/s
    losses = [float(r[3]) for r in rows]
    assert losses[-1] < losses[0], f"the loss should fall: {losses}"
    assert re.search(r"accuracy \(video-eval clips, 64 videos\): [\d.]+%", out), out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["video-0", "video-1"]
    assert len(list(tmp_path.glob("video-0/*/*.mp4"))) == 4 * 8
    assert not server_pids(data=tmp_path), "the demo left loader servers running"
    assert time.monotonic() - started < 200


def test_video_demo_prepare_writes_video_folders_without_importing_torch(tmp_path):
    pytest.importorskip("av", reason="the video extra (pip install 'remoteloader[video]')")
    code = (f"import sys\nfrom remoteloader.tools.cli import main\n"
            f"code = main(['demo', '--prepare', {str(tmp_path)!r}, '--video', '--videos-per-class', '2'])\n"
            f"assert not [m for m in sys.modules if m.split('.')[0] == 'torch'], 'torch imported'\n"
            f"sys.exit(code)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["video-0", "video-1"]
    videos = sorted(str(p.relative_to(tmp_path / "video-1")) for p in (tmp_path / "video-1").glob("*/*.mp4"))
    assert videos == [f"{c}/{c}_0000.mp4" for c in ("drifting", "falling", "pulsing", "rising")]


def test_detection_data_is_reused_rewritten_when_asked_for_another_size_and_kept_apart(tmp_path):
    from remoteloader.tools.cli import main

    def prepare(*argv):
        assert main(["demo", "--prepare", str(tmp_path), "--servers", "2", *argv]) == 0

    prepare("--task", "detection", "--images", "20")
    annotations = tmp_path / "detection-1" / "annotations.json"
    stamp = annotations.stat().st_mtime_ns
    prepare("--task", "detection", "--images", "20")
    assert annotations.stat().st_mtime_ns == stamp  # reused
    prepare("--task", "detection", "--images", "12")
    assert len(list((tmp_path / "detection-1" / "images").glob("*.jpg"))) == 6  # no stale images left
    prepare("--images-per-class", "8")  # the classification shards sit beside them
    assert sorted(p.name for p in tmp_path.iterdir()) == ["detection-0", "detection-1", "shard-0", "shard-1"]
    assert not (tmp_path / "shard-0" / "images").exists()


def test_a_sigterm_while_the_demo_starts_stops_it_and_connect_stops_no_servers(tmp_path):
    """Its handler comes first (before torch imports): as a container's PID 1 an early SIGTERM
    would otherwise be ignored; and --connect, which started no servers, does not say it stopped any."""
    proc = subprocess.Popen(DEMO + ["--connect", "127.0.0.1:1", "--data", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while not any(line.startswith("SigCgt:") and int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1
                      for line in pathlib.Path(f"/proc/{proc.pid}/status").read_text().splitlines()):
            assert proc.poll() is None and time.monotonic() < deadline, "no SIGTERM handler"
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, output
    assert "interrupted" in output and "servers stopped" not in output, output
    assert "Traceback" not in output, output


def test_a_sigterm_that_lands_in_a_string_exec_still_exits_130(tmp_path):
    """Torch's imports run string execs (dataclasses); a SIGTERM that lands in one must not turn
    the demo's 130 into a death by SIGINT (as a KeyboardInterrupt there would, under -m)."""
    (tmp_path / "stopped_in_exec.py").write_text(
        "import sys\n"
        "from remoteloader.tools import cli, demo\n"
        "def _run(args):\n"
        "    exec('import os, signal, time; os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)', {})\n"
        "demo._run = _run\n"
        "sys.exit(cli.main(['demo', '--connect', '127.0.0.1:1']))\n"
    )
    done = subprocess.run([sys.executable, "-m", "stopped_in_exec"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert done.stderr.strip() == "interrupted", done.stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_the_demo_its_servers_and_removes_its_temp_data(tmp_path, signum):
    # With --data the dataset is kept; without, it lives in a temp dir that must go.
    keep = ["--data", str(tmp_path)] if signum == signal.SIGINT else []
    proc = subprocess.Popen(DEMO + ["--epochs", "50", "--images-per-class", "40", "--image-size", "32", *keep],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    data = None
    for line in proc.stdout:
        found = re.match(r"dataset: \d+ shard\(s\) under (\S+),", line)
        data = found.group(1) if found else data
        if line.lstrip().startswith("0 ") or time.monotonic() > deadline:  # first epoch done: training
            break
    started = server_pids(parent=proc.pid)
    assert started, "the demo should have started loader servers"
    assert data and os.path.isdir(data)
    proc.send_signal(signum)
    try:
        code = proc.wait(60)
    finally:
        proc.kill()
    assert code == 130 if signum == signal.SIGTERM else code in CTRL_C_EXITS
    time.sleep(0.5)
    assert not (server_pids() & started), "Ctrl-C left loader servers running"
    for pid in started:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert os.path.isdir(data) == bool(keep), f"{data}: kept {os.path.isdir(data)}, asked to keep {bool(keep)}"


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "--batch-size=0"),
    (["--image-size", "4"], "--image-size=4"),
    (["--images-per-class", "1"], "at least one image per class"),
    (["--images-per-class", "8", "--batch-size", "64"], "fewer than --batch-size"),
    (["--device", "tpu"], "--device=tpu"),
    (["--epochs", "0"], "--epochs=0"),
    (["--task", "detection", "--classes", "3"], "--classes is for --task classification"),
    (["--task", "detection", "--images-per-class", "8"], "--images-per-class is for --task classification"),
    (["--images", "100"], "--images is for --task detection"),
    (["--task", "detection", "--images", "4", "--batch-size", "1"], "too few to hold one in 5 out"),
    (["--task", "detection", "--images", "30"], "fewer than --batch-size 32"),
    (["--task", "detection", "--batch-size", "0"], "--batch-size=0"),
    (["--video", "--task", "detection"], "does not go with --task detection"),
    (["--video", "--images-per-class", "8"], "--images-per-class is for --task classification, not --video"),
    (["--videos-per-class", "8"], "--videos-per-class is for --video, not --task classification"),
    (["--video", "--videos-per-class", "1"], "at least one video per class"),
    (["--video", "--videos-per-class", "2", "--batch-size", "16"], "8 videos in all, fewer than --batch-size"),
    (["--video", "--classes", "5"], "expected 2..4 with --video"),
])
def test_bad_demo_arguments_are_one_line_errors_before_anything_starts(tmp_path, argv, message):
    from remoteloader.tools.cli import main

    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["demo", "--data", str(tmp_path / "new"), *argv])
    assert not (tmp_path / "new").exists()


def test_the_demo_never_writes_into_a_folder_it_did_not_make(tmp_path):
    from remoteloader.tools.cli import main

    (tmp_path / "cats").mkdir()
    (tmp_path / "cats" / "a.jpg").write_bytes(b"mine")
    with pytest.raises(SystemExit, match="did not write"):
        main(["demo", "--data", str(tmp_path)])
    with pytest.raises(SystemExit, match="did not write"):
        main(["demo", "--prepare", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cats"]


def test_a_shard_whose_writing_was_cut_short_is_written_again(tmp_path):
    # e.g. the compose "prepare" service stopped half-way: its volume holds part of a shard.
    from remoteloader.tools.cli import main

    partial = tmp_path / "shard-0" / "diagonal"
    partial.mkdir(parents=True)
    (partial / "diagonal_00000.jpg").write_bytes(b"")  # cut off mid-write
    handler = signal.getsignal(signal.SIGTERM)
    assert main(["demo", "--prepare", str(tmp_path), "--servers", "2", "--images-per-class", "8"]) == 0
    assert signal.getsignal(signal.SIGTERM) is handler  # the demo's own SIGTERM handling is undone
    for shard in ("shard-0", "shard-1"):
        files = sorted((tmp_path / shard).glob("*/*.jpg"))
        assert len(files) == 4 * 4 and all(f.stat().st_size > 0 for f in files), shard
    stamp = (tmp_path / "shard-0" / ".remoteloader-demo-complete").stat().st_mtime_ns
    assert main(["demo", "--prepare", str(tmp_path), "--servers", "2", "--images-per-class", "8"]) == 0
    assert (tmp_path / "shard-0" / ".remoteloader-demo-complete").stat().st_mtime_ns == stamp  # reused


def test_prepare_with_connect_still_refuses_a_foreign_folder(tmp_path):
    from remoteloader.tools.cli import main

    (tmp_path / "photos").mkdir()
    with pytest.raises(SystemExit, match="did not write"):
        main(["demo", "--prepare", str(tmp_path), "--connect", "127.0.0.1:1"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["photos"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("address, message", [
    ("127.0.0.1:{closed}", "refused the connection: nothing listens there"),  # tried until connect_timeout (issue 43)
    ("127.0.0.1:{silent}", "did not answer within 2s"),  # a port that accepts and never answers
    ("no-port-here", "expected host:port"),
])
def test_connect_to_no_server_is_a_one_line_error(monkeypatch, closed_port, address, message):
    import functools
    import socket

    from remoteloader.client import loader
    from remoteloader.tools.cli import main

    # The loader's default connect_timeout (10 s) is what a user waits; the message is the same.
    monkeypatch.setattr(loader, "RemoteLoader", functools.partial(loader.RemoteLoader, connect_timeout=2))
    with socket.socket() as silent:  # listens (the kernel accepts) but never speaks gRPC
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = address.format(closed=closed_port(), silent=silent.getsockname()[1])
        started = time.monotonic()
        with pytest.raises(SystemExit) as info:
            main(["demo", "--connect", address])
    took = time.monotonic() - started
    assert isinstance(info.value.code, str) and "\n" not in info.value.code, info.value.code
    assert info.value.code.startswith(f"--connect={address}: ") and message in info.value.code, info.value.code
    if "refused" in message:  # tried again until connect_timeout=2 (a server may be starting), then reported
        assert 1.5 < took < 2 + 4, f"a refused connection took {took:.1f}s to report"


# A client-only install (`pip install remoteloader`, no `server` extra): its modules fail to import.
CLIENT_ONLY = "import sys\nfor name in ('simplejpeg', 'cv2', 'albumentations'):\n    sys.modules[name] = None\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, prog", [
    (["pack", "src", "dst"], "remoteloader pack"),
    (["pack", "--help"], "remoteloader pack"),
    (["serve", "--data", "src"], "remoteloader serve"),
    (["demo", "--data", "new", "--images-per-class", "8", "--batch-size", "8"], "remoteloader demo"),
])
def test_a_server_subcommand_without_the_server_extra_says_how_to_install_it(tmp_path, argv, prog):
    code = CLIENT_ONLY + f"from remoteloader.tools.cli import main\nsys.exit(main({argv!r}))\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"{prog} needs the server extra: pip install 'remoteloader[server]'"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert os.listdir(tmp_path) == []  # the demo wrote no dataset


@pytest.mark.timeout(60)
def test_probe_needs_only_the_client(closed_port):
    code = CLIENT_ONLY + (f"from remoteloader.tools.cli import main\n"
                          f"sys.exit(main(['probe', '127.0.0.1:{closed_port()}', '--timeout', '1']))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr, result.stderr  # it ran: nothing listens
    assert "Traceback" not in result.stderr and "server extra" not in result.stderr
