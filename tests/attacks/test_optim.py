"""DLG and IG: the dummy loss is the victim's, the optimiser works, batching changes nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import mlp_observation

from gradleak.attacks.optim.config import baseline_config
from gradleak.attacks.optim.lbfgs import BatchedLBFGS
from gradleak.attacks.optim.solve import GradientMatchingAttack, pick_restarts
from gradleak.capture.reader import CaptureFile
from gradleak.errors import ConfigError
from gradleak.metrics.images import psnr
from gradleak.rl.losses import LossCoefficients
from gradleak.victims import create_victim


def dummy_gradient_at_truth(path: Path, loss: str = "victim") -> tuple[np.ndarray, np.ndarray]:
    """(N, d) dummy gradients at the true unknowns, and the captured ones."""
    with CaptureFile(path) as capture:
        observation, target = capture.observation(), capture.target()
    config = baseline_config("ig")
    config.matching.loss = loss
    attack = GradientMatchingAttack(observation, config)
    rows = []
    for i in range(len(observation)):
        image = torch.from_numpy(target.images[i]).float() / 255.0
        grads = attack.dummy(image, torch.tensor(target.actions[i]),
                             torch.tensor(target.advantages[i]), torch.tensor(target.returns[i]))
        rows.append(torch.cat([g.reshape(-1) for g in grads]).numpy())
    return np.stack(rows), observation.gradients


def test_dummy_gradient_with_the_true_unknowns_equals_the_captured_one(float32_capture: Path
                                                                        ) -> None:
    dummy, captured = dummy_gradient_at_truth(float32_capture)
    error = np.linalg.norm(dummy - captured, axis=1) / np.linalg.norm(captured, axis=1)
    assert error.max() <= 1e-5


def test_the_public_codes_probe_loss_does_not_reproduce_the_gradient(float32_capture: Path
                                                                       ) -> None:
    dummy, captured = dummy_gradient_at_truth(float32_capture, loss="probe")
    error = np.linalg.norm(dummy - captured, axis=1) / np.linalg.norm(captured, axis=1)
    assert error.min() > 0.1


def test_a_one_hot_soft_action_gives_the_hard_actions_gradient() -> None:
    torch.manual_seed(0)
    victim = create_victim("cnn-small", frame_size=32).eval()
    logits, values = victim(torch.randint(0, 256, (4, 32, 32, 3), dtype=torch.uint8))
    actions = torch.tensor([0, 3, 1, 4])
    from gradleak.rl.losses import actor_critic_loss

    args = (torch.randn(4), torch.randn(4), LossCoefficients())
    hard = actor_critic_loss(logits, values, actions, *args)
    soft = actor_critic_loss(logits, values, torch.eye(5)[actions], *args)
    torch.testing.assert_close(soft, hard, rtol=0, atol=1e-7)


# -- the batched L-BFGS -------------------------------------------------------------------------
def rosenbrock_like(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(B, n) → (B,): non-convex, different curvature per problem."""
    return (scale[:, None] * (x[:, 1:] - x[:, :-1] ** 2) ** 2 + (1 - x[:, :-1]) ** 2).sum(1)


@pytest.mark.parametrize("history", [3, 100])
def test_batched_lbfgs_follows_torch_lbfgs_problem_by_problem(history: int) -> None:
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(4, 6, generator=generator, dtype=torch.float64) * 0.5
    scale = torch.tensor([1.0, 3.0, 10.0, 0.5], dtype=torch.float64)
    iterations = 40
    x = start.clone()
    optimiser = BatchedLBFGS(4, 6, lr=0.1, history=history, dtype=torch.float64)
    for _ in range(iterations):
        x.requires_grad_(True)
        loss = rosenbrock_like(x, scale)
        (gradient,) = torch.autograd.grad(loss.sum(), x)
        x = optimiser.step(x.detach(), loss.detach(), gradient)
    for b in range(4):
        single = start[b:b + 1].clone().requires_grad_(True)
        # max_eval: by default torch stops after int(1.25 × max_iter) closure calls, which for
        # a small max_iter ends the run an iteration early
        reference = torch.optim.LBFGS([single], lr=0.1, max_iter=iterations,
                                      max_eval=2 * iterations, history_size=history)

        def closure(optimiser: torch.optim.LBFGS = reference, x: torch.Tensor = single,
                    problem: int = b) -> torch.Tensor:
            optimiser.zero_grad()
            value = rosenbrock_like(x, scale[problem:problem + 1]).sum()
            value.backward()
            return value

        reference.step(closure)
        torch.testing.assert_close(x[b], single.detach()[0], rtol=1e-9, atol=1e-10)


