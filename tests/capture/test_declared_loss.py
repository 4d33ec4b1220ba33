"""The loss a client used is declared, stored and required: never a silent default."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from gradleak.cli import main
from gradleak.errors import ConfigError
from gradleak.io import save_victim
from gradleak.rl.losses import parse_loss
from gradleak.victims import create_victim

TINY = ["--set", "env.doomnav.frame_size=32", "--set", "env.doomnav.max_steps=10",
        "--set", "env.heldout_maps=MAP05", "--set", "env.max_regions_per_map=1"]
SB3 = "value=0.25,entropy=0.02,clip=0.1,gamma=0.98,lam=0.9"


@pytest.fixture
def bare_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint that says nothing of how it was trained (as a user's own would)."""
    folder = tmp_path / "victim"
    save_victim(folder, create_victim("cnn-small", frame_size=32))
    meta = json.loads((folder / "victim.json").read_text())
    assert "preset" not in meta
    return folder


def capture(victim: Path, out: Path, *extra: str) -> int:
    return main(["capture", "--victim", str(victim), "--scenes", "heldout", "--steps", "12",
                 "--out", str(out), "--seed", "2", "--quiet", *TINY, *extra])


def loss_of(path: Path) -> dict:
    with h5py.File(path, "r") as handle:
        return json.loads(handle.attrs["loss"])


def test_a_checkpoint_that_declares_no_loss_needs_one(capsys, tmp_path: Path,
                                                      bare_checkpoint: Path) -> None:
    assert capture(bare_checkpoint, tmp_path / "c.h5") == 2
    err = capsys.readouterr().err
    assert "declares no learning rule" in err and "--loss value=...,entropy=..." in err
    assert not (tmp_path / "c.h5").exists()
    assert capture(bare_checkpoint, tmp_path / "c.h5", "--loss", "value=0.25,entropy=0.02") == 2
    assert "missing clip, gamma, lam" in capsys.readouterr().err


def test_the_declared_loss_is_the_one_in_the_gradient(capsys, tmp_path: Path,
                                                      bare_checkpoint: Path) -> None:
    out = tmp_path / "c.h5"
    assert capture(bare_checkpoint, out, "--loss", SB3, "--set",
                   "capture.gradient_dtype=float32") == 0
    stored = loss_of(out)
    assert {k: stored[k] for k in ("value", "entropy", "clip", "gamma", "lam")} == \
        parse_loss(SB3)
    # The value head's bias gradient is 2 c_v (V − R): R comes back exactly only with the c_v
    # the client used, and the stored one is read.
    assert main(["closed-form", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)[str(out)]
    assert result["returns_max_abs_error"] < 1e-3 and result["action_accuracy"] == 1.0


@pytest.mark.slow
def test_a_trained_checkpoint_keeps_its_rule_unless_told(capsys, tmp_path: Path,
                                                         preset) -> None:
    from gradleak.rl.trainer import train_victim

    victim = tmp_path / "trained"
    train_victim(preset, victim, progress=False)
    assert capture(victim, tmp_path / "a.h5") == 0
    assert loss_of(tmp_path / "a.h5")["value"] == preset.train.value_coef
    assert capture(victim, tmp_path / "b.h5", "--loss", "value=0.25") == 0
    stored = loss_of(tmp_path / "b.h5")
    assert stored["value"] == 0.25 and stored["entropy"] == preset.train.entropy_coef
    assert capture(victim, tmp_path / "c.h5", "--set", "train.value_coef=0.3") == 2
    assert "declare it with --loss" in capsys.readouterr().err


def test_raw_advantages_are_declared_and_used(tmp_path: Path, bare_checkpoint: Path) -> None:
    out = tmp_path / "c.h5"
    assert capture(bare_checkpoint, out, "--loss", SB3, "--advantage-norm", "none") == 0
    assert loss_of(out)["advantage_normalisation"] == "none (raw GAE)"
    with h5py.File(out, "r") as handle:
        assert np.array_equal(handle["advantages"][:], handle["advantages_raw"][:])


def test_minibatch_normalised_advantages_are_what_the_gradient_used(
        capsys, tmp_path: Path, bare_checkpoint: Path) -> None:
    from gradleak.rl.advantages import normalise_minibatches

    out = tmp_path / "c.h5"
    assert capture(bare_checkpoint, out, "--loss", SB3, "--advantage-norm", "minibatch:4",
                   "--set", "capture.gradient_dtype=float32") == 0
    assert loss_of(out)["advantage_normalisation"] == \
        "per minibatch of 4 consecutive steps, sample std"
    with h5py.File(out, "r") as handle:
        used, raw = handle["advantages"][:], handle["advantages_raw"][:]
        episodes = handle["episode_ids"][:]
    for episode in np.unique(episodes):  # each episode's runs of 4, normalised on their own
        rows = episodes == episode
        assert np.allclose(used[rows], normalise_minibatches(raw[rows], 4), atol=1e-6)
    assert not np.allclose(used, raw)
    assert main(["closed-form", str(out), "--json"]) == 0  # and the closed form recovers them
    result = json.loads(capsys.readouterr().out)[str(out)]
    assert result["advantage_median_relative_error"] < 1e-3


@pytest.mark.parametrize("norm, fragment", [
    ("rollout", "has no rollout to normalise over"),
    ("minibatch:0", "expected one of episode, none, minibatch:M, rollout"),
    ("batch", "expected one of"),
])
def test_an_advantage_normalisation_a_capture_cannot_replay_is_refused(
        capsys, tmp_path: Path, bare_checkpoint: Path, norm: str, fragment: str) -> None:
    assert capture(bare_checkpoint, tmp_path / "c.h5", "--loss", SB3, "--advantage-norm",
                   norm) == 2
    assert fragment in capsys.readouterr().err
    assert not (tmp_path / "c.h5").exists()


@pytest.mark.parametrize("text, fragment", [
    ("value=0.25,value=0.3", "'value' is given twice"),
    ("gamma", "is not KEY=VALUE"),
    ("beta=1", "is not KEY=VALUE"),
    ("value=nan", "must be finite"),
    ("clip=-1", "must be finite and >= 0"),
    ("entropy=lots", "is not a number"),
])
def test_a_malformed_loss_is_named(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_loss(text)
