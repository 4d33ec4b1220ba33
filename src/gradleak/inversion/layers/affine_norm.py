"""BatchNorm in eval mode (and the identity of a block without one): a known per-channel
affine map y = γ/σ · (r − μ) + β, inverted exactly. The gradient reaching r is the one reaching
y times γ/σ. The victim computed it in float32, so an input exactly 0 (an off ReLU unit) comes
back within a rounding bound of 0, which the ReLU's decisions must allow for."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from gradleak.inversion.layers.base import GradientOf, Known, LayerInverse, register_layer_inverse


class NormedLayer(Protocol):
    """A layer followed by its normalisation (the walk's `ConvBlock` is one)."""

    name: str
    norm: nn.BatchNorm2d


def identity_norm(channels: int) -> nn.BatchNorm2d:
    """The affine map of a block without normalisation: γ = 1, β = 0, μ = 0, σ = 1 exactly."""
    return nn.BatchNorm2d(channels, eps=0.0).eval()


def bn_inverse(block: NormedLayer, y: torch.Tensor, noise: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ReLU output under BN, its noise deviation, the bound on BN's rounding, BN's gain."""
    gain, shift, mean = bn_affine(block)
    relu = y / gain - shift + mean
    # The victim computed BN in float32: an off unit comes back as ±1e-7 of the terms summed.
    rounding = 1e-6 * (relu.flatten(1).abs().amax(1)[:, None, None, None] + shift.abs()
                       + mean.abs())
    return relu, noise / gain.abs(), rounding, gain


def bn_affine(block: NormedLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`block.norm` (eval mode) as y = gain · (r − mean + shift): (C, 1, 1) gain, shift and
    mean."""
    return norm_affine(block.norm)


def norm_affine(norm: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BN (eval mode) as y = gain · (r − mean + shift): (C, 1, 1) gain, shift and mean."""
    sd = (norm.running_var.detach().double() + norm.eps).sqrt()
    weight = torch.ones_like(sd) if norm.weight is None else norm.weight.detach().double()
    bias = torch.zeros_like(sd) if norm.bias is None else norm.bias.detach().double()
    gain = (weight / sd)[:, None, None]
    shift = bias[:, None, None] / gain
    mean = norm.running_mean.detach().double()[:, None, None]
    return gain, shift, mean


@register_layer_inverse("affine normalisation")
class AffineNorm(LayerInverse):
    """`layer.norm` inverted: its input r, r's noise (the output's over |γ/σ|) and rounding
    bound, and the gradient reaching r. Its parameters' gradients are not needed."""

    kinds = ("batchnorm",)
    module_types = (nn.BatchNorm2d,)

    def __init__(self, layer: NormedLayer) -> None:
        self.layer = layer

    @classmethod
    def refusal(cls, module: nn.Module) -> str | None:
        if isinstance(module, nn.BatchNorm2d) and not module.track_running_stats:
            return ("BatchNorm without running statistics normalises each batch by its own: "
                    "two unknowns per channel and step that the walk does not solve")
        return None

    def invert(self, at_output: Known, gradient_of: GradientOf | None = None) -> Known:
        relu, noise, rounding, gain = bn_inverse(self.layer, at_output.value, at_output.noise)
        return Known(relu, noise, at_output.gradient * gain, rounding)
