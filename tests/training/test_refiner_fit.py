"""The training-free attack's learned prior: fitted on the attack's own frames of the attacker's
captures, it learns their residual; a resumed fit reads those frames instead of attacking again;
at attack time its guess goes back through the equations; and a prior for another θ0, or a
missing one, is refused before any work."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from gradleak.attacks.catalogue import build
from gradleak.attacks.defense_aware import DefenseAwareConfig, DefenseAwareRun
from gradleak.attacks.exact import WITH_PRIOR, ExactConfig
from gradleak.attacks.frame_refiner import RefinerConfig
from gradleak.attacks.single_step import Context
from gradleak.capture.reader import CaptureFile
from gradleak.cli import main
from gradleak.defenses import parse_defense
from gradleak.defenses.base import row_keys
from gradleak.errors import CaptureFileError
from gradleak.inversion.frame_solve import FrameSolve
from gradleak.threat import declared
from gradleak.training import refiner_fit
from gradleak.training.refiner_fit import RefinerFit, RefinerFitConfig, exact_attack, load_prior

# the quadratic prior without the weight-gradient equations: frames with an error to learn
# (the default attack recovers these 32×32 frames at about 48 dB)
ROUGH = ExactConfig(weight_gradient=False, solve=FrameSolve(rounds=0, iterations=60))
MODEL = RefinerConfig(width=8, scales=2)


def settings(epochs: int) -> RefinerFitConfig:
    return RefinerFitConfig(epochs=epochs, batch_size=8, lr=3e-3, warmup_epochs=0.2,
                            max_frames=48, val_fraction=0.2)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory, train_capture: Path) -> RefinerFit:
    out = tmp_path_factory.mktemp("prior") / "prior"
    fit = RefinerFit(MODEL, settings(150), ROUGH, [str(train_capture)], out, progress=False)
    fit.run()
    return fit


def mse(frames: torch.Tensor, truth: torch.Tensor) -> float:
    return float((frames - truth).pow(2).mean())


@pytest.mark.slow
def test_the_prior_learns_the_residual_of_the_attacks_frames(fitted: RefinerFit) -> None:
    """A small refiner fitted on 48 of the attack's frames: on those frames it is at least a
    third nearer the truth than the attack (measured when written: 0.29 of its MSE), and it
    started as the identity."""
    attacked, truth = fitted._batch(fitted.train, np.arange(len(fitted.train)), None)
    with torch.no_grad():
        refined = fitted.model(attacked)
    assert mse(refined, truth) <= 2 / 3 * mse(attacked, truth)
    first = fitted.history[0]
    assert first["val_psnr_attack"] > 0 and "val_psnr" in first


def test_the_finished_fit_keeps_only_the_prior(fitted: RefinerFit) -> None:
    names = sorted(path.name for path in fitted.out.iterdir())
    assert "attacker.json" in names and not any(name.startswith("exact_pairs") for name in names)
    meta = json.loads((fitted.out / "attacker.json").read_text())
    assert meta["kind"] == "refiner" and meta["exact"]["weight_gradient"] is False


def test_a_resumed_fit_reads_the_attacks_frames_instead_of_attacking_again(
        train_capture: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "prior"
    first = RefinerFit(MODEL, settings(2), ROUGH, [str(train_capture)], out, progress=False)
    first.run(session_epochs=1)
    assert any(path.name.startswith("exact_pairs") for path in out.iterdir())

    def attacked_again(*args, **kwargs):  # noqa: ANN002, ANN003
        raise AssertionError("the training-free attack ran again")

    monkeypatch.setattr(refiner_fit, "ExactAttack", attacked_again)
    resumed = RefinerFit(MODEL, settings(2), ROUGH, [str(train_capture)], out, resume=True,
                         progress=False)
    assert resumed.epochs_done == 1
    np.testing.assert_array_equal(resumed.train.attacked, first.train.attacked)
    resumed.run()
    assert resumed.epochs_done == 2
    assert not any(path.name.startswith("exact_pairs") for path in out.iterdir())


def test_the_attack_with_the_prior_puts_its_guess_back_through_the_equations(
        fitted: RefinerFit, random_capture: Path) -> None:
    """On held-out steps at the same θ0: the row is named for the prior, the refiner changes
    the frames, and the projection brings the output equations' residual back to at most what
    the attack alone leaves (the refiner alone moves away from them)."""
    with CaptureFile(random_capture) as capture:
        observation = capture.observation(slice(0, 8))
    config = ExactConfig(**{**ROUGH.__dict__, "prior": str(fitted.out)})
    alone = exact_attack(observation, ROUGH).reconstruct()
    attack = exact_attack(observation, config)
    projected = attack.reconstruct()
    unprojected = exact_attack(observation, ExactConfig(**{**config.__dict__,
                                                           "prior_projection": 0})).reconstruct()
    assert attack.name == WITH_PRIOR
    assert np.abs(projected.images.astype(int) - alone.images.astype(int)).max() > 0
    np.testing.assert_array_equal(projected.actions, alone.actions)
    residual = {name: float(np.median(result.extras["residuals"]["outputs"]))
                for name, result in (("alone", alone), ("projected", projected),
                                     ("unprojected", unprojected))}
    assert residual["projected"] <= residual["alone"] * 1.01 + 1e-9
    assert residual["projected"] < residual["unprojected"]


@pytest.mark.slow
# one other θ0 is enough (a second capture parameter refits the module's prior: 22 s)
@pytest.mark.parametrize("float32_capture", ["ppo"], indirect=True)
def test_a_prior_fitted_against_another_theta0_is_refused(fitted: RefinerFit,
                                                          float32_capture: Path) -> None:
    with CaptureFile(float32_capture) as capture:
        observation = capture.observation(slice(0, 2))
    with pytest.raises(CaptureFileError, match="θ0 hash"):
        load_prior(fitted.out, observation)


def test_a_missing_prior_is_named_before_any_row_is_read(capsys, tmp_path: Path,
                                                          random_capture: Path) -> None:
    code = main(["attack", "training-free", "--data", str(random_capture), "--index", "0", "--out",
                 str(tmp_path / "out"), "--prior", str(tmp_path / "nowhere"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "gradleak train-prior" in err and "nowhere" in err
    assert not (tmp_path / "out").exists()


def test_a_prior_is_fitted_on_training_scenes_only(capsys, tmp_path: Path,
                                                   random_capture: Path) -> None:
    code = main(["train-prior", "--data", str(random_capture), "--out", str(tmp_path / "p"),
                 "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "training-scene" in err and str(random_capture) in err
    assert not (tmp_path / "p").exists()


def test_a_prior_under_a_defense_is_refused_not_ignored(capsys, tmp_path: Path,
                                                       train_capture: Path) -> None:
    """The fit schedule every learned attacker shares carries a defense; the prior's fit
    attacks the captures as stored, so a defense set there is named, not silently dropped."""
    code = main(["train-prior", "--data", str(train_capture), "--out", str(tmp_path / "p"),
                 "--set", "attack.prior_fit.defense=quant:8", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "attack.prior_fit.defense='quant:8'" in err
    assert not (tmp_path / "p").exists()


@pytest.mark.slow
def test_train_prior_then_attack_with_it_from_the_command_line(capsys, tmp_path: Path,
                                                               train_capture: Path,
                                                               random_capture: Path) -> None:
    """The two commands a user runs: the fit reports the attack's and the refined validation
    PSNR, and `attack training-free --prior` names the prior in its picture's row and its config."""
    prior = tmp_path / "prior"
    assert main(["train-prior", "--data", str(train_capture), "--out", str(prior), "--epochs",
                 "2", "--set", "attack.prior_fit.max_frames=24", "--set",
                 "attack.prior.width=4", "--set", "attack.prior.scales=2", "--json"]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert fitted["train_frames"] + fitted["val_frames"] == 24 and fitted["epochs"] == 2
    assert {"val_psnr", "val_psnr_attack"} <= set(fitted["last"])
    out = tmp_path / "attack"
    assert main(["attack", "training-free", "--data", str(random_capture), "--index", "0",
                 "--index", "1", "--out", str(out), "--prior", str(prior), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["prior"] == str(prior) and len(result["steps"]) == 2
    assert (out / "reconstructions.png").is_file()


@pytest.mark.slow
def test_the_defense_aware_attack_starts_from_the_frames_of_the_prior_it_names(
        fitted: RefinerFit, random_capture: Path) -> None:
    """Settings that name a prior reach the defense-aware attack through the registry like the
    training-free one: with no finish, its frames are the training-free attack's, prior and
    all, on the same defended steps."""
    with CaptureFile(random_capture) as capture:
        clean = capture.observation(slice(0, 4))
        keys = row_keys(dict(capture.attrs), 0, capture.num_rows)[:4]
    chain = parse_defense("quant:12")
    observation = replace(clean, defense=declared(chain.describe()["transforms"]),
                          gradients=chain.gradients(torch.from_numpy(clean.gradients),
                                                    keys).numpy())
    config = ExactConfig(**{**ROUGH.__dict__, "prior": str(fitted.out)})
    settings = DefenseAwareRun(config, DefenseAwareConfig(iterations=0, restart_above=None))
    prior = load_prior(config.prior, observation)
    aware = build(observation, settings, Context(prior=prior)).reconstruct()
    start = exact_attack(observation, config).reconstruct()
    np.testing.assert_array_equal(aware.images, start.images)
    assert np.abs(aware.images.astype(int) - exact_attack(observation, ROUGH).reconstruct()
                  .images.astype(int)).max() > 0  # the prior changed them
