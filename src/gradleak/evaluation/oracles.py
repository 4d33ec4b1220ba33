"""Rules that are given ground truth the attacker does not observe: scoring references only.

The paper's action rule (its eq. 10) reads argmin σ if A > 0 and argmax σ if A < 0, so it needs
sign(A) of every step, which the server never sees. It is kept as the paper states it, beside
the rules that need nothing (gradleak.attacks.action_rules), and every report marks it as an
oracle. Nothing under gradleak.attacks takes ground truth.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gradleak.attacks.action_rules import column_sums
from gradleak.registry import Registry
from gradleak.threat import Observation, Reconstruction, Target

Oracle = Callable[[np.ndarray, Target], np.ndarray]  # σ (N, K), the truth → actions (N,)
ORACLE_RULES: Registry[Oracle] = Registry("oracle action rule")


@ORACLE_RULES.register("sign-aware")
def sign_aware(sigma: np.ndarray, target: Target) -> np.ndarray:
    """The paper's rule (10) with the true sign of each advantage."""
    return np.where(np.asarray(target.advantages) >= 0, sigma.argmin(axis=1),
                    sigma.argmax(axis=1))


def oracle_actions(observation: Observation, rule: str, target: Target) -> Reconstruction:
    sigma = column_sums(observation)
    return Reconstruction(actions=ORACLE_RULES.get(rule)(sigma, target).astype(np.int64),
                          extras={"sigma": sigma})
