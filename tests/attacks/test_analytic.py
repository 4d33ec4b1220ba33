"""Closed-form recovery: layer inputs, π, V, the action, A and R, exactly."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import observe

from gradleak.attacks.analytic import recover_analytically
from gradleak.capture.grads import StepBatch
from gradleak.capture.reader import CaptureFile
from gradleak.errors import ConfigError
from gradleak.evaluation.analytic import score
from gradleak.rl.losses import LossCoefficients
from gradleak.threat import Observation
from gradleak.victims import create_victim


def test_exact_on_float32_captures(float32_capture: Path) -> None:
    with CaptureFile(float32_capture) as capture:
        result = score(capture.observation(), capture.target())
    assert result["action_accuracy"] == 1.0
    assert result["layer_inputs"]["fc"]["max_relative_error"] <= 1e-5
    assert result["layer_inputs"]["policy_head"]["max_relative_error"] <= 1e-5
    assert result["probs_max_abs_error"] <= 1e-5 and result["values_max_abs_error"] <= 1e-5
    assert result["advantage_max_abs_error"] <= 1e-4 and result["returns_max_abs_error"] <= 1e-4


def test_within_float16_rounding_on_float16_captures(float16_capture: Path) -> None:
    with CaptureFile(float16_capture) as capture:
        result = score(capture.observation(), capture.target())
    assert result["action_accuracy"] == 1.0
    assert result["layer_inputs"]["fc"]["median_relative_error"] <= 1e-3


def synthetic(entropy: float, peak: float, seed: int = 0) -> tuple[Observation, StepBatch]:
    """Per-step gradients of a random cnn-small whose action 2 gets `peak` extra logit; every
    action is taken in turn, so confident policies are seen taking and not taking their mode."""
    torch.manual_seed(seed)
    victim = create_victim("cnn-small", frame_size=32).eval()
    with torch.no_grad():
        victim.policy_head.bias[2] += peak
    generator = torch.Generator().manual_seed(seed)
    n = 40
    images = torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=generator)
    return observe(victim, images, torch.arange(n) % 5, torch.randn(n, generator=generator),
                   torch.randn(n, generator=generator), LossCoefficients(entropy=entropy))


@pytest.mark.parametrize("entropy", [0.0, 0.01, 0.05])
@pytest.mark.parametrize("peak", [0.0, 7.0])
def test_action_and_advantage_for_any_entropy_coefficient(entropy: float, peak: float) -> None:
    observation, batch = synthetic(entropy, peak)
    result = recover_analytically(observation)
    np.testing.assert_array_equal(result.actions, batch.actions.numpy())
    np.testing.assert_allclose(result.extras["advantages"], batch.advantages.numpy(),
                               rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(result.extras["returns"], batch.returns.numpy(), atol=1e-4)
    if peak > 0:  # the policies really are peaked: the test covers confident π
        assert np.median(result.extras["probs"].max(1)) > 0.99


def test_unsupported_observations_are_named() -> None:
    observation, _ = synthetic(0.01, 0.0)
    no_heads = tuple(layer for layer in observation.layers if layer.component != "heads")
    width = sum(layer.size for layer in no_heads)
    with pytest.raises(ConfigError, match="needs Linear heads with a bias"):
        recover_analytically(replace(observation, layers=no_heads,
                                     gradients=observation.gradients[:, :width]))
    with pytest.raises(ConfigError, match="loss coefficients"):
        recover_analytically(replace(observation, hyperparameters={}))
    with pytest.raises(ConfigError, match="needs θ0's policy_head"):
        recover_analytically(replace(observation, theta0={}))


def test_feature_inversion_through_a_linear_first_layer_is_exact() -> None:
    from helpers import mlp_observation

    from gradleak.attacks.analytic import invert_features
    from gradleak.metrics.images import psnr, to_unit_tensor

    observation, images = mlp_observation(frames=2)
    features = recover_analytically(observation).extras["layer_inputs"]["fc"]
    recovered = invert_features(observation, features, "fc", iterations=300, lr=0.02,
                                tv=0.0)
    assert float(psnr(to_unit_tensor(recovered), to_unit_tensor(images.numpy())).min()) > 35


def test_scoring_in_chunks_equals_scoring_all_rows_at_once(random_capture) -> None:
    from gradleak.evaluation.analytic import evaluate_analytic

    whole = evaluate_analytic([random_capture], chunk=10_000)[str(random_capture)]
    pieces = evaluate_analytic([random_capture], chunk=7)[str(random_capture)]  # 8 chunks
    layers, whole_layers = pieces.pop("layer_inputs"), whole.pop("layer_inputs")
    # actions, π, V, A, R: row by row, equal up to the last bits of float64 matrix products
    # (whose blocking, and so whose order of sums, may follow the batch size)
    assert pieces == pytest.approx(whole, rel=1e-9, abs=1e-15)
    assert list(layers) == list(whole_layers)
    for name, scores in layers.items():
        # the truth's forward passes run in other batch sizes: float32 sums in another order,
        # which moves errors of float32's own size (~6e-8 on float32 captures) by up to 1e-8
        assert scores == pytest.approx(whole_layers[name], rel=1e-3, abs=2e-7)
