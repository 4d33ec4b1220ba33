"""Analytic recovery + a learned decoder: the frame from the exact conv features.

A per-step gradient gives the FC layer's input exactly (x = ∇Wᵀ∇b/‖∇b‖², see
`gradleak.attacks.analytic`): the flattened conv feature map of the private frame. The attacker
knows θ0 and the architecture, so it can compute that same feature map for any frame it holds.
The decoder is therefore trained on frames alone (auxiliary captures plus freshly rendered
training-scene frames, augmented), never on stored gradients; at attack time it reads the
features recovered from the gradient. The action comes from the closed-form rule on the policy
head's bias gradient, so it is exact on undefended streams.

Three parts, each in its own module: `FeatureReadout` and `ClosedFormAction`
(`attacks.decoder_inputs`, no learning) and the network `FrameDecoder`
(`attacks.frame_decoder`). With temporal context the previous reconstruction is the
context-free one, in training and in the attack alike, so frame t depends on steps t−1 and t
only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from gradleak.attacks.attacker import WindowAttacker
from gradleak.attacks.decoder_inputs import (
    ClosedFormAction,
    FeatureReadout,
    linear_layers,
    reads_through_convs,
)
from gradleak.attacks.frame_decoder import FrameDecoder
from gradleak.errors import ConfigError
from gradleak.names import FEATURE_DECODER
from gradleak.victims.base import VictimConfig, layers_from_json
from gradleak.victims.roles import Roles


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


def conv_stack(config: DecoderConfig) -> torch.nn.Module:
    """θ0's victim, whose conv stack the recursion runs down to `feature_module`."""
    from gradleak.inversion.conv_blocks import deepest_inputs
    from gradleak.victims import create_victim

    victim = create_victim(decoder_victim(config)).eval()
    reachable = deepest_inputs(victim)
    if config.feature_module not in reachable:
        raise ConfigError(f"feature_module {config.feature_module!r}: the gradients of "
                          f"{config.victim} determine the inputs of "
                          f"{', '.join(reachable) or 'no conv'} only")
    return victim


def feature_map(config: DecoderConfig, width: int) -> tuple[int, int, int]:
    if len(config.feature_shape) != 3 or int(np.prod(config.feature_shape)) != width:
        raise ConfigError(f"feature_shape {config.feature_shape}: expected (C, h, w) with "
                          f"C·h·w = {width}, the input width of {config.feature_module!r}")
    channels, height, width_ = (int(v) for v in config.feature_shape)
    if height != width_:
        raise ConfigError(f"feature map {height}×{width_}: the decoder needs a square map")
    return channels, height, width_


# Where the parts' tensors sat when the decoder was one module (checkpoints saved before).
LEGACY_PARTS = {"theta0": "features", "policy_weight": "action", "policy_bias": "action"}


class FeatureDecoder(WindowAttacker):
    name = FEATURE_DECODER

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        roles = self.roles = decoder_roles(config)
        if not config.feature_module:
            config = replace(config, feature_module=roles.feature_linear or "")
        self.config = config
        layers = {layer.name: layer for layer in layers_from_json(config.layer_table or "[]")}
        through_convs = reads_through_convs(layers, config.feature_module)
        heads = linear_layers(layers, (roles.policy_head, roles.value_head))
        self.features = FeatureReadout(layers, config.feature_module, roles,
                                       conv_stack(config) if through_convs else None)
        self.action = ClosedFormAction(heads[roles.policy_head], heads[roles.value_head],
                                       roles.shared_features, config.entropy_coef)
        width = int(np.prod(config.feature_shape or [0])) if through_convs \
            else self.features.feature_layer[0].shape[1]
        self.network = FrameDecoder(feature_map(config, width), config.frame_size,
                                    config.channels, config.global_channels, config.context,
                                    config.context_channels, config.num_actions,
                                    config.camera_motion)
        self._register_load_state_dict_pre_hook(_legacy_keys)

    def set_theta0(self, state: dict[str, np.ndarray]) -> None:
        self.features.set_theta0(state)

    def set_policy_head(self, weight: np.ndarray, bias: np.ndarray) -> None:
        self.action.set_policy_head(weight, bias)

    def fit_normaliser(self, features: torch.Tensor) -> None:
        self.network.fit_normaliser(features)

    def recovered_features(self, gradients: torch.Tensor) -> torch.Tensor:
        return self.features(gradients).to(self.network.feature_mean.device)

    def action_logits(self, gradients: torch.Tensor) -> torch.Tensor:
        return self.action(gradients)

    def forward(self, features: torch.Tensor, previous: torch.Tensor | None = None,
                previous_actions: torch.Tensor | None = None,
                has_previous: torch.Tensor | None = None) -> torch.Tensor:
        return self.network(features, previous, previous_actions, has_previous)

    def attack(self, gradients: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t = gradients.shape[:2]
        flat = gradients.reshape(-1, gradients.shape[-1]).float().cpu()
        features = self.recovered_features(flat)
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


def _legacy_keys(state: dict[str, torch.Tensor], prefix: str, *_: Any) -> None:
    """Renames a one-module decoder's tensors (`stem.0.weight`, `theta0.fc.bias`, ...) to the
    parts that now hold them, so its checkpoints still load."""
    for key in [k for k in state if k.startswith(prefix)]:
        head = key[len(prefix):].split(".")[0]
        if head in ("features", "action", "network"):
            continue
        part = LEGACY_PARTS.get(head, "network")
        state[f"{prefix}{part}.{key[len(prefix):]}"] = state.pop(key)
