"""The training-free attack: from the observation alone, exact actions and frames far above
their mean image on what a client sends (float32), and a clear refusal where it cannot apply."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gradleak.attacks.exact import ExactAttack, ExactConfig
from gradleak.capture.reader import CaptureFile
from gradleak.errors import ConfigError
from gradleak.inversion.frame_solve import FrameSolve
from gradleak.metrics.images import psnr, to_unit_tensor


@pytest.mark.slow
def test_frames_and_actions_from_one_gradient_each(float32_capture: Path) -> None:
    """PPO and A2C captures: every action exact, and every frame closer to the truth than the
    frames' own mean image is, by 5 dB on average (no attacker training, no private input;
    measured when written: 30.0-31.3 dB against 22.6-25.0 for the mean image)."""
    with CaptureFile(float32_capture) as capture:
        observation, target = capture.observation(), capture.target()
    result = ExactAttack(observation, ExactConfig(chunk=5)).reconstruct()
    np.testing.assert_array_equal(result.actions, target.actions)
    truth, frames = to_unit_tensor(target.images), to_unit_tensor(result.images)
    mean = truth.mean(0, keepdim=True).expand_as(truth)
    gain = psnr(frames, truth) - psnr(mean, truth)
    assert bool((gain > 0).all()) and float(gain.mean()) >= 5.0
    assert result.images.dtype == np.uint8 and result.images.shape == target.images.shape


@pytest.mark.slow
def test_chunks_change_nothing(float32_capture: Path) -> None:
    """Each step from its own gradient alone: solving them 3 or 12 at a time gives the same
    frames."""
    with CaptureFile(float32_capture) as capture:
        observation = capture.observation()
    alone = {"same_frame_tolerance": 0.0}
    small = ExactAttack(observation, ExactConfig(chunk=3, **alone)).reconstruct().images
    whole = ExactAttack(observation, ExactConfig(chunk=12, **alone)).reconstruct().images
    assert np.abs(small.astype(int) - whole.astype(int)).max() <= 1


def standing_still():  # noqa: ANN201
    """Six steps of an agent that saw frame A twice, B three times, then A again, each step
    with its own action and advantage: the observation and the frames."""
    import torch
    from helpers import observe, smooth_frame, victim_with_statistics

    first, second = smooth_frame(32, 1), smooth_frame(32, 2)
    images = torch.stack([first, first, second, second, second, first])
    observation, _ = observe(victim_with_statistics(), images, torch.tensor([0, 1, 2, 3, 4, 0]),
                             torch.tensor([1.2, -0.7, 0.5, -1.1, 0.9, 0.3]),
                             torch.tensor([0.4, -0.3, 0.2, 0.1, -0.2, 0.3]))
    return observation, images.numpy()


@pytest.mark.slow
def test_steps_that_saw_one_frame_are_solved_as_one() -> None:
    """An agent standing still sends several gradients of one frame, each with its own action
    and advantage: together they fix the frame that each leaves partly free (measured when
    written: mean error 0.53-0.98 grey levels a pixel alone, 0 together), and a frame seen
    once, even one seen before in the episode, is solved alone."""
    observation, images = standing_still()

    def errors(tolerance: float) -> np.ndarray:
        frames = ExactAttack(observation, ExactConfig(same_frame_tolerance=tolerance)
                             ).reconstruct().images
        return np.abs(frames.astype(float) - images).mean(axis=(1, 2, 3))

    alone, together = errors(0.0), errors(ExactConfig().same_frame_tolerance)
    assert float(alone[:5].min()) > 0.3 and float(together[:5].max()) <= 0.05
    assert together[5] == alone[5]


@pytest.mark.slow
def test_a_run_of_one_frame_across_chunks_is_solved_whole() -> None:
    """A chunk's last run of one frame waits for the next chunk, so chunks of 2 or 4 steps
    (which cut both runs) give the frames of one chunk of 6."""
    observation, _ = standing_still()
    whole = ExactAttack(observation, ExactConfig(chunk=6)).reconstruct().images
    for chunk in (2, 4):
        cut = ExactAttack(observation, ExactConfig(chunk=chunk)).reconstruct().images
        assert np.abs(cut.astype(int) - whole.astype(int)).max() <= 1, chunk


def test_a_victim_the_recursion_cannot_descend_is_refused() -> None:
    from helpers import mlp_observation

    observation, _ = mlp_observation()
    with pytest.raises(ConfigError, match="needs conv layers"):
        ExactAttack(observation)


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="iterations 0"):
        ExactConfig(solve=FrameSolve(iterations=0)).check()
    with pytest.raises(ConfigError, match="non-negative"):
        ExactConfig(solve=FrameSolve(smoothness=-1.0)).check()
    with pytest.raises(ConfigError, match="must be positive"):
        ExactConfig(gradient_tolerance=0.0).check()
    with pytest.raises(ConfigError, match="same_frame_tolerance -1"):
        ExactConfig(same_frame_tolerance=-1.0).check()
    assert ExactConfig(noise_aware=False).noise_model() is None
