"""`gradleak capture`: arguments and the output location are checked before the engine starts;
one writer per output; an engine never outlives its Python process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

import gradleak.capture.run  # noqa: F401  (imported before a fork that drops root)
from gradleak.capture.lock import capture_lock
from gradleak.capture.writer import COMMITTED
from gradleak.cli import main
from gradleak.io import save_victim
from gradleak.victims import create_victim

from helpers import interruptible

from .conftest import check_refusal, copy_capture, run_unprivileged

TINY = ["--set", "env.doomnav.frame_size=32", "--set", "env.doomnav.max_steps=20",
        "--set", "env.train_maps=MAP01", "--set", "env.heldout_maps=MAP05",
        "--set", "env.max_regions_per_map=2"]


def capture_argv(out: Path, *extra: str, steps: int = 30) -> list[str]:
    return ["capture", "--victim", "cnn-small", "--random-init", "--scenes", "heldout",
            "--steps", str(steps), "--out", str(out), "--seed", "3", *TINY, *extra]


@pytest.mark.parametrize("extra, fragments", [
    (["--set", "env.doomnav.frame_size=0"], ["env.doomnav.frame_size=0", "at least 16"]),
    (["--set", "env.doomnav.frame_size=-8"], ["env.doomnav.frame_size=-8"]),
    (["--set", "capture.chunk=0"], ["capture.chunk=0", "at least 1"]),
    (["--set", "env.doomnav.max_steps=0"], ["env.doomnav.max_steps=0"]),
    (["--seed", "-1"], ["--seed -1", "non-negative"]),
    (["--components", ","], ["--components", "cnn,fc,heads"]),
    (["--components", "cnn,gpu"], ["'gpu'"]),
    (["--shard", "2/4", "--steps", "2"], ["--shard 2/4", "none of the 2 steps"]),
    (["--set", "capture=3"], ["capture=3", "is a section"]),
    (["--set", "capture.gradient_dtype=float64"], ["capture.gradient_dtype='float64'"]),
])
def test_bad_settings_are_refused_before_anything_is_written(refused, tmp_path: Path, extra,
                                                             fragments) -> None:
    argv = capture_argv(tmp_path / "out" / "c.h5")
    if "--steps" in extra:  # the shard case gives its own
        argv = argv[:argv.index("--steps")] + argv[argv.index("--steps") + 2:]
    refused([*argv, *extra], *fragments)


def test_an_output_path_that_is_a_directory_is_refused_up_front(refused, tmp_path: Path) -> None:
    (tmp_path / "c.h5").mkdir()
    refused(capture_argv(tmp_path / "c.h5", "--overwrite"), "c.h5 is a directory")


def test_an_output_whose_parent_is_a_file_is_refused(refused, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("mine")
    refused(capture_argv(tmp_path / "file" / "c.h5"), "is a file, not a directory")


def test_a_read_only_output_folder_is_refused_before_any_work(shared_dir: Path) -> None:
    locked = shared_dir / "read-only"
    locked.mkdir()
    locked.chmod(0o555)
    code, err = run_unprivileged(capture_argv(locked / "c.h5"))
    check_refusal(code, err, ("cannot write in", str(locked)))
    assert not list(locked.iterdir())


def test_a_victim_checkpoint_with_a_malformed_preset_is_named(refused, tmp_path: Path) -> None:
    folder = tmp_path / "victim"
    save_victim(folder, create_victim("cnn-small", frame_size=32))
    meta = json.loads((folder / "victim.json").read_text())
    for preset, field in (("oops", "preset: expected a preset object"),
                          ({"train": 5}, "preset.train"),
                          ({"train": {"value_coef": "big"}}, "value_coef")):
        meta["preset"] = preset
        (folder / "victim.json").write_text(json.dumps(meta))
        refused(["capture", "--victim", str(folder), "--scenes", "heldout", "--steps", "5",
                 "--out", str(tmp_path / "c.h5")], field)


def test_a_second_writer_is_refused_and_the_live_partial_left_alone(
        refused, tmp_path: Path, random_capture: Path) -> None:
    out = tmp_path / "c.h5"
    partial = copy_capture(random_capture, tmp_path, "c.h5.partial")
    with capture_lock(out, partial):  # another process's capture, in the middle of its work
        line = refused(capture_argv(out, "--overwrite"), f"PID {os.getpid()}", str(partial))
    assert "delete" not in line


@pytest.fixture
def short_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("short") / "c.h5"
    assert main([*capture_argv(out), "--quiet"]) == 0
    return out


def test_resume_with_fewer_steps_than_captured_is_refused(refused, tmp_path: Path,
                                                          short_capture: Path) -> None:
    with h5py.File(short_capture, "r") as handle:
        rows = int(handle.attrs["num_rows"])
    complete = copy_capture(short_capture, tmp_path, "c.h5")
    refused(capture_argv(complete, "--resume", steps=rows - 10), f"complete with {rows} steps")
    partial = tmp_path / "p.h5.partial"
    shutil.copyfile(short_capture, partial)
    with h5py.File(partial, "r+") as handle:  # as a writer leaves it: a commit per episode
        handle.attrs["complete"] = False
        handle.create_dataset(COMMITTED, data=[rows], maxshape=(None,), chunks=(16,))
    refused(capture_argv(tmp_path / "p.h5", "--resume", steps=rows - 10),
            f"already holds {rows} steps", f"--steps {rows - 10}")


@pytest.mark.slow
def test_the_engine_dies_with_its_python_process(tmp_path: Path) -> None:
    script = ("from gradleak.envs.doomnav import DoomNavEnv\nimport time\n"
              "env = DoomNavEnv(frame_size=32)\nenv.reset(seed=0)\n"
              "print(' '.join(map(str, env._engine_pids)), flush=True)\ntime.sleep(120)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=tmp_path)
    engines = [int(pid) for pid in child.stdout.readline().split()]
    assert engines and all(_running(pid) for pid in engines)
    os.kill(child.pid, signal.SIGKILL)  # the process alone, not its group
    child.wait()
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in engines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_running(pid) for pid in engines)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
def test_two_captures_of_one_output_a_live_one_and_a_second(capsys, tmp_path: Path) -> None:
    """The reported case, with two real processes: the second is refused and names the first,
    whose partial file stays readable and resumes."""
    out = tmp_path / "c.h5"
    # far more steps than run before the SIGINT: the first must still be live when the second
    # starts (4,000 steps could finish first on a fast, idle machine)
    first = subprocess.Popen([sys.executable, "-m", "gradleak.cli",
                              *capture_argv(out, steps=200_000), "--quiet"], cwd=tmp_path,
                             preexec_fn=interruptible)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "c.h5.partial").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "c.h5.partial").exists()
        assert main([*capture_argv(out, "--overwrite", steps=200_000), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert f"PID {first.pid}" in err and "being written by another process" in err
    finally:
        first.send_signal(signal.SIGINT)
        first.wait(timeout=60)
    with h5py.File(tmp_path / "c.h5.partial", "r") as handle:  # intact: the first one resumes
        assert handle.attrs["complete"] == False  # noqa: E712  (a numpy bool)
        # the commit marker counts the whole episodes written before the SIGINT (none, or
        # several when the second command was slow to be refused); the num_rows attribute
        # stays 0 until `finish`, as attributes cannot change under SWMR
        committed = handle[COMMITTED][:]
        assert list(committed) == sorted(committed)
        assert (int(committed[-1]) if len(committed) else 0) <= len(handle["gradients"])


def test_overwrite_replaces_only_a_capture(refused, tmp_path: Path) -> None:
    """--overwrite is for a capture at that path; a user's file of the same name is kept."""
    mine = tmp_path / "notes.h5"
    mine.write_text("mine")
    refused(capture_argv(mine, "--overwrite"), f"{mine} exists and is not a gradleak capture")
    folder = tmp_path / "folder.h5"
    folder.mkdir()
    refused(capture_argv(folder, "--overwrite"), str(folder))


def test_merge_never_replaces_a_dangling_link(refused, tmp_path: Path, random_capture: Path
                                              ) -> None:
    link = tmp_path / "merged.h5"
    link.symlink_to(tmp_path / "elsewhere.h5")  # the user's link, to a file not made yet
    refused(["merge", str(random_capture), str(random_capture), "--out", str(link)],
            f"--out {link} is a symbolic link to {tmp_path / 'elsewhere.h5'}, which does not "
            "exist")
    assert link.is_symlink() and not (tmp_path / "elsewhere.h5").exists()
