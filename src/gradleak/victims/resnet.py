"""ResNet victims as federated clients and many RL codebases train them: a Conv → BatchNorm →
ReLU stem, three stages of one basic block each (two 3×3 convs with BatchNorm, the skip
projected by a strided 1×1 conv where the stage halves the map), global average pooling,
FC + ReLU and the heads. Eight weighted layers before the heads: ResNet-8 (He et al.'s CIFAR
family, one block per stage).

Global average pooling keeps only each channel's mean of the last map, so the features the
heads read say nothing of where in the frame anything is: the conv-stack recursion of the
training-free attack does not apply (it is refused, named) and the learned attackers and
gradient matching are what the audit runs.
"""

from __future__ import annotations

import torch
from torch import nn

from gradleak.victims.base import Victim, VictimConfig, register_victim


class BasicBlock(nn.Module):
    def __init__(self, channels_in: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(channels_in, channels, 3, stride, 1, bias=False)
        self.norm0 = nn.BatchNorm2d(channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.norm1 = nn.BatchNorm2d(channels)
        self.skip = nn.Identity() if stride == 1 and channels_in == channels else \
            nn.Sequential(nn.Conv2d(channels_in, channels, 1, stride, bias=False),
                          nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch = self.norm1(self.conv1(torch.relu(self.norm0(self.conv0(x)))))
        return torch.relu(branch + self.skip(x))


class ResNet(Victim):
    component_prefixes = {"encoder.": "cnn", "fc.": "fc", "policy_head.": "heads",
                          "value_head.": "heads"}
    channels: tuple[int, ...] = (16, 32, 64)
    hidden = 256

    def __init__(self, config: VictimConfig) -> None:
        super().__init__()
        self.config = config
        layers: list[nn.Module] = [nn.Conv2d(3, self.channels[0], 3, 1, 1, bias=False),
                                   nn.BatchNorm2d(self.channels[0]), nn.ReLU()]
        channels_in = self.channels[0]
        for index, channels in enumerate(self.channels):
            layers.append(BasicBlock(channels_in, channels, 1 if index == 0 else 2))
            channels_in = channels
        self.encoder = nn.Sequential(*layers)
        self.fc = nn.Linear(channels_in, self.hidden)
        self.policy_head = nn.Linear(self.hidden, config.num_actions)
        self.value_head = nn.Linear(self.hidden, 1)

    def features(self, image: torch.Tensor, goal: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """h(s): the non-negative features both heads read."""
        x = self.encoder(self.prepare_image(image))  # (B, C, h, w)
        return torch.relu(self.fc(x.mean(dim=(2, 3))))  # global average pooling


@register_victim("resnet8")
class ResNet8(ResNet):
    """16/32/64 channels, FC 256: about 100k parameters at any frame size."""
