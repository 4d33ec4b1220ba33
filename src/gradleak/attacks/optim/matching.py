"""Gradient matching: the dummy gradient of the victim's own loss at θ0, and its distance to an
observed per-step gradient.

Everything here is per frame (no batch axis) so that `torch.func.vmap` can solve many frames
at once: frames are independent problems, and a vmapped per-frame loss keeps them independent
(batched and one-at-a-time runs give the same answer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.func import functional_call, grad

from gradleak.errors import ConfigError
from gradleak.rl.losses import LossCoefficients, actor_critic_loss, log_probs_and_entropy
from gradleak.threat import Observation
from gradleak.victims.base import COMPONENTS, LayerInfo, victim_at_theta0

DUMMY_LOSSES = ("victim", "probe")
DISTANCES = ("cosine", "l2")
LAYER_WEIGHTS = ("equal", "linear", "exp")
BOXES = ("clamp", "sigmoid", "none")


@dataclass
class MatchingConfig:
    """What is matched, and how far apart two gradients are."""

    loss: str = "victim"  # the victim's actor-critic loss, or the public code's "probe" loss
    distance: str = "cosine"
    components: list[str] = field(default_factory=lambda: list(COMPONENTS))
    layer_weights: str = "equal"  # inversefed's per-tensor weights: equal, linear, exp
    tv: float = 0.0  # anisotropic total variation on the [0, 1] image
    box: str = "clamp"  # keep the image in [0, 1]: clamp after each step, sigmoid, or none

    def check(self) -> None:
        for name, value, allowed in (("loss", self.loss, DUMMY_LOSSES),
                                     ("distance", self.distance, DISTANCES),
                                     ("layer_weights", self.layer_weights, LAYER_WEIGHTS),
                                     ("box", self.box, BOXES)):
            if value not in allowed:
                raise ConfigError(f"matching {name} {value!r}: expected one of "
                                  f"{', '.join(allowed)}")
        unknown = set(self.components) - set(COMPONENTS)
        if unknown or not self.components:
            raise ConfigError(f"matching components {self.components}: expected a non-empty "
                              f"subset of {', '.join(COMPONENTS)}")
        if self.tv < 0:
            raise ConfigError(f"matching tv {self.tv}: expected >= 0")


def probe_loss(logits: torch.Tensor, values: torch.Tensor, actions: torch.Tensor
               ) -> torch.Tensor:
    """The public TRACE code's dummy loss, −log π(a|s) + 0.5 V(s): not what the victim
    differentiated. Kept only to measure what that shortcut costs."""
    log_prob, _ = log_probs_and_entropy(logits, actions)
    return -log_prob + 0.5 * values


def layer_weights(kind: str, count: int) -> torch.Tensor:
    """inversefed's weighting of the parameter tensors, first layer heaviest."""
    if kind == "equal":
        return torch.ones(count)
    ramp = torch.arange(count, 0, -1, dtype=torch.float32)
    if kind == "linear":
        return ramp / count
    return ramp.softmax(0) / ramp.softmax(0)[0]  # "exp"


def gradient_distance(dummy: tuple[torch.Tensor, ...], observed: tuple[torch.Tensor, ...],
                      weights: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "l2":
        return sum(w * (g - t).pow(2).sum() for g, t, w in zip(dummy, observed, weights,
                                                             strict=True))
    inner = sum(w * (g * t).sum() for g, t, w in zip(dummy, observed, weights, strict=True))
    dummy_norm = sum(w * g.pow(2).sum() for g, w in zip(dummy, weights, strict=True))
    observed_norm = sum(w * t.pow(2).sum() for t, w in zip(observed, weights, strict=True))
    return 1.0 - inner / (dummy_norm.sqrt() * observed_norm.sqrt() + 1e-12)


def total_variation(image: torch.Tensor) -> torch.Tensor:
    """Anisotropic TV of an (H, W, C) image, as inversefed computes it (means of |Δ|)."""
    return ((image[1:] - image[:-1]).abs().mean()
            + (image[:, 1:] - image[:, :-1]).abs().mean())


class DummyGradient:
    """∇θ L(θ0; frame, action, A, R) for one frame, with the loss the victim trained with.

    PPO's ratio π/π_old is exactly one at θ0 whatever the frame, so its gradient is A2C's
    (Proposition 4.1; tests pin both against real captures); the A2C form is used for both.
    """

    def __init__(self, observation: Observation, config: MatchingConfig) -> None:
        config.check()
        self.config = config
        self.victim = victim_at_theta0(observation)
        # what the victim reads beside the frame, unknown to the server: optimised jointly
        self.extra_sizes = {"goal": 3 if "goal" in observation.roles.extra_inputs else 0,
                            "hidden": self.victim.hidden_size if self.victim.recurrent else 0}
        self.layers = selected_layers(observation, config.components)
        wanted = {layer.name for layer in self.layers}
        named = {n: p.detach() for n, p in self.victim.named_parameters()}
        self.parameters = {n: p for n, p in named.items() if n in wanted}
        self.frozen = {n: p for n, p in named.items() if n not in wanted}
        self.buffers = {n: b.detach() for n, b in self.victim.named_buffers()}
        self.coefficients = coefficients_from(observation.hyperparameters)
        self.weights = layer_weights(config.layer_weights, len(self.layers))

    def __call__(self, image: torch.Tensor, action: torch.Tensor, advantage: torch.Tensor,
                 ret: torch.Tensor, goal: torch.Tensor | None = None,
                 hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """image (H, W, C) in [0, 1]; action () index or (K,) distribution; A, R scalars; the
        goal (3,) and pre-step state (H,) of a victim that reads them."""

        def loss(parameters: dict[str, torch.Tensor]) -> torch.Tensor:
            logits, values = functional_call(
                self.victim, ({**self.frozen, **parameters}, self.buffers),
                (image[None] * 255.0, None if goal is None else goal[None],
                 None if hidden is None else hidden[None]))
            if self.config.loss == "probe":
                return probe_loss(logits, values, action[None]).mean()
            return actor_critic_loss(logits, values, action[None], advantage[None], ret[None],
                                     self.coefficients).mean()

        gradients = grad(loss)(self.parameters)
        return tuple(gradients[layer.name] for layer in self.layers)

    def split(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """An observed (d,) row of the selected layers → per-tensor views."""
        pieces, offset = [], 0
        for layer in self.layers:
            pieces.append(flat[offset:offset + layer.size].view(layer.shape))
            offset += layer.size
        return tuple(pieces)


def selected_layers(observation: Observation, components: list[str]) -> list[LayerInfo]:
    layers = [layer for layer in observation.layers if layer.component in components]
    if not layers:
        held = sorted({layer.component for layer in observation.layers})
        raise ConfigError(f"matching components {components}: the observed gradients hold "
                          f"only {', '.join(held)}")
    return layers


def observed_columns(observation: Observation, layers: list[LayerInfo]) -> np.ndarray:
    """(N, d') the observed gradients of the selected layers, in `layers` order."""
    return np.concatenate([observation.gradients[:, layer.offset:layer.offset + layer.size]
                           for layer in layers], axis=1)


def coefficients_from(hyperparameters: dict[str, Any]) -> LossCoefficients:
    """The declared loss coefficients; a missing one is an error, not a silent default."""
    try:
        return LossCoefficients(value=float(hyperparameters["value"]),
                                entropy=float(hyperparameters["entropy"]),
                                clip=float(hyperparameters.get("clip", 0.2)))
    except KeyError as missing:
        raise ConfigError(f"the observation's hyperparameters lack the loss coefficient "
                          f"{missing}: gradient matching needs the victim's exact loss") from None
