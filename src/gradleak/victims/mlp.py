"""A fully connected victim: its first layer's gradient δ xᵀ holds the frame itself, which makes
it the sanity check every gradient-matching attack should pass."""

from __future__ import annotations

import torch
from torch import nn

from gradleak.victims.base import Victim, VictimConfig, register_victim


@register_victim("mlp")
class MLPVictim(Victim):
    """Flattened frame → Linear(hidden) → ReLU → policy and value heads."""

    component_prefixes = {"fc.": "fc", "policy_head.": "heads", "value_head.": "heads"}

    def __init__(self, config: VictimConfig) -> None:
        super().__init__()
        self.config = config
        hidden = int(config.options.get("hidden", 64))
        self.fc = nn.Linear(3 * config.frame_size ** 2, hidden)
        self.policy_head = nn.Linear(hidden, config.num_actions)
        self.value_head = nn.Linear(hidden, 1)

    def features(self, image: torch.Tensor, goal: torch.Tensor | None = None) -> torch.Tensor:
        return torch.relu(self.fc(self.prepare_image(image).flatten(1)))
