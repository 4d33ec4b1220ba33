"""BatchNorm (and the identity of a block without one): a known per-channel affine map
y = γ/σ · (r − μ) + β, inverted exactly. In eval mode μ and σ are the running statistics and the
gradient reaching r is the one reaching y times γ/σ. In train mode (a FedAvg client's step) one
sample is normalised by its own statistics over the map, which the caller reads off the running
buffers' change and puts in their place (the module then stays in train mode, to say so); the
gradient then carries their terms, γ/σ · (δ − mean δ − r̂ · mean(δ r̂)) with r̂ = (r − μ)/σ
(`through_batch_statistics`). The victim computed it in float32, so an input exactly 0 (an off
ReLU unit) comes back within a rounding bound of 0, which the ReLU's decisions must allow
for."""

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
    # statistics read off float32 buffers (train mode) carry their own error into r
    mean_error, var_error = statistics_error(block.norm)
    if mean_error is not None and var_error is not None:
        variance = block.norm.running_var.detach().double()[:, None, None] + block.norm.eps
        rounding = rounding + mean_error[:, None, None] \
            + (relu - mean).abs() * var_error[:, None, None] / (2 * variance)
    return relu, noise / gain.abs(), rounding, gain


def statistics_error(norm: nn.BatchNorm2d) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(C,) bounds on the error of the mean and variance a train-mode BatchNorm holds, where
    whoever put the sample's statistics there said them (`mean_error`, `var_error`)."""
    return getattr(norm, "mean_error", None), getattr(norm, "var_error", None)


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
        gradient = at_output.gradient
        if self.layer.norm.training:
            gradient = through_batch_statistics(gradient, normalised(self.layer.norm, relu))
        return Known(relu, noise, gradient * gain, rounding)


def normalised(norm: nn.BatchNorm2d, inputs: torch.Tensor) -> torch.Tensor:
    """(inputs − μ)/σ per channel, with the statistics the module holds."""
    sd = (norm.running_var.detach().double() + norm.eps).sqrt()[:, None, None]
    return (inputs - norm.running_mean.detach().double()[:, None, None]) / sd


def through_batch_statistics(delta: torch.Tensor, normalised: torch.Tensor) -> torch.Tensor:
    """(N, C, h, w): the gradient reaching a train-mode BatchNorm's input, over its gain γ/σ,
    from the one reaching its output (δ) and its normalised input r̂, one sample a step:
    δ − mean δ − r̂ · mean(δ r̂), means over each map. Where δ is 0 (an off ReLU unit above)
    r̂ does not enter the means."""
    first = delta.mean((-2, -1), keepdim=True)
    second = (delta * torch.where(delta != 0, normalised, 0.0)).mean((-2, -1), keepdim=True)
    return delta - first - normalised * second
