"""Analytic recovery + a learned decoder: the frame from the exact conv features.

A per-step gradient gives the FC layer's input exactly (x = ∇Wᵀ∇b/‖∇b‖², see
`gradleak.attacks.analytic`): the flattened conv feature map of the private frame. The attacker
knows θ0 and the architecture, so it can compute that same feature map for any frame it holds.
The decoder is therefore trained on frames alone (auxiliary captures plus freshly rendered
training-scene frames, augmented), never on stored gradients; at attack time it reads the
features recovered from the gradient. The action comes from the closed-form rule on the policy
head's bias gradient, so it is exact on undefended streams.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from gradleak.attacks.analytic import POLICY, VALUE, actions_from_policy_bias
from gradleak.attacks.encoders import (
    ResidualConv,
    WindowAttacker,
    block,
    linear_input,
    linear_pairs,
)
from gradleak.capture.schema import layers_from_json
from gradleak.errors import ConfigError

# The closed-form action is certain on clean streams; a large finite logit keeps softmax sane.
CERTAIN = 20.0


@dataclass
class DecoderConfig:
    gradient_dim: int = 0  # set from the training capture
    frame_size: int = 64
    num_actions: int = 5
    layer_table: str = ""  # set from the training capture
    feature_module: str = "fc"  # the Linear layer whose input is the conv feature map
    feature_shape: list[int] = field(default_factory=list)  # (C, h, w); set from the victim
    entropy_coef: float = 0.01  # the victim's declared loss coefficient (closed-form action)
    channels: int = 128  # widest decoder stage; halves with each ×2 upsampling, floor 16
    global_channels: int = 32  # a dense path from all features to every position of the map
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def stage_widths(channels: int, stages: int) -> list[int]:
    return [max(16, channels >> max(0, i - 1)) for i in range(stages + 1)]


class FeatureDecoder(WindowAttacker):
    name = "analytic+decoder"

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        layers = {layer.name: layer for layer in layers_from_json(config.layer_table or "[]")}
        pairs = {weight.name.removesuffix(".weight"): (weight, bias)
                 for weight, bias in linear_pairs(list(layers.values()))}
        for module in (config.feature_module, POLICY, VALUE):
            if module not in pairs:
                raise ConfigError(f"the analytic decoder needs the gradients of Linear layer "
                                  f"{module!r} with its bias; this capture has "
                                  f"{', '.join(sorted(pairs)) or 'none'}")
        self.feature_layer, self.policy_layer = pairs[config.feature_module], pairs[POLICY]
        self.value_layer = pairs[VALUE]
        channels, height, width = self._check_shape(config, self.feature_layer[0].shape[1])
        policy = self.policy_layer[0].shape
        self.register_buffer("feature_mean", torch.zeros(channels * height * width))
        self.register_buffer("feature_std", torch.ones(channels * height * width))
        self.register_buffer("policy_weight", torch.zeros(policy))  # θ0's head, for π
        self.register_buffer("policy_bias", torch.zeros(policy[0]))
        stages = self._stages(height, config.frame_size)
        widths = stage_widths(config.channels, stages)
        self.global_path = nn.Linear(channels * height * width,
                                     config.global_channels * height * width)
        self.stem = nn.Sequential(
            nn.Conv2d(channels + config.global_channels, widths[0], 3, 1, 1), nn.GELU(),
            ResidualConv(widths[0]))
        self.up = nn.Sequential(*(nn.Sequential(
            nn.Upsample(scale_factor=2, mode="nearest"),
            nn.Conv2d(widths[i], widths[i + 1], 3, 1, 1), nn.GELU(), ResidualConv(widths[i + 1]))
            for i in range(stages)))
        self.head = nn.Sequential(nn.Conv2d(widths[-1], 3, 3, 1, 1), nn.Sigmoid())

    @staticmethod
    def _check_shape(config: DecoderConfig, width: int) -> tuple[int, int, int]:
        if len(config.feature_shape) != 3 or int(np.prod(config.feature_shape)) != width:
            raise ConfigError(f"feature_shape {config.feature_shape}: expected (C, h, w) with "
                              f"C·h·w = {width}, the input width of {config.feature_module!r}")
        channels, height, width_ = (int(v) for v in config.feature_shape)
        if height != width_:
            raise ConfigError(f"feature map {height}×{width_}: the decoder needs a square map")
        return channels, height, width_

    @staticmethod
    def _stages(height: int, frame_size: int) -> int:
        stages, size = 0, height
        while size < frame_size:
            size, stages = size * 2, stages + 1
        if size != frame_size:
            raise ConfigError(f"frame size {frame_size} is not the feature map's size {height} "
                              "times a power of two")
        return stages

    @torch.no_grad()
    def fit_normaliser(self, features: torch.Tensor) -> None:
        """Per-coordinate standardisation from auxiliary features (N, C·h·w)."""
        features = features.double()
        self.feature_mean.copy_(features.mean(0))
        self.feature_std.copy_(features.std(0).clamp_min(1e-3))

    @torch.no_grad()
    def set_policy_head(self, weight: np.ndarray, bias: np.ndarray) -> None:
        self.policy_weight.copy_(torch.from_numpy(np.asarray(weight, np.float32)))
        self.policy_bias.copy_(torch.from_numpy(np.asarray(bias, np.float32)))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(N, C·h·w) conv features → frames (N, 3, H, W) in [0, 1]."""
        channels, height, width = self.config.feature_shape
        standard = torch.nan_to_num((features - self.feature_mean) / self.feature_std)
        spatial = standard.view(-1, channels, height, width)
        spread = self.global_path(standard).view(-1, self.config.global_channels, height, width)
        return self.head(self.up(self.stem(torch.cat([spatial, spread], 1))))

    def recovered_features(self, gradients: torch.Tensor) -> torch.Tensor:
        return linear_input(gradients, *self.feature_layer)

    def action_logits(self, gradients: torch.Tensor) -> torch.Tensor:
        """(N, d) → (N, K): the closed-form action as near-certain logits."""
        policy_input = linear_input(gradients, *self.policy_layer).double()
        value_input = linear_input(gradients, *self.value_layer).double()
        # a zero policy-bias gradient (A = 0, no entropy term) leaves the value head's input
        silent = block(gradients, self.policy_layer[1]).abs().sum(-1) == 0
        hidden = torch.where(silent[:, None], value_input, policy_input)
        probs = torch.softmax(hidden @ self.policy_weight.double().T + self.policy_bias.double(),
                              -1)
        actions, _, _ = actions_from_policy_bias(
            block(gradients, self.policy_layer[1]).double().numpy(), probs.numpy(),
            self.config.entropy_coef)
        onehot = nn.functional.one_hot(torch.from_numpy(actions), self.config.num_actions)
        return CERTAIN * (onehot.float() - 1.0)

    def attack(self, gradients: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = gradients.shape[:-1]
        flat = gradients.reshape(-1, gradients.shape[-1]).float().cpu()
        frames = self(self.recovered_features(flat.to(self.feature_mean.device)))
        logits = self.action_logits(flat).to(frames.device)
        return frames.view(*shape, *frames.shape[1:]), logits.view(*shape, -1)
