"""A pre-activation residual block, out = x + conv1(relu(conv0(relu(x)))) (IMPALA's): its input
from its two convs' weight gradients and what is known at its output.

The branch receives the block's output gradient g unchanged, so conv1's input b = relu(conv0(·))
comes from conv1's weight gradient with δ = g (`layers.conv`); b's on-units give δ at conv0's
output, conv1ᵀ g · [b > 0] (`layers.relu`), and conv0's input a = relu(x) comes from conv0's
weight gradient the same way. The block input is x = a wherever a is on; where it is off x ≤ 0,
and x = out − conv1(b) wherever the output is known. The gradient reaching x is the skip's g
plus conv0ᵀ δ₀ · [a > 0]. Each solve is exact wherever its D(δ) has full column rank (rank per
step: `layers.conv_equations.Gram`); entries nothing fixes come back NaN with infinite noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gradleak.inversion.layers.base import GradientOf, Known, LayerInverse, register_layer_inverse
from gradleak.inversion.layers.conv import Conv
from gradleak.inversion.layers.conv_equations import ConvLayer, convolve
from gradleak.inversion.layers.relu import MaskRule, Relu, margin_states

# b's and a's units: on beyond this many noise deviations (the fit's residual estimates it),
# settled against conv0's weight gradient in between
RESIDUAL_RULE = MaskRule(10.0, rounds=3)


@dataclass(frozen=True)
class ConvAt:
    """A conv module and the shape (H, W) of the map it reads."""

    name: str
    conv: nn.Conv2d
    input_shape: tuple[int, int]


@register_layer_inverse("residual block")
class ResidualBlock(LayerInverse):
    """`conv0` and `conv1` of one block (3×3, padding 1: the map keeps its size)."""

    kinds = ("residual",)

    def __init__(self, conv0: ConvLayer, conv1: ConvLayer, rule: MaskRule = RESIDUAL_RULE
                 ) -> None:
        self.conv0, self.conv1, self.rule = conv0, conv1, rule

    @classmethod
    def refusal(cls, module: nn.Module) -> str | None:
        convs = [m for m in module.children() if isinstance(m, nn.Conv2d)]
        if len(convs) != 2 or any(Conv.refusal(c) for c in convs) or any(
                c.kernel_size[0] != 2 * c.padding[0] + 1 or c.stride != (1, 1) for c in convs):
            return ("the residual inverse passes x + conv1(relu(conv0(relu(x)))) with two "
                    "biased, size-keeping convs")
        return None

    def invert(self, at_output: Known, gradient_of: GradientOf) -> Known:
        return self.parts(at_output, gradient_of).input

    @torch.no_grad()
    def parts(self, at_output: Known, gradient_of: GradientOf) -> ResidualParts:
        """What the block's walk knows at each of its points, from the top down."""
        g = at_output.gradient
        weight0 = gradient_of(f"{self.conv0.name}.weight")
        b = Conv(self.conv1).invert(Known(torch.zeros_like(g), torch.zeros_like(g), g),
                                    gradient_of)
        # b = relu(conv0 output): its on-units, settled against conv0's weight gradient
        branch = Relu(self.rule, self.conv0, weight0).invert(b)
        a = Conv(self.conv0).invert(branch, gradient_of)
        # a = relu(x): nothing below to settle with, the margin alone decides
        on, _ = margin_states(a, self.rule.margin or 0.0)
        rest = at_output.value - convolve(self.conv1, b.value.clamp_min(0))
        known_rest = torch.isfinite(at_output.value) & ~on
        value = torch.where(on, a.value, torch.where(known_rest, rest, torch.nan))
        noise = torch.where(on, a.noise, torch.where(known_rest, at_output.noise, torch.inf))
        return ResidualParts(branch, a, Known(value, noise, g + a.gradient * on, on=on))


@dataclass(frozen=True)
class ResidualParts:
    """conv0's output (its value b = conv1's input where on, and δ₀), conv0's input a =
    relu(x), and the block input x."""

    conv0_output: Known
    conv0_input: Known
    input: Known
