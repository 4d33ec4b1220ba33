"""Closed-form action recovery from the policy-head gradient (paper Theorem 4.2, and better).

With logits ℓ = W_a h(s), h ≥ 0, and c_e = 0, the k-th row sum of the observed ∇W_a is
σ_k = A ‖h‖₁ (π_k − 1[k = a]) (PyTorch stores W_a as [K, d_h], so the paper's column sums are
row sums here). For k ≠ a, σ_k has the sign of A; for k = a, the opposite sign.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gradleak.errors import ConfigError
from gradleak.registry import Registry
from gradleak.threat import Observation, Reconstruction
from gradleak.victims.roles import Roles

Rule = Callable[[np.ndarray], np.ndarray]  # σ (N, K) → actions (N,): what the server sees only
RULES: Registry[Rule] = Registry("action rule")


def policy_weight(roles: Roles) -> str:
    """The parameter the action rules read: the policy head's weight."""
    return f"{roles.policy_head}.weight"


def head_gradient(observation: Observation) -> np.ndarray:
    """(N, K, d_h) the policy head's weight gradient, float64."""
    weight = policy_weight(observation.roles)
    try:
        return observation.block(weight).astype(np.float64)
    except KeyError:
        raise ConfigError(f"the capture holds no policy-head gradient ({weight}); capture "
                          "with --components including 'heads'") from None


def column_sums(observation: Observation) -> np.ndarray:
    """σ: (N, K) sums over the feature axis of the policy head's weight gradient."""
    return head_gradient(observation).sum(axis=2)


# |Σ_j h_j| / ‖h‖₂ below which the row sums are taken as rounding (≥ 1 for features ≥ 0)
BALANCED_FEATURES = 0.1


def action_scores(observation: Observation) -> np.ndarray:
    """(N, K) what the rules read: σ, except on steps whose features sum to nearly nothing.

    The head's weight gradient is rank one, row k = δ_k hᵀ (δ the loss's gradient in the
    logits, whatever the loss), so σ_k = δ_k Σ_j h_j: proportional to δ only while Σ_j h_j is
    not lost in rounding. ReLU features (h ≥ 0) keep it at least ‖h‖₂; LayerNorm's zero-mean
    features (a ViT's) make it ~0, and σ is then rounding noise (13 of 16 actions on a
    random-init ViT). There the rows are projected on the strongest row instead, oriented
    like its sum: δ_k ‖h‖₂ times a sign common to the step, the same ratios as σ's."""
    block = head_gradient(observation)
    sigma = block.sum(axis=2)
    if not len(block):
        return sigma
    steps = np.arange(len(block))
    norms = np.linalg.norm(block, axis=2)
    strongest = norms.argmax(axis=1)
    lead, lead_norm = block[steps, strongest], np.maximum(norms[steps, strongest], 1e-300)
    lead_sum = sigma[steps, strongest]
    balance = np.abs(lead_sum) / lead_norm
    oriented = lead * np.where(lead_sum < 0, -1.0, 1.0)[:, None] / lead_norm[:, None]
    projected = np.einsum("nkd,nd->nk", block, oriented)
    return np.where((balance < BALANCED_FEATURES)[:, None], projected, sigma)


@RULES.register("sign-agnostic")
def sign_agnostic(sigma: np.ndarray) -> np.ndarray:
    """argmax_k |σ_k − mean σ|: exact for K ≥ 3 when c_e = 0.

    Σ_k σ_k = 0, so this compares |σ_a| ∝ 1 − π_a with |σ_k| ∝ π_k: the margin vanishes when
    the policy is confident in an action other than the one taken.
    """
    return np.abs(sigma - sigma.mean(axis=1, keepdims=True)).argmax(axis=1)


@RULES.register("odd-sign")
def odd_sign(sigma: np.ndarray) -> np.ndarray:
    """The one σ_k whose sign differs from all the others.

    It needs no knowledge of A and, for K ≥ 3 and c_e = 0, is exact however peaked π is, as
    long as the σ_k are not rounded to zero; unlike magnitudes, signs survive per-entry relative
    errors such as float16 storage. Rows where no single entry stands apart (A = 0, entropy
    terms flipping signs) fall back to the sign-agnostic rule.
    """
    signs = np.sign(sigma)
    positive, negative = (signs > 0).sum(axis=1), (signs < 0).sum(axis=1)
    minority = np.where(positive < negative, 1.0, -1.0)[:, None]
    unique = (np.minimum(positive, negative) == 1) & (np.maximum(positive, negative) >= 2)
    recovered = sign_agnostic(sigma)
    recovered[unique] = (signs == minority)[unique].argmax(axis=1)
    return recovered


def recover_actions(observation: Observation, rule: str) -> Reconstruction:
    """The rule's actions from the observation alone (the paper's sign-aware rule, which needs
    the true sign of A, is an evaluation oracle: gradleak.evaluation.oracles)."""
    sigma = action_scores(observation)
    actions = RULES.get(rule)(sigma)
    return Reconstruction(actions=actions.astype(np.int64), extras={"sigma": sigma})
