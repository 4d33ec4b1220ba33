"""Analytic recovery + a learned decoder: the frame from the exact conv features.

A per-step gradient gives the FC layer's input exactly (x = ∇Wᵀ∇b/‖∇b‖², see
`gradleak.attacks.analytic`): the flattened conv feature map of the private frame. The attacker
knows θ0 and the architecture, so it can compute that same feature map for any frame it holds.
The decoder is therefore trained on frames alone (auxiliary captures plus freshly rendered
training-scene frames, augmented), never on stored gradients; at attack time it reads the
features recovered from the gradient. The action comes from the closed-form rule on the policy
head's bias gradient, so it is exact on undefended streams.

Temporal context (`context`): "concat" also feeds the previous step's reconstruction, "warp"
first moves it by the recovered action (a learnable affine map per action, initialised from the
camera motion measured on training scenes). The previous reconstruction is the context-free
one, in training and in the attack alike, so frame t depends on steps t−1 and t only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from gradleak.attacks.analytic import actions_from_policy_bias
from gradleak.attacks.attacker import WindowAttacker
from gradleak.attacks.closed_form import head_features, linear_input, linear_pairs
from gradleak.attacks.encoders import ResidualConv, block, flat_linear_input
from gradleak.errors import ConfigError
from gradleak.victims.base import LayerInfo, VictimConfig, layers_from_json
from gradleak.victims.roles import Roles

# The closed-form action is certain on clean streams; a large finite logit keeps softmax sane.
CERTAIN = 20.0
CONTEXTS = ("none", "concat", "warp")

@dataclass
class DecoderConfig:
    gradient_dim: int = 0  # set from the training capture
    frame_size: int = 64
    num_actions: int = 5
    layer_table: str = ""  # set from the training capture
    # whose input the decoder reads: "" (the input of the Linear layer reading the conv stack,
    # the victim's `feature_linear` role) or a conv module (e.g. "encoder.3" of cnn-small),
    # reached by the recursion through the conv stack
    feature_module: str = ""
    victim: str = "cnn-small"  # the architecture θ0 belongs to (a conv feature_module needs it)
    victim_options: dict[str, Any] = field(default_factory=dict)
    roles: str = ""  # the capture's roles (JSON); set from the training capture
    feature_shape: list[int] = field(default_factory=list)  # (C, h, w); set from the victim
    entropy_coef: float = 0.01  # the victim's declared loss coefficient (closed-form action)
    channels: int = 128  # widest decoder stage; halves with each ×2 upsampling, floor 16
    global_channels: int = 32  # a dense path from all features to every position; 0: none
    context: str = "none"  # none, concat (previous reconstruction), warp (moved by the action)
    context_channels: int = 16
    # (scale, dx, dy) per action, as the environment declares its camera motion (the fit sets
    # it from the capture's environment); [] = identity, the warp then learns it from scratch
    camera_motion: list[list[float]] = field(default_factory=list)
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decoder_victim(config: DecoderConfig) -> VictimConfig:
    return VictimConfig(config.victim, config.frame_size, config.num_actions,
                        dict(config.victim_options))


def decoder_roles(config: DecoderConfig) -> Roles:
    """The capture's roles; a decoder saved before they were stored gets its victim's."""
    if config.roles:
        return Roles.from_json(config.roles, "decoder config field 'roles'")
    from gradleak.victims import create_victim

    return create_victim(decoder_victim(config)).roles()


def stage_widths(channels: int, stages: int) -> list[int]:
    return [max(16, channels >> max(0, i - 1)) for i in range(stages + 1)]


class FeatureDecoder(WindowAttacker):
    name = "analytic+decoder"

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        roles = self.roles = decoder_roles(config)
        if not config.feature_module:
            config = replace(config, feature_module=roles.feature_linear or "")
        self.config = config
        layers = {layer.name: layer for layer in layers_from_json(config.layer_table or "[]")}
        pairs = {weight.name.removesuffix(".weight"): (weight, bias)
                 for weight, bias in linear_pairs(list(layers.values()))}
        self.through_convs = config.feature_module not in pairs and len(
            getattr(layers.get(f"{config.feature_module}.weight"), "shape", ())) == 4
        needed = (roles.feature_linear if self.through_convs else config.feature_module,
                  roles.policy_head, roles.value_head)
        for module in needed:
            if module not in pairs:
                raise ConfigError(f"the analytic decoder needs the gradients of Linear layer "
                                  f"{module!r} with its bias; this capture has "
                                  f"{', '.join(sorted(pairs)) or 'none'}")
        self.layers = layers
        self.feature_layer, self.policy_layer = pairs[needed[0]], pairs[roles.policy_head]
        self.value_layer = pairs[roles.value_head]
        if self.through_convs:
            self.theta0 = self._conv_stack(config)
            width = int(np.prod(config.feature_shape or [0]))
        else:
            width = self.feature_layer[0].shape[1]
        channels, height, width = self._check_shape(config, width)
        policy = self.policy_layer[0].shape
        self.register_buffer("feature_mean", torch.zeros(channels * height * width))
        self.register_buffer("feature_std", torch.ones(channels * height * width))
        self.register_buffer("policy_weight", torch.zeros(policy))  # θ0's head, for π
        self.register_buffer("policy_bias", torch.zeros(policy[0]))
        stages = self._stages(height, config.frame_size)
        widths = stage_widths(config.channels, stages)
        if config.context not in CONTEXTS:
            raise ConfigError(f"decoder context {config.context!r}: expected one of "
                              f"{', '.join(CONTEXTS)}")
        extra = config.context_channels if config.context != "none" else 0
        self.global_path = nn.Linear(channels * height * width,
                                     config.global_channels * height * width) \
            if config.global_channels else None
        self.stem = nn.Sequential(
            nn.Conv2d(channels + config.global_channels + extra, widths[0], 3, 1, 1), nn.GELU(),
            ResidualConv(widths[0]))
        self.up = nn.ModuleList(UpStage(widths[i], widths[i + 1], extra) for i in range(stages))
        self.head = nn.Sequential(nn.Conv2d(widths[-1], 3, 3, 1, 1), nn.Sigmoid())
        if extra:
            self.context = ContextPyramid(config.context_channels, stages)
            self.motion = nn.Parameter(motion_prior(config.num_actions, config.camera_motion))

    @staticmethod
    def _conv_stack(config: DecoderConfig) -> nn.Module:
        """θ0's victim, frozen: the recursion reads its conv, BN and FC weights."""
        from gradleak.attacks.conv_recovery import deepest_inputs
        from gradleak.victims import create_victim

        victim = create_victim(decoder_victim(config)).eval()
        reachable = deepest_inputs(victim)
        if config.feature_module not in reachable:
            raise ConfigError(f"feature_module {config.feature_module!r}: the gradients of "
                              f"{config.victim} determine the inputs of "
                              f"{', '.join(reachable) or 'no conv'} only")
        for parameter in victim.parameters():
            parameter.requires_grad_(False)
        return victim

    @torch.no_grad()
    def set_theta0(self, state: dict[str, np.ndarray]) -> None:
        if self.through_convs:
            self.theta0.load_state_dict({name: torch.from_numpy(np.asarray(value))
                                         for name, value in state.items()})

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

    def forward(self, features: torch.Tensor, previous: torch.Tensor | None = None,
                previous_actions: torch.Tensor | None = None,
                has_previous: torch.Tensor | None = None) -> torch.Tensor:
        """(N, C·h·w) conv features → frames (N, 3, H, W) in [0, 1]. Context models also take
        the previous reconstruction (N, 3, H, W), the action taken after it and whether there
        is one; without them they decode as if every step started an episode."""
        channels, height, width = self.config.feature_shape
        standard = torch.nan_to_num((features - self.feature_mean) / self.feature_std)
        spatial = standard.view(-1, channels, height, width)
        spread = [] if self.global_path is None else [self.global_path(standard).view(
            -1, self.config.global_channels, height, width)]
        levels: list[torch.Tensor | None] = [None] * (len(self.up) + 1)
        if self.config.context != "none":
            levels = self._context(len(features), previous, previous_actions, has_previous)
        coarsest = [] if levels[-1] is None else [levels[-1]]
        x = self.stem(torch.cat([spatial, *spread, *coarsest], 1))
        for i, stage in enumerate(self.up):
            x = stage(x, levels[len(self.up) - 1 - i])
        return self.head(x)

    def _context(self, count: int, previous: torch.Tensor | None,
                 actions: torch.Tensor | None, has: torch.Tensor | None) -> list[torch.Tensor]:
        size = self.config.frame_size
        if previous is None or has is None:
            previous = self.feature_mean.new_zeros(count, 3, size, size)
            has = torch.zeros(count, dtype=torch.bool, device=previous.device)
        if self.config.context == "warp" and actions is not None:
            previous = self.warp(previous, actions)
        mask = has.to(previous.dtype)[:, None, None, None]
        levels = self.context(torch.cat([previous * mask, mask.expand(-1, 1, size, size)], 1))
        return levels

    def warp(self, frames: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """Move each frame by the camera motion of the action taken after it."""
        grid = nn.functional.affine_grid(self.motion[actions], list(frames.shape),
                                         align_corners=False)
        return nn.functional.grid_sample(frames, grid, padding_mode="border",
                                         align_corners=False)

    def recovered_features(self, gradients: torch.Tensor, chunk: int = 256) -> torch.Tensor:
        if not self.through_convs:
            return flat_linear_input(gradients, *self.feature_layer)
        from gradleak.attacks.conv_recovery import recover_conv_inputs

        module, parts = self.config.feature_module, []
        for start in range(0, len(gradients), chunk):  # D is (chunk, C_out·k², pixels)
            rows = gradients[start:start + chunk].cpu()
            found = recover_conv_inputs(
                lambda name, rows=rows: block(rows, self.layers[name]).unflatten(
                    -1, self.layers[name].shape).double(),
                self.theta0, down_to=module)
            parts.append(found.inputs[module].flatten(1).float())
        return torch.cat(parts).to(self.feature_mean.device)

    def action_logits(self, gradients: torch.Tensor) -> torch.Tensor:
        """(N, d) → (N, K): the closed-form action as near-certain logits."""
        def layer_input(weight: LayerInfo, bias: LayerInfo) -> torch.Tensor:
            return linear_input(block(gradients, weight).unflatten(-1, weight.shape).double(),
                                block(gradients, bias).double())

        hidden, _ = head_features(layer_input(*self.policy_layer),
                                  layer_input(*self.value_layer), self.roles.shared_features)
        hidden = torch.nan_to_num(hidden, nan=0.0)  # no signal in either head: π of h = 0
        probs = torch.softmax(hidden @ self.policy_weight.double().T + self.policy_bias.double(),
                              -1)
        actions, _, _ = actions_from_policy_bias(
            block(gradients, self.policy_layer[1]).double().numpy(), probs.numpy(),
            self.config.entropy_coef)
        onehot = nn.functional.one_hot(torch.from_numpy(actions), self.config.num_actions)
        return CERTAIN * (onehot.float() - 1.0)

    def attack(self, gradients: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t = gradients.shape[:2]
        flat = gradients.reshape(-1, gradients.shape[-1]).float().cpu()
        features = self.recovered_features(flat.to(self.feature_mean.device))
        logits = self.action_logits(flat).to(features.device)
        frames = self(features)
        if self.config.context != "none":  # step t sees the context-free frame of t − 1
            free = frames.view(b, t, *frames.shape[1:])
            previous = torch.cat([torch.zeros_like(free[:, :1]), free[:, :-1]], 1)
            actions = logits.argmax(-1).view(b, t)
            previous_actions = torch.cat([torch.zeros_like(actions[:, :1]), actions[:, :-1]], 1)
            has = (torch.arange(t, device=features.device) > 0).expand(b, t)
            frames = self(features, previous.flatten(0, 1), previous_actions.flatten(),
                          has.flatten())
        return frames.view(b, t, *frames.shape[1:]), logits.view(b, t, -1)


def motion_prior(num_actions: int, camera_motion: list[list[float]]) -> torch.Tensor:
    """(K, 2, 3) affine maps: the declared camera motion per action, identity if undeclared."""
    if camera_motion and len(camera_motion) != num_actions:
        raise ConfigError(f"camera_motion has {len(camera_motion)} entries for "
                          f"{num_actions} actions")
    theta = torch.zeros(num_actions, 2, 3)
    for index in range(num_actions):
        scale, dx, dy = camera_motion[index] if camera_motion else (1.0, 0.0, 0.0)
        theta[index] = torch.tensor([[scale, 0.0, dx], [0.0, scale, dy]])
    return theta


class UpStage(nn.Module):
    """×2 nearest upsampling, then (with the context at that resolution) conv + residual."""

    def __init__(self, channels_in: int, channels_out: int, context: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels_in + context, channels_out, 3, 1, 1)
        self.body = ResidualConv(channels_out)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        x = nn.functional.interpolate(x, scale_factor=2, mode="nearest")
        if context is not None:
            x = torch.cat([x, context], 1)
        return self.body(nn.functional.gelu(self.conv(x)))


class ContextPyramid(nn.Module):
    """(N, 4, H, W) previous frame + validity mask → features at H, H/2, …, H/2^levels."""

    def __init__(self, channels: int, levels: int) -> None:
        super().__init__()
        self.inp = nn.Conv2d(4, channels, 3, 1, 1)
        self.down = nn.ModuleList(nn.Conv2d(channels, channels, 4, 2, 1) for _ in range(levels))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        levels = [nn.functional.gelu(self.inp(x))]
        for down in self.down:
            levels.append(nn.functional.gelu(down(levels[-1])))
        return levels
