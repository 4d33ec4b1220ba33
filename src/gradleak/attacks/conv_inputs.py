"""The walk down the conv stack (`gradleak.inversion.conv_recovery`) on what the server holds
of a captured RL step: the observation's per-step gradients and θ0."""

from __future__ import annotations

import torch

from gradleak.errors import ConfigError
from gradleak.inversion.conv_recovery import (
    DEEPEST_RULES,
    MASK_RULES,
    ConvInputs,
    recover_conv_inputs,
)
from gradleak.inversion.layers.relu import MaskRule
from gradleak.threat import Observation
from gradleak.victims.base import victim_at_theta0


def observed_conv_inputs(observation: Observation, down_to: str | None = None,
                         rules: tuple[MaskRule, ...] = MASK_RULES,
                         deepest_rules: tuple[MaskRule, ...] = DEEPEST_RULES) -> ConvInputs:
    """`recover_conv_inputs` on what the server holds: the observation's gradients and θ0."""
    victim = victim_at_theta0(observation).double()

    def gradient_of(name: str) -> torch.Tensor:
        try:
            return torch.from_numpy(observation.block(name))  # as stored: float64 per use
        except KeyError:
            raise ConfigError(f"recovery through the conv stack needs the gradient of {name}: "
                              "capture with --components including 'cnn' and 'fc'") from None

    return recover_conv_inputs(gradient_of, victim, down_to, rules, deepest_rules)
