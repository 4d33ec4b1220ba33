"""The paper's shared CNN victim and its half-width CPU variant."""

from __future__ import annotations

import torch
from torch import nn

from gradleak.errors import ConfigError
from gradleak.victims.base import Victim, VictimConfig, register_victim


def conv_output_size(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


class SharedCNN(Victim):
    """Four Conv → ReLU → BatchNorm blocks, FC + ReLU, policy and value heads (paper §5)."""

    component_prefixes = {"encoder.": "cnn", "fc.": "fc", "policy_head.": "heads",
                          "value_head.": "heads"}
    # (out_channels at full width, kernel, stride, padding)
    blocks = ((32, 8, 4, 2), (64, 4, 2, 1), (64, 3, 1, 1), (64, 3, 2, 1))
    width_multiplier = 1.0
    hidden = 512
    normalise = True  # BatchNorm after each ReLU

    def __init__(self, config: VictimConfig) -> None:
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        channels, size = 3, config.frame_size
        for out, kernel, stride, padding in self.blocks:
            out = int(out * self.width_multiplier)
            layers += [nn.Conv2d(channels, out, kernel, stride, padding), nn.ReLU()]
            layers += [nn.BatchNorm2d(out)] if self.normalise else []
            channels, size = out, conv_output_size(size, kernel, stride, padding)
            if size < 1:
                raise ConfigError(f"victim {config.name}: frame_size {config.frame_size} is too "
                                  "small for its conv stack")
        self.encoder = nn.Sequential(*layers)
        self.fc = nn.Linear(channels * size * size, self.hidden)
        self.policy_head = nn.Linear(self.hidden, config.num_actions)
        self.value_head = nn.Linear(self.hidden, 1)

    def features(self, image: torch.Tensor, goal: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """h(s): the non-negative features both heads read."""
        x = self.encoder(self.prepare_image(image))  # (B, C, h, w)
        return torch.relu(self.fc(x.flatten(1)))  # (B, hidden)


@register_victim("cnn")
class PaperCNN(SharedCNN):
    """936,102 parameters at 84×84 with K = 5."""


@register_victim("cnn-small")
class SmallCNN(SharedCNN):
    """Half width (16/32/32/32) and FC 256: about 163k parameters at 64×64, for CPU presets."""

    width_multiplier = 0.5
    hidden = 256


class TenActions:
    """The paper's CNN-K10 row: the same network with the 10-action set (turn and look at two
    speeds); the name promises K = 10, so another action count is refused."""

    def __init__(self, config: VictimConfig) -> None:
        if config.num_actions != 10:
            raise ConfigError(f"victim {config.name} is the 10-action variant, but the "
                              f"environment has {config.num_actions} actions (set "
                              "env.doomnav.num_actions=10)")
        super().__init__(config)  # type: ignore[call-arg]


@register_victim("cnn-k10")
class PaperCNN10(TenActions, PaperCNN):
    """938,667 parameters at 84×84 with K = 10."""


@register_victim("cnn-k10-small")
class SmallCNN10(TenActions, SmallCNN):
    """cnn-small with K = 10."""


@register_victim("nature-cnn")
class NatureCNN(SharedCNN):
    """The Nature-DQN CNN of Stable-Baselines3's `CnnPolicy`: three Conv → ReLU blocks with no
    normalisation and no padding, FC 512 (603,814 parameters at 64×64 with K = 5). Registered so
    that SB3 agents are audited as they are (gradleak.integrations.sb3), and the conv-stack
    recursion runs through blocks without BatchNorm."""

    blocks = ((32, 8, 4, 0), (64, 4, 2, 0), (64, 3, 1, 0))
    normalise = False
