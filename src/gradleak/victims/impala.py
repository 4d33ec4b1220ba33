"""The paper's IMPALA victims (its Table 9): three stages of conv → GroupNorm → max-pool → two
residual blocks, then FC 256 and the heads. 1,090,790 parameters at 84×84 with K = 5 for
16/32/32 channels, 2,373,318 for the wide 32/64/64.

The paper leaves two details open: where GroupNorm sits and how many groups it has. One
GroupNorm after each stage's first convolution is the only placement that matches both counts
(2 × 80 and 2 × 160 affine parameters); 8 groups (fewer when a stage has fewer channels) is
our choice, and does not change the count.
"""

from __future__ import annotations

import torch
from torch import nn

from gradleak.victims.base import Victim, VictimConfig, register_victim
from gradleak.victims.cnn import conv_output_size


class ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


def stage(channels_in: int, channels: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(channels_in, channels, 3, padding=1),
                         nn.GroupNorm(min(8, channels), channels),
                         nn.MaxPool2d(3, stride=2, padding=1),
                         ResidualBlock(channels), ResidualBlock(channels))


class Impala(Victim):
    component_prefixes = {"encoder.": "cnn", "fc.": "fc", "policy_head.": "heads",
                          "value_head.": "heads"}
    channels: tuple[int, ...] = (16, 32, 32)
    hidden = 256

    def __init__(self, config: VictimConfig) -> None:
        super().__init__()
        self.config = config
        stages, channels_in, size = [], 3, config.frame_size
        for channels in self.channels:
            stages.append(stage(channels_in, channels))
            channels_in, size = channels, conv_output_size(size, 3, 2, 1)
        self.encoder = nn.Sequential(*stages)
        self.fc = nn.Linear(channels_in * size * size, self.hidden)
        self.policy_head = nn.Linear(self.hidden, config.num_actions)
        self.value_head = nn.Linear(self.hidden, 1)

    def features(self, image: torch.Tensor, goal: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """h(s): the non-negative features both heads read."""
        x = torch.relu(self.encoder(self.prepare_image(image)))  # (B, C, h, w)
        return torch.relu(self.fc(x.flatten(1)))  # (B, hidden)


@register_victim("impala")
class PaperImpala(Impala):
    """16/32/32 channels: 1,090,790 parameters at 84×84 with K = 5."""


@register_victim("impala-wide")
class WideImpala(Impala):
    """32/64/64 channels: 2,373,318 parameters at 84×84 with K = 5."""

    channels = (32, 64, 64)


@register_victim("impala-small")
class SmallImpala(Impala):
    """Half width, 8/16/16: the CPU size for 64×64 frames."""

    channels = (8, 16, 16)


@register_victim("impala-wide-small")
class SmallWideImpala(Impala):
    """Half of the wide one, 16/32/32: the CPU size for 64×64 frames."""

    channels = (16, 32, 32)
