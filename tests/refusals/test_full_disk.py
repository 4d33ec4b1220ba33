"""A full disk (a small tmpfs, mounted for the test): one line naming the path and the room
left, nothing half-written, and a capture resumes once there is room."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import user_models

from gradleak.cli import main
from gradleak.fedavg.update_file import write_update

from .conftest import check_refusal
from .test_capture_refusals import capture_argv


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MB tmpfs (remounted larger by the tests that need room again)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)],
                          capture_output=True)
    if done.returncode:
        pytest.skip(f"a tmpfs cannot be mounted here ({done.stderr.decode().strip()})")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path, leave: int) -> None:
    """Leave about `leave` bytes free on the device."""
    import shutil

    free = shutil.disk_usage(folder).free
    (folder / "ballast").write_bytes(b"\0" * max(free - leave, 0))


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.name.endswith(".tmp"))


@pytest.mark.slow
def test_a_capture_stops_before_the_disk_is_full_and_resumes_with_room(
        small_disk: Path, capsys) -> None:
    out = small_disk / "c.h5"
    code = main([*capture_argv(out, steps=120), "--quiet"])
    line = check_refusal(code, capsys.readouterr().err, (str(out) + ".partial", "MB free on "
                                                         "its device", "--resume"))
    assert "needed for" in line
    subprocess.run(["mount", "-o", "remount,size=40m", str(small_disk)], check=True)
    assert main([*capture_argv(out, steps=120), "--resume", "--quiet"]) == 0
    from gradleak.capture.reader import CaptureFile

    with CaptureFile(out) as capture:
        assert capture.validate()["rows"] == 120


def test_reports_and_copies_on_a_full_disk_are_one_line_and_leave_nothing_half_written(
        small_disk: Path, random_capture: Path, capsys) -> None:
    fill(small_disk, 8 * 2**10)
    audit = small_disk / "audit"
    code = main(["audit", "--capture", str(random_capture), "--defenses", "none", "--out",
                 str(audit), "--training-free-windows", "1", "--optimisation-windows", "0",
                 "--quiet"])
    check_refusal(code, capsys.readouterr().err, ("no space left on its device",))
    defended = small_disk / "d.h5"
    code = main(["defend", str(random_capture), "--defense", "quant:8", "--out",
                 str(defended), "--quiet"])
    check_refusal(code, capsys.readouterr().err, (str(defended), "no space left"))
    assert not defended.exists() and leftovers(small_disk) == []


def test_an_inversion_and_an_experiment_on_a_full_disk(small_disk: Path, tmp_path: Path,
                                                       capsys) -> None:
    torch.manual_seed(0)
    model = user_models.TinyClassifier()
    w0 = {k: v.clone() for k, v in model.state_dict().items()}
    wT = {k: v + 0.01 if v.is_floating_point() else v.clone() for k, v in w0.items()}
    update = write_update(tmp_path / "node-1.safetensors", w0, wT,
                          {"round": 1, "node_id": 1, "num_examples": 2, "shape": [1, 8, 8],
                           "hyperparameters": {"lr": 0.1, "epochs": 1, "batch": 2},
                           "model": "tiny-classifier"})
    fill(small_disk, 2 * 2**10)
    code = main(["fedavg-invert", "--update", str(update), "--iters", "2", "--out",
                 str(small_disk / "inv"), "--quiet"])
    check_refusal(code, capsys.readouterr().err, ("no space left",))
    code = main(["experiment", "toy", "--plugin", "user_experiments", "--seeds", "1", "--out",
                 str(small_disk / "exp"), "--quiet"])
    check_refusal(code, capsys.readouterr().err, ("no space left",))
    assert leftovers(small_disk) == []
    records = list((small_disk / "exp").rglob("cells/*.json"))
    assert all(json.loads(p.read_text()) for p in records)  # whole, or not there
