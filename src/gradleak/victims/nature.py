"""The Nature-DQN CNN that Stable-Baselines3's `CnnPolicy` uses (NatureCNN): three Conv → ReLU
blocks with no normalisation, FC 512 + ReLU, then the heads. Registered so that a user who trains
SB3's default image policy can audit the same architecture, and the conv-stack recursion runs
through blocks without BatchNorm."""

from __future__ import annotations

import torch
from torch import nn

from gradleak.errors import ConfigError
from gradleak.victims.base import Victim, VictimConfig, register_victim
from gradleak.victims.cnn import conv_output_size


@register_victim("nature-cnn")
class NatureCNN(Victim):
    component_prefixes = {"encoder.": "cnn", "fc.": "fc", "policy_head.": "heads",
                          "value_head.": "heads"}
    blocks = ((32, 8, 4), (64, 4, 2), (64, 3, 1))  # (out_channels, kernel, stride), no padding
    hidden = 512

    def __init__(self, config: VictimConfig) -> None:
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        channels, size = 3, config.frame_size
        for out, kernel, stride in self.blocks:
            layers += [nn.Conv2d(channels, out, kernel, stride), nn.ReLU()]
            channels, size = out, conv_output_size(size, kernel, stride, 0)
            if size < 1:
                raise ConfigError(f"victim {config.name}: frame_size {config.frame_size} is "
                                  "too small for its conv stack")
        self.encoder = nn.Sequential(*layers)
        self.fc = nn.Linear(channels * size * size, self.hidden)
        self.policy_head = nn.Linear(self.hidden, config.num_actions)
        self.value_head = nn.Linear(self.hidden, 1)

    def features(self, image: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(self.encoder(self.prepare_image(image)).flatten(1)))

    def forward(self, image: torch.Tensor, goal: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.features(image)
        return self.policy_head(h), self.value_head(h).squeeze(-1)
