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


def column_sums(observation: Observation) -> np.ndarray:
    """σ: (N, K) sums over the feature axis of the policy head's weight gradient."""
    weight = policy_weight(observation.roles)
    try:
        block = observation.block(weight)  # (N, K, d_h)
    except KeyError:
        raise ConfigError(f"the capture holds no policy-head gradient ({weight}); capture "
                          "with --components including 'heads'") from None
    return block.astype(np.float64).sum(axis=2)


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
    sigma = column_sums(observation)
    actions = RULES.get(rule)(sigma)
    return Reconstruction(actions=actions.astype(np.int64), extras={"sigma": sigma})
