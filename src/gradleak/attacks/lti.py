"""Learning to Invert (Wu et al., 2023), the paper's single-frame learned baseline.

An MLP from a fixed random 10% of the gradient's coordinates to the frame and the action; each
step is inverted on its own, without temporal context. With projection "structured" the MLP
reads the exact Linear-layer inputs instead (a learned decoder of the recovered conv features).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from gradleak.attacks.attacker import WindowAttacker
from gradleak.attacks.encoders import (
    GradientInput,
    StructuredInput,
    WideLinear,
    subsample_index,
)
from gradleak.errors import ConfigError


@dataclass
class LtiConfig:
    gradient_dim: int = 0  # set from the training capture
    frame_size: int = 64
    num_actions: int = 5
    subsample_fraction: float = 0.1
    projection: str = "subsample"  # LtI's random subset, or "structured" (exact layer inputs)
    layer_table: str = ""  # set from the training capture: the structured input reads it
    hidden: int = 3000  # the paper's width; CPU presets use less
    layers: int = 2  # hidden layers
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LearningToInvert(WindowAttacker):
    name = "LtI"

    @property
    def gradient_input(self) -> GradientInput:
        return self.input

    def __init__(self, config: LtiConfig) -> None:
        super().__init__()
        self.config = config
        if config.projection == "structured":
            self.input: GradientInput = StructuredInput(config.gradient_dim, config.layer_table)
        elif config.projection == "subsample":
            index = subsample_index(config.gradient_dim, config.subsample_fraction, config.seed)
            self.input = GradientInput(config.gradient_dim, index)
        else:
            raise ConfigError(f"LtI projection {config.projection!r}: expected subsample or "
                              "structured")
        layers: list[nn.Module] = []
        width = self.input.features
        for _ in range(config.layers):
            layers += [nn.Linear(width, config.hidden), nn.ReLU()]
            width = config.hidden
        self.body = nn.Sequential(*layers)
        size = config.frame_size
        self.image_head = nn.Sequential(WideLinear(width, 3 * size * size), nn.Sigmoid())
        self.action_head = nn.Linear(width, config.num_actions)

    def forward(self, gradients: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., d) → frames (..., 3, H, W) in [0, 1] and action logits (..., K)."""
        h = self.body(self.input(gradients))
        size = self.config.frame_size
        frames = self.image_head(h).view(*gradients.shape[:-1], 3, size, size)
        return frames, self.action_head(h)

    def attack(self, gradients: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self(gradients)  # every step on its own
