"""Models nobody at gradleak wrote, as a user would bring them: their own layer names, their
own forward, no gradleak base class. Loaded by the CLI with `--plugin user_models`."""

from __future__ import annotations

import torch
from torch import nn

import gradleak


class ConvPolicy(nn.Module):
    """Conv → ReLU ×2, a projection, and two heads named the user's way."""

    def __init__(self, channels: int = 3, actions: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, 8, 4, 4), nn.ReLU(),
                                  nn.Conv2d(8, 16, 3, 1), nn.ReLU(), nn.Flatten())
        self.proj = nn.Linear(16 * 6 * 6, 64)
        self.pi = nn.Linear(64, actions)
        self.v = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.proj(self.body(x)))
        return self.pi(h), self.v(h)


@gradleak.register_model_factory("conv-policy")
def build_conv_policy(actions: int = 4, channels: int = 3) -> nn.Module:
    """The factory the capture names: architecture only, θ0 comes from the capture."""
    return ConvPolicy(channels=channels, actions=actions)


class Actor(nn.Module):
    """An MLP actor on a flattened frame stack (grayscale, non-square)."""

    def __init__(self, inputs: int, actions: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(inputs, 32), nn.Tanh(),
                                 nn.Linear(32, actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Critic(nn.Module):
    def __init__(self, inputs: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(inputs, 16), nn.ReLU(),
                                 nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class NoisyHead(nn.Module):
    """Adds fresh noise on every call, in eval mode too: cannot be audited."""

    def __init__(self) -> None:
        super().__init__()
        self.flat = nn.Flatten()
        self.pi, self.v = nn.Linear(12, 3), nn.Linear(12, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.flat(x)[:, :12] + torch.randn(len(x), 12)
        return self.pi(h), self.v(h)


@gradleak.register_model_factory("tiny-classifier")
class TinyClassifier(nn.Module):
    """A client's classifier for 1×8×8 images, BatchNorm included, named the user's way."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.out = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.stem(x))).flatten(1))
