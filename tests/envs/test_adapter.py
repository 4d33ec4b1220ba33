"""Any RGB, discrete-action Gymnasium environment can stand in for DoomNav."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from conftest import tiny_preset

from gradleak.capture.reader import CaptureFile
from gradleak.capture.run import CaptureJob, run_capture
from gradleak.envs.adapter import GymImageAdapter, make_gym_env
from gradleak.envs.frames import resize_area
from gradleak.errors import ConfigError
from gradleak.evaluation import evaluate_action_rules

TOY_ID = "GradleakTest/ColourRoom-v0"
if TOY_ID not in gym.registry:
    gym.register(id=TOY_ID, entry_point="helpers:ColourRoom")


def test_adapter_resizes_frames_and_adds_an_empty_goal() -> None:
    env = make_gym_env(TOY_ID, frame_size=32)
    observation, info = env.reset(seed=0)
    assert observation["image"].shape == (32, 32, 3) and observation["image"].dtype == np.uint8
    assert np.array_equal(observation["goal"], np.zeros(3, np.float32))
    assert info["scene"] == TOY_ID
    observation, reward, *_ = env.step(2)
    raw = env.unwrapped._frame(2)
    assert np.array_equal(observation["image"], resize_area(raw, 32, 32)) and reward == 1.0


def test_area_resize_preserves_the_mean_colour() -> None:
    frame = np.random.default_rng(0).integers(0, 256, (120, 160, 3)).astype(np.uint8)
    small = resize_area(frame, 64, 64)
    assert np.abs(small.mean((0, 1)) - frame.mean((0, 1))).max() < 0.5


def test_capture_and_recovery_run_on_a_generic_environment(tmp_path: Path) -> None:
    preset = tiny_preset()
    preset.env.backend, preset.env.gym_id = "gym", TOY_ID
    out = tmp_path / "toy.h5"
    run_capture(CaptureJob(victim="cnn-small", random_init=True, split="train", steps=40,
                           out=out, preset=preset, progress=False))
    with CaptureFile(out) as capture:
        assert capture.victim.num_actions == 4 and capture.scenes == [TOY_ID]
        assert capture.num_rows == 40
    assert evaluate_action_rules([out], ["odd-sign"])["odd-sign"]["accuracy"] >= 0.95


def test_the_analytic_decoder_trains_without_doom_action_facts(tmp_path: Path) -> None:
    """Four actions DoomNav has never heard of: the environment declares no mirrors and no
    camera motion, so the decoder fit goes without them (it refused K = 4 before)."""
    from gradleak.attacks.feature_decoder import DecoderConfig
    from gradleak.envs.actions import action_facts
    from gradleak.training.decoder_config import DecoderFitConfig
    from gradleak.training.decoder_fit import fit_decoder

    preset = tiny_preset()
    preset.env.backend, preset.env.gym_id = "gym", TOY_ID
    out = tmp_path / "toy.h5"
    run_capture(CaptureJob(victim="cnn-small", random_init=True, split="train", steps=40,
                           out=out, preset=preset, progress=False))
    assert action_facts({"backend": "gym"}, 4).mirror is None
    result = fit_decoder(DecoderConfig(channels=16, global_channels=0, context="warp"),
                         DecoderFitConfig(epochs=1, batch_size=8, extra_frames=0,
                                          max_val_frames=8), [str(out)], tmp_path / "dec",
                         progress=False)
    assert result["epochs"] == 1
    meta = (tmp_path / "dec" / "attacker.json").read_text()
    assert '"camera_motion": []' in meta  # undeclared: the warp starts from the identity


def test_environments_the_adapter_cannot_use_are_named() -> None:
    with pytest.raises(ConfigError, match="CartPole-v1.*RGB"):
        make_gym_env("CartPole-v1", frame_size=32)
    with pytest.raises(ConfigError, match="NoSuchEnv-v0"):
        make_gym_env("NoSuchEnv-v0", frame_size=32)
    continuous = gym.make(TOY_ID)
    continuous.action_space = gym.spaces.Box(-1, 1, (2,))
    with pytest.raises(ConfigError, match="not Discrete"):
        GymImageAdapter(continuous, 32, "toy")
