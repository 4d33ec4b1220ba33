"""The one closed form every attack builds on: a Linear layer's input from its own gradient.

A Linear layer y = W x + b on one sample has ∇W = δ xᵀ and ∇b = δ, so its input is
x = ∇Wᵀ∇b / ‖∇b‖² (least squares over the rows: exact without noise, the robust estimate with
it). Where ∇b is exactly zero nothing flowed back through the layer at that step and the
gradient says nothing of x: such rows come back as NaN, and each caller decides what stands in
(the value head's input for the policy head's, zeros for a learned attacker's features).
"""

from __future__ import annotations

import torch

from gradleak.victims.base import LayerInfo


def linear_input(weight_gradient: torch.Tensor, bias_gradient: torch.Tensor) -> torch.Tensor:
    """(..., out, in), (..., out) → (..., in): x = ∇Wᵀ∇b/‖∇b‖², NaN where ∇b is exactly 0."""
    norm = bias_gradient.pow(2).sum(-1, keepdim=True)
    inputs = torch.einsum("...o,...oi->...i", bias_gradient, weight_gradient)
    return torch.where(norm > 0, inputs / torch.where(norm > 0, norm, 1), torch.nan)


def linear_pairs(layers: list[LayerInfo]) -> list[tuple[LayerInfo, LayerInfo]]:
    """(weight, bias) of every Linear layer whose weight (2-D) and bias gradients are both in
    the layer table, in table order."""
    by_name = {layer.name: layer for layer in layers}
    return [(layer, by_name[layer.name.removesuffix("weight") + "bias"]) for layer in layers
            if layer.name.endswith(".weight") and len(layer.shape) == 2
            and layer.name.removesuffix("weight") + "bias" in by_name]


def head_features(policy_input: torch.Tensor, value_input: torch.Tensor, shared: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h for the policy head, h for the value head). When both heads read one h, a step
    whose policy-bias gradient is exactly zero (A = 0 and no entropy term) still has it from
    the value head, and the other way round."""
    if not shared:
        return policy_input, value_input
    missing = ~torch.isfinite(policy_input).all(-1, keepdim=True)
    features = torch.where(missing, value_input, policy_input)
    return features, features
