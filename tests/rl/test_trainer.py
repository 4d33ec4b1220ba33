"""PPO/A2C training: one update end to end, resume, BatchNorm handling."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from gradleak.errors import ConfigError
from gradleak.io import load_victim, theta_sha256
from gradleak.presets import Preset
from gradleak.rl.losses import LossCoefficients
from gradleak.rl.trainer import VictimTrainer, _minibatch_loss, refresh_batchnorm, train_victim
from gradleak.victims import create_victim


@pytest.mark.slow
def test_training_resumes_where_it_stopped(preset: Preset, tmp_path: Path) -> None:
    train_victim(preset, tmp_path, progress=False)
    first, _ = load_victim(tmp_path)
    preset.train.updates = 2
    with pytest.raises(ConfigError, match="--resume"):
        VictimTrainer(preset, tmp_path)
    result = train_victim(preset, tmp_path, resume=True, progress=False)
    second, meta = load_victim(tmp_path)
    assert result["updates"] == 2 and meta["update"] == 2
    assert result["env_steps"] == 2 * preset.train.num_envs * preset.train.rollout_steps
    assert theta_sha256(first) != theta_sha256(second)
    rows = list(csv.DictReader((tmp_path / "learning_curve.csv").open()))
    assert [int(r["update"]) for r in rows] == [1, 2]
    assert (tmp_path / "learning_curve.png").stat().st_size > 0
    trainer = VictimTrainer(preset, tmp_path, resume=True)
    steps = [int(s["step"]) for s in trainer.optimiser.state_dict()["state"].values()]
    per_update = preset.train.epochs * (preset.train.num_envs * preset.train.rollout_steps
                                        // preset.train.minibatch)
    assert set(steps) == {2 * per_update}  # Adam's state came back with the weights


def test_a2c_takes_one_step_per_rollout(preset: Preset, tmp_path: Path) -> None:
    preset.train.algo = "a2c"
    train_victim(preset, tmp_path, progress=False)
    trainer = VictimTrainer(preset, tmp_path, resume=True)
    assert {int(s["step"]) for s in trainer.optimiser.state_dict()["state"].values()} == {1}


def test_ppo_ratio_is_one_on_the_first_minibatch() -> None:
    victim = create_victim("cnn-small", frame_size=32).eval()
    images = torch.randint(0, 256, (8, 32, 32, 3), dtype=torch.uint8)
    actions = torch.randint(0, 5, (8,))
    with torch.no_grad():
        log_probs = torch.log_softmax(victim(images)[0], -1).gather(-1, actions[:, None])[:, 0]
    batch = {"images": images, "goals": torch.zeros(8, 3), "actions": actions,
             "log_probs": log_probs, "advantages": torch.randn(8), "returns": torch.randn(8)}
    _, stats = _minibatch_loss(victim, batch, LossCoefficients(), ppo=True)
    assert stats["approx_kl"] == pytest.approx(0.0, abs=1e-7)


def test_batchnorm_refresh_updates_statistics_and_returns_to_eval() -> None:
    victim = create_victim("cnn-small", frame_size=32).eval()
    before = victim.encoder[2].running_mean.clone()
    refresh_batchnorm(victim, torch.randint(0, 256, (16, 32, 32, 3), dtype=torch.uint8),
                      torch.zeros(16, 3))
    assert not victim.training
    assert not torch.equal(before, victim.encoder[2].running_mean)


def test_unknown_algorithm(preset: Preset, tmp_path: Path) -> None:
    preset.train.algo = "sac"
    with pytest.raises(ConfigError, match="train.algo='sac'"):
        VictimTrainer(preset, tmp_path)
