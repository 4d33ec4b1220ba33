"""Closed-form action recovery: exact where Theorem 4.2 says so, and the odd-sign improvement."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

import gradleak.attacks
from gradleak.attacks.action_rules import RULES, action_scores, column_sums, recover_actions
from gradleak.capture.grads import StepBatch, per_step_gradients
from gradleak.errors import ConfigError
from gradleak.evaluation.oracles import oracle_actions
from gradleak.rl.losses import LossCoefficients
from gradleak.threat import Observation, Target
from gradleak.victims import create_victim, layer_table


def observed(num_actions: int, peaked: bool, advantage_sign: float, entropy: float = 0.0,
             n: int = 60, seed: int = 0) -> tuple[Observation, np.ndarray, np.ndarray]:
    """Per-step gradients of a victim whose policy is uniform or peaked on action 0."""
    torch.manual_seed(seed)
    victim = create_victim("cnn-small", frame_size=32, num_actions=num_actions).eval()
    with torch.no_grad():
        victim.policy_head.weight.zero_()
        victim.policy_head.bias.zero_()
        if peaked:
            victim.policy_head.bias[0] = 8.0  # π(0) ≈ 0.998 for K = 5
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g)
    actions = torch.arange(n) % num_actions  # every action, the unlikely ones included
    advantages = advantage_sign * (0.2 + torch.rand(n, generator=g))
    with torch.no_grad():
        logits, _ = victim(images)
    log_probs = torch.log_softmax(logits, -1)
    batch = StepBatch(images, actions, advantages, torch.randn(n, generator=g),
                      log_probs.gather(-1, actions[:, None])[:, 0])
    layers = layer_table(victim, ("heads",))
    gradients = per_step_gradients(victim, batch, LossCoefficients(entropy=entropy), layers)
    observation = Observation(gradients=gradients.numpy(), layers=tuple(layers),
                              victim=victim.config, hyperparameters={},
                              episode_ids=np.zeros(n, np.int64), step_in_episode=np.arange(n))
    return observation, actions.numpy(), log_probs.exp().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("num_actions", [5, 10])
@pytest.mark.parametrize("peaked", [False, True])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_exact_recovery_without_entropy(num_actions: int, peaked: bool, sign: float) -> None:
    observation, actions, probs = observed(num_actions, peaked, sign)
    assert (probs.max(axis=1) > 0.99).all() == peaked
    assert np.array_equal(recover_actions(observation, "odd-sign").actions, actions)
    truth = Target(images=None, actions=actions, advantages=np.full(len(actions), sign),
                   returns=np.zeros(len(actions)), values=np.zeros(len(actions)), probs=probs,
                   rewards=np.zeros(len(actions)))
    assert np.array_equal(oracle_actions(observation, "sign-aware", truth).actions, actions)


def test_odd_sign_survives_relative_errors_that_break_sign_agnostic() -> None:
    """Both rules are exact on exact σ; their margins differ.

    Sign-agnostic compares |σ_a| = |A|‖h‖(1 − π_a) with |σ_k| = |A|‖h‖π_k: when the policy is
    confident in another action k, the two are almost equal. Odd-sign only reads signs, which
    per-entry relative errors (float16 storage, quantisation) do not change.
    """
    observation, actions, _ = observed(5, peaked=True, advantage_sign=1.0)
    sigma = column_sums(observation)
    noisy = sigma * (1 + 0.01 * np.random.default_rng(0).standard_normal(sigma.shape))
    assert np.array_equal(RULES.get("sign-agnostic")(sigma), actions)
    assert np.array_equal(RULES.get("odd-sign")(noisy), actions)
    assert (RULES.get("sign-agnostic")(noisy) != actions).mean() > 0.2


def test_column_sums_follow_theorem_4_2() -> None:
    observation, actions, probs = observed(5, peaked=False, advantage_sign=1.0, n=5)
    sigma = column_sums(observation)
    onehot = np.eye(5)[actions]
    ratio = sigma / (probs - onehot)  # = A ‖h‖₁, the same for every k of a step
    assert np.allclose(ratio, ratio[:, :1], rtol=1e-4)


def test_zero_mean_features_are_read_by_their_direction_not_their_sum() -> None:
    """Rows δ_k hᵀ with Σ_j h_j = 0 (LayerNorm'd features, as a ViT's head reads): the column
    sums are rounding noise, the projection on the strongest row still gives δ's ratios and
    every action; with ReLU features (h ≥ 0) the scores are the sums themselves."""
    observation, actions, probs = observed(5, peaked=False, advantage_sign=1.0, n=20,
                                           entropy=0.01)
    assert np.array_equal(action_scores(observation), column_sums(observation))
    layer = next(layer for layer in observation.layers if layer.name == "policy_head.weight")
    columns = slice(layer.offset, layer.offset + layer.size)
    block = observation.gradients[:, columns].reshape(20, 5, -1).astype(np.float64)
    centred = (block - block.mean(axis=2, keepdims=True)).astype(np.float32)
    gradients = observation.gradients.copy()
    gradients[:, columns] = centred.reshape(20, -1)
    balanced = dataclasses.replace(observation, gradients=gradients)
    reference = column_sums(observation)  # δ_k Σ_j h_j of the uncentred features
    assert np.abs(column_sums(balanced)).max() < 1e-4 * np.abs(reference).min()
    scores = action_scores(balanced)
    ratio = scores / reference
    assert np.allclose(ratio, ratio[:, :1], rtol=1e-3)  # the same δ, up to a per-step factor
    assert (recover_actions(balanced, "odd-sign").actions == actions).all()


def test_entropy_bonus_costs_little_accuracy() -> None:
    observation, actions, _ = observed(5, peaked=False, advantage_sign=1.0, entropy=0.01)
    assert (recover_actions(observation, "odd-sign").actions == actions).mean() >= 0.95


def test_rules_refuse_what_they_cannot_do() -> None:
    observation, _, _ = observed(5, peaked=False, advantage_sign=1.0, n=3)
    with pytest.raises(ConfigError, match="unknown action rule 'sign-aware'"):
        recover_actions(observation, "sign-aware")  # an oracle: attacks take no ground truth
    with pytest.raises(ConfigError, match="unknown action rule 'best'"):
        recover_actions(observation, "best")
    headless = Observation(gradients=observation.gradients[:, :0], layers=(),
                           victim=observation.victim, hyperparameters={},
                           episode_ids=observation.episode_ids,
                           step_in_episode=observation.step_in_episode)
    with pytest.raises(ConfigError, match="no policy-head gradient"):
        recover_actions(headless, "odd-sign")


def test_attacks_never_import_the_private_data_path() -> None:
    """The threat model's boundary: attack code sees Observations, never capture targets."""
    for path in Path(gradleak.attacks.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(("gradleak.capture", "gradleak.evaluation")), (
                    f"{path.name} imports {name}")


def test_no_attack_function_accepts_ground_truth() -> None:
    """Oracle rules live in gradleak.evaluation: nothing under attacks takes a Target, or the
    true sign of the advantages."""
    for path in Path(gradleak.attacks.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:
                    annotation = ast.unparse(arg.annotation) if arg.annotation else ""
                    assert "Target" not in annotation and arg.arg not in (
                        "advantage_sign", "target", "truth"), f"{path.name}:{node.name}({arg.arg})"
