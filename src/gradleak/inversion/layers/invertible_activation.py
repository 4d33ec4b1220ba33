"""Activations that are one-to-one (LeakyReLU, ELU, sigmoid, tanh): below them every
pre-activation is known, not only the units a ReLU leaves on, so the conv beneath gets an
equation from every output unit and no on/off decision is needed. LeakyReLU: x = y where y > 0,
y / α elsewhere; ELU: x = log(1 + y / α) where y ≤ 0; sigmoid: x = log(y / (1 − y)); tanh:
x = atanh(y). The gradient reaching x is the output's times f'(x) (1 where x > 0; α, and y + α
for ELU, elsewhere; y(1 − y) for the sigmoid, 1 − y² for tanh); the noise on y is carried
through 1 / f'(x).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradleak.inversion.layers.base import GradientOf, Known, LayerInverse, register_layer_inverse

# ELU's output saturates at −α, the sigmoid's at 0 and 1, tanh's at ±1: a value within this
# fraction of its range from them says little of x, and its inverse is clamped there
ELU_FLOOR = 1e-6
SATURATION = 1e-12


@register_layer_inverse("invertible activation")
class InvertibleActivation(LayerInverse):
    """`module`, a LeakyReLU with a positive slope, an ELU with a positive α, a sigmoid or a
    tanh."""

    kinds = ("leakyrelu", "elu", "sigmoid", "tanh")
    module_types = (nn.LeakyReLU, nn.ELU, nn.Sigmoid, nn.Tanh)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @classmethod
    def refusal(cls, module: nn.Module) -> str | None:
        if isinstance(module, (nn.Sigmoid, nn.Tanh)):
            return None
        alpha = slope(module)
        if alpha is None or not alpha > 0:
            return (f"{type(module).__name__} with slope / α {alpha}: the walk inverts "
                    "activations one-to-one only where that is positive")
        return None

    def invert(self, at_output: Known, gradient_of: GradientOf | None = None) -> Known:
        y, alpha = at_output.value, slope(self.module)
        positive = y > 0
        if isinstance(self.module, nn.Sigmoid):
            y = y.clamp(SATURATION, 1 - SATURATION)
            x, derivative = torch.log(y) - torch.log1p(-y), y * (1 - y)
        elif isinstance(self.module, nn.Tanh):
            y = y.clamp(SATURATION - 1, 1 - SATURATION)
            x, derivative = torch.atanh(y), 1 - y * y
        elif isinstance(self.module, nn.ELU):
            floor = (ELU_FLOOR - 1) * alpha
            x = torch.where(positive, y, torch.log1p(y.clamp_min(floor) / alpha))
            derivative = torch.where(positive, 1.0, y.clamp_min(floor) + alpha)
        else:
            x = torch.where(positive, y, y / alpha)
            derivative = torch.where(positive, 1.0, alpha)
        return Known(x, at_output.noise / derivative, at_output.gradient * derivative,
                     at_output.rounding, on=torch.ones_like(positive))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The activation in float64."""
        if isinstance(self.module, nn.Sigmoid):
            return torch.sigmoid(x)
        if isinstance(self.module, nn.Tanh):
            return torch.tanh(x)
        alpha = slope(self.module)
        return F.elu(x, alpha) if isinstance(self.module, nn.ELU) else F.leaky_relu(x, alpha)


def slope(module: nn.Module) -> float | None:
    if isinstance(module, nn.LeakyReLU):
        return float(module.negative_slope)
    if isinstance(module, nn.ELU):
        return float(module.alpha)
    return None
