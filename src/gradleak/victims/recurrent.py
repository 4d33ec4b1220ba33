"""The paper's CNN+GRU victim (its Table 9): the paper CNN's conv stack, a 256-d projection, and
a GRU whose state is carried through the episode and reset at its boundaries. 919,462
parameters at 84×84 with K = 5.

The GRU cell is written with two Linear layers (input → gates, state → gates) so that each is
an ordinary biased Linear layer: on one step ∇W_hh = δ·h_prevᵀ and ∇b_hh = δ, and the closed
form x = ∇Wᵀ∇b/‖∇b‖² gives the pre-step hidden state back, a summary of everything the agent
saw before. Same parameter count and the same equations as torch.nn.GRUCell.
"""

from __future__ import annotations

import torch
from torch import nn

from gradleak.victims.base import Victim, VictimConfig, register_victim
from gradleak.victims.cnn import SharedCNN, SmallCNN


class GRUCell(nn.Module):
    """torch.nn.GRUCell's equations (r, z, n gate order), as two Linear layers."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.hidden_size = hidden
        self.input = nn.Linear(inputs, 3 * hidden)
        self.state = nn.Linear(hidden, 3 * hidden)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        xr, xz, xn = self.input(x).chunk(3, dim=-1)
        hr, hz, hn = self.state(h).chunk(3, dim=-1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        return (1 - z) * n + z * h


class RecurrentCNN(Victim):
    # Rollouts carry the state and reset it at episode boundaries; the loss of each step takes
    # its recorded pre-step state as a detached input (no backpropagation through time), in
    # training as in capture. That state is private: gradient matching refuses the victim.
    recurrent = True
    extra_inputs = ("the hidden state",)
    recurrent_state_role = "gru.state"
    component_prefixes = {"encoder.": "cnn", "fc.": "fc", "gru.": "fc", "policy_head.": "heads",
                          "value_head.": "heads"}
    visual: type[SharedCNN] = SharedCNN
    projection = 256

    def __init__(self, config: VictimConfig) -> None:
        super().__init__()
        self.config = config
        vision = self.visual(config)
        self.encoder = vision.encoder
        self.fc = nn.Linear(vision.fc.in_features, self.projection)
        self.gru = GRUCell(self.projection, self.projection)
        self.policy_head = nn.Linear(self.projection, config.num_actions)
        self.value_head = nn.Linear(self.projection, 1)

    @property
    def hidden_size(self) -> int:
        return self.projection

    def initial_state(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, self.projection)

    def advance(self, image: torch.Tensor, goal: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, value, next hidden state); None is an episode's first step (zero state)."""
        x = torch.relu(self.fc(self.encoder(self.prepare_image(image)).flatten(1)))
        hidden = torch.zeros_like(x) if hidden is None else hidden.to(x.dtype)
        h = self.gru(x, hidden)
        return self.policy_head(h), self.value_head(h).squeeze(-1), h

    def forward(self, image: torch.Tensor, goal: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        logits, value, _ = self.advance(image, goal, hidden)
        return logits, value


@register_victim("cnn-gru")
class PaperRecurrentCNN(RecurrentCNN):
    """919,462 parameters at 84×84 with K = 5."""


@register_victim("cnn-gru-small")
class SmallRecurrentCNN(RecurrentCNN):
    """cnn-small's conv stack, a 128-d projection and GRU: the CPU size."""

    visual = SmallCNN
    projection = 128
