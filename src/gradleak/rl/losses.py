"""The actor-critic loss, written once.

The trainer, the capture and the gradient-matching attacks all import `actor_critic_loss`, so
"the attacker's dummy loss is exactly the victim's" holds by construction.

Per step (paper Eq. 3):  L_t = -A_t log π(a_t|s_t) + c_v (V(s_t) - R_t)² - c_e H(π(·|s_t)).
PPO replaces the first term by -min(ρ A, clip(ρ, 1-ε, 1+ε) A) with ρ = π/π_old; at θ0 the ratio
is one and the clip inactive, so PPO and A2C give the same gradient (Proposition 4.1).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gradleak.errors import ConfigError


@dataclass(frozen=True)
class LossCoefficients:
    value: float = 0.5  # c_v, on (V - R)² (F.mse_loss of one step)
    entropy: float = 0.01  # c_e
    clip: float = 0.2  # PPO's ε; unused by A2C

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# The keys of `--loss`: the coefficients, and the discounting behind the advantages.
LOSS_KEYS = ("value", "entropy", "clip", "gamma", "lam")
# How a client normalises its advantages before the loss. "episode": (A − mean) / std over the
# episode (the TRACE protocol); "none": raw GAE; "minibatch:M": over each optimiser minibatch of
# M steps (SB3's PPO, sample std); "rollout": over the whole rollout (SB3's A2C with
# normalize_advantage). A capture replays minibatches as consecutive runs of M steps of each
# episode: SB3 draws them from a shuffled buffer, which no single-step capture replays.
ADVANTAGE_NORMS = ("episode", "none", "minibatch:M", "rollout")


def parse_advantage_norm(text: str) -> tuple[str, int]:
    """'episode' | 'none' | 'rollout' | 'minibatch:M' → (kind, M; 0 unless a minibatch)."""
    kind, _, size = str(text).partition(":")
    if kind in ("episode", "none", "rollout") and not size:
        return kind, 0
    if kind == "minibatch" and size.isdigit() and int(size) >= 1:
        return kind, int(size)
    raise ConfigError(f"advantage normalisation {text!r}: expected one of "
                      f"{', '.join(ADVANTAGE_NORMS)} (M a positive integer)")


def advantage_text(text: str) -> str:
    """How the file's `loss` attribute describes the normalisation."""
    kind, size = parse_advantage_norm(text)
    return {"episode": "per-episode, population std", "none": "none (raw GAE)",
            "rollout": "per rollout, sample std",
            "minibatch": f"per minibatch of {size} consecutive steps, sample std"}[kind]


def parse_loss(text: str) -> dict[str, float]:
    """`value=0.25,entropy=0.02,clip=0.1[,gamma=0.99,lam=0.95]`: each key once, finite."""
    values: dict[str, float] = {}
    for item in [part.strip() for part in text.split(",") if part.strip()]:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in LOSS_KEYS:
            raise ConfigError(f"--loss {text!r}: {item!r} is not KEY=VALUE with KEY one of "
                              f"{', '.join(LOSS_KEYS)}")
        if key in values:
            raise ConfigError(f"--loss {text!r}: {key!r} is given twice")
        try:
            values[key] = float(value)
        except ValueError:
            raise ConfigError(f"--loss {text!r}: {key}={value.strip()!r} is not a number") from None
        if not math.isfinite(values[key]) or values[key] < 0:
            raise ConfigError(f"--loss {text!r}: {key}={value.strip()} must be finite and >= 0")
    if not values:
        raise ConfigError("--loss '': expected value=...,entropy=...,clip=...")
    return values


def log_probs_and_entropy(logits: torch.Tensor, actions: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`actions` is (B,) indices, or (B, K) action distributions: a one-hot row gives exactly
    the index's log-probability (DLG optimises such a soft action)."""
    log_pi = F.log_softmax(logits, dim=-1)
    if actions.is_floating_point() and actions.dim() == log_pi.dim():
        taken = (actions * log_pi).sum(-1)
    else:
        # gather, not indexing: vmap cannot trace data-dependent indexing like log_pi[a]
        taken = log_pi.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(log_pi.exp() * log_pi).sum(-1)
    return taken, entropy


def actor_critic_loss(logits: torch.Tensor, values: torch.Tensor, actions: torch.Tensor,
                      advantages: torch.Tensor, returns: torch.Tensor,
                      coefficients: LossCoefficients,
                      old_log_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample loss, shape (B,). `old_log_probs=None` is A2C; given, it is PPO's clip."""
    log_prob, entropy = log_probs_and_entropy(logits, actions)
    if old_log_probs is None:
        policy = -advantages * log_prob
    else:
        ratio = torch.exp(log_prob - old_log_probs)
        clipped = torch.clamp(ratio, 1.0 - coefficients.clip, 1.0 + coefficients.clip)
        policy = -torch.minimum(ratio * advantages, clipped * advantages)
    value = coefficients.value * (values - returns) ** 2
    return policy + value - coefficients.entropy * entropy
