"""What the feature decoder reads from one step's gradient, in closed form, with no learning.

The features: the input of a Linear layer (x = ∇Wᵀ∇b/‖∇b‖², `inversion.closed_form`), or the
input of a conv module deeper down, reached by the recursion through θ0's conv stack
(`inversion.conv_recovery`). The action: the closed-form rule on the policy head's bias gradient
(`attacks.analytic`), exact on undefended streams.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from gradleak.attacks.analytic import actions_from_policy_bias
from gradleak.attacks.encoders import block, flat_linear_input
from gradleak.errors import ConfigError
from gradleak.inversion.closed_form import head_features, linear_input, linear_pairs
from gradleak.victims.base import LayerInfo
from gradleak.victims.roles import Roles

# The closed-form action is certain on clean streams; a large finite logit keeps softmax sane.
CERTAIN = 20.0

Pair = tuple[LayerInfo, LayerInfo]


def linear_layers(layers: dict[str, LayerInfo], needed: tuple[str, ...]) -> dict[str, Pair]:
    """(weight, bias) of each needed Linear module, or an error naming what the capture has."""
    pairs = {weight.name.removesuffix(".weight"): (weight, bias)
             for weight, bias in linear_pairs(list(layers.values()))}
    for module in needed:
        if module not in pairs:
            raise ConfigError(f"the feature decoder needs the gradients of Linear layer "
                              f"{module!r} with its bias; this capture has "
                              f"{', '.join(sorted(pairs)) or 'none'}")
    return {module: pairs[module] for module in needed}


def reads_through_convs(layers: dict[str, LayerInfo], module: str) -> bool:
    """Whether `module` is a conv (its input comes from the recursion), not a biased Linear."""
    linear = {w.name.removesuffix(".weight") for w, _ in linear_pairs(list(layers.values()))}
    weight = layers.get(f"{module}.weight")
    return module not in linear and len(getattr(weight, "shape", ())) == 4


class FeatureReadout(nn.Module):
    """One step's gradient → the input of `module`. A conv module needs θ0's victim (`theta0`,
    frozen: the recursion reads its conv, BN and FC weights)."""

    def __init__(self, layers: dict[str, LayerInfo], module: str, roles: Roles,
                 theta0: nn.Module | None) -> None:
        super().__init__()
        self.layers, self.module = layers, module
        self.through_convs = theta0 is not None
        linear = roles.feature_linear if self.through_convs else module
        self.feature_layer = linear_layers(layers, (linear,))[linear]
        if theta0 is not None:
            for parameter in theta0.parameters():
                parameter.requires_grad_(False)
            self.theta0 = theta0

    @torch.no_grad()
    def set_theta0(self, state: dict[str, np.ndarray]) -> None:
        if self.through_convs:
            self.theta0.load_state_dict({name: torch.from_numpy(np.asarray(value))
                                         for name, value in state.items()})

    def forward(self, gradients: torch.Tensor, chunk: int = 256) -> torch.Tensor:
        if not self.through_convs:
            return flat_linear_input(gradients, *self.feature_layer)
        from gradleak.inversion.conv_recovery import recover_conv_inputs

        parts = []
        for start in range(0, len(gradients), chunk):  # D is (chunk, C_out·k², pixels)
            rows = gradients[start:start + chunk].cpu()
            found = recover_conv_inputs(
                lambda name, rows=rows: block(rows, self.layers[name]).unflatten(
                    -1, self.layers[name].shape).double(),
                self.theta0, down_to=self.module)
            parts.append(found.inputs[self.module].flatten(1).float())
        return torch.cat(parts)


class ClosedFormAction(nn.Module):
    """One step's gradient → the action taken, as near-certain logits: π is θ0's policy head on
    the head's closed-form input h, the rule reads the head's bias gradient."""

    def __init__(self, policy: Pair, value: Pair, shared_features: bool, entropy_coef: float
                 ) -> None:
        super().__init__()
        self.policy_layer, self.value_layer = policy, value
        self.shared_features, self.entropy_coef = shared_features, entropy_coef
        shape = policy[0].shape
        self.register_buffer("policy_weight", torch.zeros(shape))  # θ0's head, for π
        self.register_buffer("policy_bias", torch.zeros(shape[0]))

    @torch.no_grad()
    def set_policy_head(self, weight: np.ndarray, bias: np.ndarray) -> None:
        self.policy_weight.copy_(torch.from_numpy(np.asarray(weight, np.float32)))
        self.policy_bias.copy_(torch.from_numpy(np.asarray(bias, np.float32)))

    def forward(self, gradients: torch.Tensor) -> torch.Tensor:
        """(N, d) → (N, K)."""
        def layer_input(weight: LayerInfo, bias: LayerInfo) -> torch.Tensor:
            return linear_input(block(gradients, weight).unflatten(-1, weight.shape).double(),
                                block(gradients, bias).double())

        hidden, _ = head_features(layer_input(*self.policy_layer),
                                  layer_input(*self.value_layer), self.shared_features)
        hidden = torch.nan_to_num(hidden, nan=0.0)  # no signal in either head: π of h = 0
        probs = torch.softmax(hidden @ self.policy_weight.double().T + self.policy_bias.double(),
                              -1)
        actions, _, _ = actions_from_policy_bias(
            block(gradients, self.policy_layer[1]).double().numpy(), probs.numpy(),
            self.entropy_coef)
        onehot = nn.functional.one_hot(torch.from_numpy(actions), len(self.policy_bias))
        return CERTAIN * (onehot.float() - 1.0)
