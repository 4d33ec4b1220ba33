"""Generalised advantage estimation and the per-episode normalisation of the capture protocol."""

from __future__ import annotations

import numpy as np


def gae(rewards: np.ndarray, values: np.ndarray, next_values: np.ndarray,
        continues: np.ndarray, gamma: float = 0.99, lam: float = 0.95) -> np.ndarray:
    """Advantages along axis 0 (time); any trailing axes are independent environments.

    next_values[t] is V(s_{t+1}) as the agent saw it (0 after a true terminal, V of the final
    observation after a cut episode: that is the bootstrap); continues[t] is 1 when step t+1
    belongs to the same episode. δ_t = r_t + γ V(s_{t+1}) − V(s_t),
    A_t = δ_t + γλ · continues_t · A_{t+1}.
    """
    rewards, values = np.asarray(rewards, np.float64), np.asarray(values, np.float64)
    deltas = rewards + gamma * np.asarray(next_values, np.float64) - values
    advantages = np.zeros_like(deltas)
    running = np.zeros_like(deltas[0]) if deltas.ndim > 1 else 0.0
    for t in range(len(deltas) - 1, -1, -1):
        running = deltas[t] + gamma * lam * np.asarray(continues[t], np.float64) * running
        advantages[t] = running
    return advantages


def episode_advantages(rewards: np.ndarray, values: np.ndarray, bootstrap_value: float,
                       gamma: float = 0.99, lam: float = 0.95) -> np.ndarray:
    """GAE over one whole episode; `bootstrap_value` is 0 after success, V(s_T) when cut."""
    n = len(rewards)
    next_values = np.append(np.asarray(values[1:], np.float64), bootstrap_value)
    continues = np.ones(n)
    return gae(rewards, values, next_values, continues, gamma, lam)


def normalise(advantages: np.ndarray) -> np.ndarray:
    """(A − mean) / (std + 1e-8), population std: a one-step episode gets A = 0, not NaN."""
    advantages = np.asarray(advantages, np.float64)
    return (advantages - advantages.mean()) / (advantages.std() + 1e-8)


def normalise_minibatches(advantages: np.ndarray, size: int) -> np.ndarray:
    """SB3's per-minibatch normalisation on consecutive runs of `size` steps: (A − mean) /
    (sample std + 1e-8); a run of one step is left as it is, as SB3 leaves a minibatch of one."""
    advantages = np.asarray(advantages, np.float64)
    out = advantages.copy()
    for start in range(0, len(advantages), size):
        part = advantages[start:start + size]
        if len(part) > 1:
            out[start:start + size] = (part - part.mean()) / (part.std(ddof=1) + 1e-8)
    return out
