"""`train-attacker` and `train-decoder`: no training on NaN/Inf gradients unless asked, a run
that diverges stops and keeps its last good checkpoint, and a resume continues only the run it
was: the same victim, θ0, layout and model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gradleak.cli import main
from gradleak.training.objectives import LtiObjective

from .conftest import copy_capture, poison_rows, snapshot

LTI = ["--kind", "lti", "--preset", "cpu-quick", "--set", "attack.lti.hidden=32",
       "--set", "attack.lti_fit.workers=0", "--set", "attack.lti_fit.max_train_windows=32",
       "--set", "attack.lti_fit.max_val_windows=4", "--set", "attack.lti_fit.normaliser_rows=64"]
DECODER = ["--preset", "cpu-quick", "--extra-frames", "0", "--epochs", "1",
           "--set", "attack.decoder.channels=8", "--set", "attack.decoder_fit.max_val_frames=8"]


def train(data: Path, out: Path, *extra: str, epochs: int = 1) -> dict:
    code = main(["train-attacker", *LTI, "--data", str(data), "--out", str(out), "--epochs",
                 str(epochs), "--quiet", *extra])
    assert code == 0
    return json.loads((out / "attacker.json").read_text())


@pytest.fixture
def poisoned_train(tmp_path: Path, train_capture: Path) -> Path:
    return poison_rows(copy_capture(train_capture, tmp_path / "in", "train.h5"), [10, 11],
                       float("inf"))


def test_training_on_inf_rows_is_refused_naming_file_and_rows(refused, tmp_path: Path,
                                                             poisoned_train: Path) -> None:
    refused(["train-attacker", *LTI, "--data", str(poisoned_train), "--out",
             str(tmp_path / "att")], str(poisoned_train), "2 row(s): 10-11", "--skip-nonfinite")
    refused(["train-decoder", *DECODER, "--data", str(poisoned_train), "--out",
             str(tmp_path / "dec")], "2 row(s): 10-11")


def test_skip_nonfinite_trains_without_those_windows(capsys, tmp_path: Path,
                                                     poisoned_train: Path) -> None:
    assert main(["train-attacker", *LTI, "--data", str(poisoned_train), "--out",
                 str(tmp_path / "att"), "--epochs", "1", "--skip-nonfinite", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["skipped_nonfinite_rows"] == 2
    weights = torch.cat([p.flatten() for p in _weights(tmp_path / "att").values()])
    assert torch.isfinite(weights).all()


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "attacker.safetensors"))


def test_a_diverging_run_stops_and_keeps_its_last_good_checkpoint(
        capsys, monkeypatch, tmp_path: Path, train_capture: Path) -> None:
    out = tmp_path / "att"
    train(train_capture, out, epochs=1)
    kept = snapshot(out)
    forward = LtiObjective.forward

    def diverged(self, *args, **kwargs):
        loss, parts = forward(self, *args, **kwargs)
        return loss * float("nan"), parts

    monkeypatch.setattr(LtiObjective, "forward", diverged)
    code = main(["train-attacker", *LTI, "--data", str(train_capture), "--out", str(out),
                 "--epochs", "2", "--resume", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "training loss became nan at epoch 2, step 1" in err
    assert "last good checkpoint (epoch 1)" in err and len(err.strip().splitlines()) == 1
    assert {k: v for k, v in snapshot(out).items() if "tensorboard" not in k} == \
        {k: v for k, v in kept.items() if "tensorboard" not in k}


def test_a_run_that_diverges_before_its_first_checkpoint_leaves_nothing(
        refused, monkeypatch, tmp_path: Path, train_capture: Path) -> None:
    forward = LtiObjective.forward
    monkeypatch.setattr(LtiObjective, "forward",
                        lambda self, *a, **k: (forward(self, *a, **k)[0] * float("inf"), {}))
    refused(["train-attacker", *LTI, "--data", str(train_capture), "--out",
             str(tmp_path / "att")], "training loss became inf", "no checkpoint")


@pytest.fixture(scope="module")
def other_victim_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Training scenes, another random-init θ0 (seed 4) of the same architecture."""
    from conftest import tiny_preset

    from gradleak.capture.run import CaptureJob, run_capture

    out = tmp_path_factory.mktemp("other") / "train.h5"
    run_capture(CaptureJob(victim="cnn-small", random_init=True, split="train", steps=120,
                           out=out, preset=tiny_preset(), progress=False, seed=4))
    return out


def test_resume_on_another_victims_capture_is_refused_with_both_fingerprints(
        refused, tmp_path: Path, train_capture: Path, other_victim_capture: Path) -> None:
    out = tmp_path / "att"
    meta = train(train_capture, out)
    mine = meta["fingerprint"]["theta0_sha256"][:12]
    line = refused(["train-attacker", *LTI, "--data", str(other_victim_capture), "--out",
                    str(out), "--epochs", "2", "--resume"], "θ0 hash", mine)
    assert line.count("…") == 2  # both fingerprints


def test_resume_with_another_model_size_is_refused(refused, tmp_path: Path,
                                                   train_capture: Path) -> None:
    out = tmp_path / "att"
    train(train_capture, out)
    refused(["train-attacker", *LTI, "--data", str(train_capture), "--out", str(out),
             "--epochs", "2", "--resume", "--set", "attack.lti.hidden=48"],
            "hidden=32", "asks for 48")


def test_an_output_under_a_file_is_refused(refused, tmp_path: Path,
                                           train_capture: Path) -> None:
    (tmp_path / "file").write_text("mine")
    refused(["train-attacker", *LTI, "--data", str(train_capture), "--out",
             str(tmp_path / "file" / "att")], "is a file, not a directory")
    refused(["train-decoder", *DECODER, "--data", str(train_capture), "--out",
             str(tmp_path / "file")], "is a file")


@pytest.mark.parametrize("extra, fragment", [
    (["--seed", "-1"], "train.seed=-1"),
    (["--updates", "0"], "train.updates=0"),
    (["--updates", "two"], "train.updates"),
    (["--algo", "sac"], "train.algo='sac'"),
    (["--set", "train.lr=nan"], "train.lr=nan"),
    (["--set", "train=1"], "is a section"),
    (["--wad", "."], "is a directory"),
])
def test_train_victim_checks_its_settings_first(refused, tmp_path: Path, extra,
                                                fragment: str) -> None:
    refused(["train-victim", "--out", str(tmp_path / "victim"), *extra], fragment)


def test_train_victim_and_attack_check_their_output_first(refused, tmp_path: Path,
                                                          random_capture: Path) -> None:
    (tmp_path / "file").write_text("mine")
    refused(["train-victim", "--out", str(tmp_path / "file")], "is a file")
    refused(["attack", "ig", "--data", str(random_capture), "--index", "0", "--out",
             str(tmp_path / "file" / "ig")], "is a file, not a directory")


@pytest.mark.parametrize("command, flags, fragment", [
    ("train-prior", ["--minutes", "-1"], "attack.prior_fit.time_limit_minutes=-1.0: expected "
                                         "a positive time limit"),
    ("train-decoder", ["--minutes", "0"], "attack.decoder_fit.time_limit_minutes=0.0"),
    ("train-attacker", ["--set", "attack.trace_fit.time_limit_minutes=-2"],
     "attack.trace_fit.time_limit_minutes=-2.0"),
])
def test_a_time_limit_that_is_spent_before_it_starts_is_refused(refused, tmp_path: Path,
                                                               train_capture: Path, command,
                                                               flags, fragment) -> None:
    refused([command, "--data", str(train_capture), "--out", str(tmp_path / "fit"), *flags],
            fragment)
