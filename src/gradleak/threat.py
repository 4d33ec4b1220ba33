"""The threat model as types.

An attack receives an `Observation`: what an honest-but-curious server legitimately holds (the
ordered per-step gradients, θ0, the architecture, the learning rule and its hyperparameters,
and which client/episode and position each gradient came from). It returns a `Reconstruction`.
The private data lives in a `Target`, which only training on auxiliary data and scoring read.
Attack code imports this module, never the capture reader's target path.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gradleak.errors import ConfigError
from gradleak.victims.base import VICTIMS, LayerInfo, VictimConfig, create_victim
from gradleak.victims.roles import Roles


@dataclass(frozen=True)
class Observation:
    gradients: np.ndarray  # (N, d) float32, in the order the client sent them
    layers: tuple[LayerInfo, ...]  # layout of the d columns
    victim: VictimConfig
    hyperparameters: dict[str, Any]  # algorithm, loss coefficients, γ, λ, normalisation
    episode_ids: np.ndarray  # (N,): which episode (client upload) each gradient belongs to
    step_in_episode: np.ndarray  # (N,): its position in that episode
    theta0: dict[str, np.ndarray] = field(default_factory=dict)  # broadcast checkpoint
    # what each layer does (gradleak.victims.roles): from the capture; None → the registered
    # victim's own
    roles: Roles = None  # type: ignore[assignment]
    # the defenses the stream went through, as the server that set the policy knows them: each
    # transform's kind and parameters ({"name": "quant", "bits": 8}, ...), never its random
    # draws or seed; () for an undefended stream
    defense: tuple[dict[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.roles is None:
            if self.victim.name not in VICTIMS:
                raise ConfigError(f"observation of victim {self.victim.name!r}: pass its roles "
                                  "(it is not a registered victim to derive them from)")
            object.__setattr__(self, "roles", create_victim(self.victim).roles())

    def __len__(self) -> int:
        return len(self.gradients)

    def steps(self, rows: Any) -> Observation:
        """These steps only (an index or a bool mask), with their episode and position."""
        return replace(self, gradients=self.gradients[rows], episode_ids=self.episode_ids[rows],
                       step_in_episode=self.step_in_episode[rows])

    def block(self, layer_name: str) -> np.ndarray:
        """(N, *shape) gradient of one parameter tensor."""
        for layer in self.layers:
            if layer.name == layer_name:
                columns = self.gradients[:, layer.offset:layer.offset + layer.size]
                return columns.reshape((len(self),) + layer.shape)
        known = ", ".join(layer.name for layer in self.layers)
        raise KeyError(f"layer {layer_name!r} is not in this capture's gradients (it holds: "
                       f"{known})")


def declared(transforms: Any) -> tuple[dict[str, Any], ...]:
    """A chain's transforms as the threat model lets an attack see them: without the seed."""
    return tuple({key: value for key, value in t.items() if key != "seed"}
                 for t in transforms or ())


@dataclass(frozen=True)
class Target:
    """Private ground truth: auxiliary training targets and scoring only."""

    images: np.ndarray | None  # (N, H, W, 3) uint8
    actions: np.ndarray  # (N,)
    advantages: np.ndarray  # (N,) as used in the loss (normalised per episode)
    returns: np.ndarray
    values: np.ndarray
    probs: np.ndarray  # (N, K) π_θ0(·|s_t)
    rewards: np.ndarray
    goals: np.ndarray | None = None  # (N, 3): what a goal-conditioned victim also read
    hidden_states: np.ndarray | None = None  # (N, H): a recurrent victim's pre-step states


@dataclass
class Reconstruction:
    actions: np.ndarray | None = None  # (N,)
    images: np.ndarray | None = None  # (N, H, W, 3) uint8
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ObservedWindows:
    """What the server saw of a batch of windows: T consecutive per-step gradients each, in
    the order they arrived. Learned attackers reconstruct from this and nothing else."""

    gradients: Any  # torch.Tensor (B, T, d) float32
