"""The shared loss, GAE and the capture protocol's advantage normalisation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradleak.capture.grads import StepBatch, per_step_gradients
from gradleak.rl.advantages import episode_advantages, gae, normalise
from gradleak.rl.losses import LossCoefficients, actor_critic_loss
from gradleak.victims import create_victim, layer_table


def test_loss_matches_the_formula_by_hand() -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0]])
    pi = torch.softmax(logits, -1)[0]
    coefficients = LossCoefficients(value=0.5, entropy=0.01)
    loss = actor_critic_loss(logits, torch.tensor([0.3]), torch.tensor([2]),
                             torch.tensor([1.5]), torch.tensor([1.0]), coefficients)
    entropy = -(pi * pi.log()).sum()
    expected = -1.5 * pi[2].log() + 0.5 * (0.3 - 1.0) ** 2 - 0.01 * entropy
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def batch_for(victim: torch.nn.Module, n: int = 12, seed: int = 0) -> StepBatch:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g)
    actions = torch.randint(0, 5, (n,), generator=g)
    with torch.no_grad():
        logits, _ = victim(images)
    log_probs = torch.log_softmax(logits, -1).gather(-1, actions[:, None])[:, 0]
    return StepBatch(images, actions, torch.randn(n, generator=g), torch.randn(n, generator=g),
                     log_probs)


def test_ppo_gradient_equals_a2c_gradient_at_theta0() -> None:
    torch.manual_seed(0)
    victim = create_victim("cnn-small", frame_size=32).eval()
    batch, layers = batch_for(victim), layer_table(victim)
    ppo = per_step_gradients(victim, batch, LossCoefficients(), layers, ppo=True)
    a2c = per_step_gradients(victim, batch, LossCoefficients(), layers, ppo=False)
    error = ((ppo - a2c).norm(dim=1) / a2c.norm(dim=1)).max()
    assert error <= 1e-5
    # Away from θ0 (ratio ≠ 1, clipped for some steps) the two rules differ: the test can fail.
    batch.old_log_probs = batch.old_log_probs + 0.5
    moved = per_step_gradients(victim, batch, LossCoefficients(), layers, ppo=True)
    assert ((moved - a2c).norm(dim=1) / a2c.norm(dim=1)).max() > 1e-2


def test_gae_by_hand() -> None:
    rewards, values = np.array([1.0, 0.0, 2.0]), np.array([0.5, 0.4, 0.3])
    gamma, lam = 0.9, 0.8
    d2 = 2.0 + 0.9 * 0.7 - 0.3  # bootstrap V(s_3) = 0.7
    d1 = 0.0 + 0.9 * 0.3 - 0.4
    d0 = 1.0 + 0.9 * 0.4 - 0.5
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    got = episode_advantages(rewards, values, 0.7, gamma, lam)
    assert got == pytest.approx([a0, a1, a2])


def test_gae_does_not_cross_episode_boundaries() -> None:
    rewards = np.array([[1.0], [5.0]])
    values = np.zeros((2, 1))
    got = gae(rewards, values, next_values=np.zeros((2, 1)), continues=np.array([[0.0], [1.0]]))
    assert got[0, 0] == pytest.approx(1.0)  # step 1's reward belongs to the next episode


def test_normalisation_is_per_episode_and_safe_for_one_step() -> None:
    a = normalise(np.array([1.0, 2.0, 3.0]))
    assert a.mean() == pytest.approx(0.0) and a.std() == pytest.approx(1.0, abs=1e-6)
    assert normalise(np.array([4.2])) == pytest.approx([0.0])