# -- the optimiser on a victim whose first layer is fully connected ------------------------------
@pytest.mark.slow
def test_inverting_gradients_recovers_the_frame_through_a_linear_first_layer() -> None:
    observation, images = mlp_observation()
    config = baseline_config("ig", iterations=600)
    config.matching.tv = 1e-4
    result = GradientMatchingAttack(observation, config).reconstruct()
    truth = images.permute(0, 3, 1, 2).float() / 255
    recovered = torch.from_numpy(result.images).permute(0, 3, 1, 2).float() / 255
    assert psnr(recovered, truth).min() >= 30.0
    np.testing.assert_array_equal(result.actions, [0, 1])


def test_batched_and_one_at_a_time_give_the_same_result() -> None:
    observation, _ = mlp_observation(frames=4)
    for name in ("ig", "dlg"):
        batched = GradientMatchingAttack(observation, baseline_config(name, iterations=15,
                                                                      batch=4)).reconstruct()
        single = GradientMatchingAttack(observation, baseline_config(name, iterations=15,
                                                                     batch=1)).reconstruct()
        assert np.abs(batched.images.astype(int) - single.images.astype(int)).max() <= 1
        np.testing.assert_allclose(batched.extras["matching_loss"],
                                   single.extras["matching_loss"], rtol=1e-3, atol=1e-6)
        np.testing.assert_array_equal(batched.actions, single.actions)


def test_restarts_are_picked_by_the_matching_loss_alone(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    observation, _ = mlp_observation(frames=2)
    seen: list[np.ndarray] = []
    solve = GradientMatchingAttack.solve

    def recording(self: GradientMatchingAttack, problems):  # type: ignore[no-untyped-def]
        solved = solve(self, problems)
        seen.append(solved["loss"].reshape(-1, self.config.restarts))
        return solved

    monkeypatch.setattr(GradientMatchingAttack, "solve", recording)
    result = GradientMatchingAttack(observation, baseline_config("ig", iterations=10,
                                                                 restarts=3)).reconstruct()
    losses = np.concatenate(seen)
    np.testing.assert_array_equal(result.extras["restart"], losses.argmin(1))
    np.testing.assert_allclose(result.extras["matching_loss"], losses.min(1))
    assert len(set(losses[0])) == 3  # the restarts really started apart
    np.testing.assert_array_equal(pick_restarts(np.array([[np.nan, 2.0, 1.0]])), [2])


def test_bad_settings_name_the_field() -> None:
    observation, _ = mlp_observation(frames=2)
    with pytest.raises(ConfigError, match="optimiser 'sgd'"):
        GradientMatchingAttack(observation, baseline_config("ig", optimiser="sgd"))
    config = baseline_config("ig")
    config.matching.components = ["cnn"]
    with pytest.raises(ConfigError, match="hold only fc, heads"):
        GradientMatchingAttack(observation, config)
    with pytest.raises(ConfigError, match="needs θ0"):
        from dataclasses import replace

        GradientMatchingAttack(replace(observation, theta0={}), baseline_config("dlg"))
    with pytest.raises(ConfigError, match="unknown optimisation baseline"):
        baseline_config("fgsm")
