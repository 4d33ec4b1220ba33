"""The paper's multi-modal victim (its Table 9): the paper CNN's 512-d visual features fused
with a two-layer, 128-unit encoder of the goal vector, projected to 512, then the heads.
1,281,318 parameters at 84×84 with K = 5.

The goal encoder's first Linear layer reads the goal vector itself, so one step's gradient
gives it back in closed form (x = ∇Wᵀ∇b/‖∇b‖²): where the agent is heading, which the paper
does not reconstruct.
"""

from __future__ import annotations

import torch
from torch import nn

from gradleak.errors import ConfigError
from gradleak.victims.base import Victim, VictimConfig, register_victim
from gradleak.victims.cnn import SharedCNN, SmallCNN

GOAL_DIM = 3  # DoomNav's (distance / 10 m, sin bearing, cos bearing)


class MultiModal(Victim):
    extra_inputs = ("goal",)
    goal_input_role = "goal_encoder.0"
    component_prefixes = {"encoder.": "cnn", "fc.": "fc", "goal_encoder.": "fc",
                          "fusion.": "fc", "policy_head.": "heads", "value_head.": "heads"}
    visual: type[SharedCNN] = SharedCNN
    goal_hidden = 128
    fused = 512

    def __init__(self, config: VictimConfig) -> None:
        super().__init__()
        self.config = config
        vision = self.visual(config)
        self.encoder, self.fc = vision.encoder, vision.fc
        self.goal_encoder = nn.Sequential(nn.Linear(GOAL_DIM, self.goal_hidden), nn.ReLU(),
                                          nn.Linear(self.goal_hidden, self.goal_hidden),
                                          nn.ReLU())
        self.fusion = nn.Linear(vision.hidden + self.goal_hidden, self.fused)
        self.policy_head = nn.Linear(self.fused, config.num_actions)
        self.value_head = nn.Linear(self.fused, 1)

    def features(self, image: torch.Tensor, goal: torch.Tensor | None = None) -> torch.Tensor:
        visual = torch.relu(self.fc(self.encoder(self.prepare_image(image)).flatten(1)))
        if goal is None:  # checked after the visual path: hooks on it need no goal
            raise ConfigError(f"victim {self.config.name} reads the goal vector beside the frame:"
                              " pass goals (every DoomNav observation has one)")
        fused = torch.cat([visual, self.goal_encoder(goal.to(visual.dtype))], dim=-1)
        return torch.relu(self.fusion(fused))  # (B, fused): non-negative, as the heads need


@register_victim("multimodal")
class PaperMultiModal(MultiModal):
    """1,281,318 parameters at 84×84 with K = 5."""


@register_victim("multimodal-small")
class SmallMultiModal(MultiModal):
    """cnn-small's 256-d features, a 64-unit goal encoder, fused to 256: the CPU size."""

    visual = SmallCNN
    goal_hidden = 64
    fused = 256
