"""The Conv → GroupNorm → ReLU block inverse: each step's input and group statistics from the
block's output, the gradient reaching it and the conv's weight gradient, exact to the
gradient's precision; the blocks whose input scale GroupNorm normalises away are refused."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradleak.errors import ConfigError
from gradleak.inversion.layers import Known
from gradleak.inversion.layers.group_norm import GroupNormBlock, GroupNormFit


@dataclass(frozen=True)
class Layer:
    name: str
    conv: nn.Conv2d
    input_shape: tuple[int, int]


def block(groups: int, bias: bool = True, seed: int = 0) -> tuple[Layer, nn.GroupNorm, nn.Linear]:
    torch.manual_seed(seed)
    conv = nn.Conv2d(8, 16, 3, 1, 1, bias=bias).double().requires_grad_(False)
    norm = nn.GroupNorm(groups, 16).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.2, 0.2)
    return Layer("conv", conv, (8, 8)), norm, nn.Linear(16 * 8 * 8, 5).double()


def one_step_each(layer: Layer, norm: nn.GroupNorm, head: nn.Linear, x: torch.Tensor
                  ) -> tuple[Known, torch.Tensor]:
    """Per step (one sample each): the block's output and the gradient reaching it, and the
    conv's weight gradient."""
    outputs, reaching, weight_gradients = [], [], []
    conv = layer.conv.requires_grad_(True)
    for step in range(len(x)):
        output = F.relu(norm(conv(x[step:step + 1])))
        loss = F.cross_entropy(head(output.flatten(1)), torch.tensor([step % 5]))
        weight_gradient, at_output = torch.autograd.grad(loss, [conv.weight, output])
        outputs.append(output.detach())
        reaching.append(at_output)
        weight_gradients.append(weight_gradient)
    conv.requires_grad_(False)
    value = torch.cat(outputs)
    return Known(value, torch.zeros_like(value), torch.cat(reaching)), torch.stack(weight_gradients)


def fitted(groups: int, wire: torch.dtype = torch.float64, steps: int = 3
           ) -> tuple[GroupNormFit, torch.Tensor, torch.Tensor, torch.Tensor]:
    layer, norm, head = block(groups)
    x = F.relu(torch.randn(steps, 8, 8, 8, dtype=torch.float64) * 0.5 + 0.1)
    at_output, weight_gradient = one_step_each(layer, norm, head, x)
    fit = GroupNormBlock(layer, norm).fit(
        at_output, {"conv.weight": weight_gradient.to(wire).double()}.__getitem__)
    outputs = layer.conv(x).reshape(steps, groups, -1)
    sd = (outputs.var(2, unbiased=False) + norm.eps).sqrt()
    return fit, x, outputs.mean(2), sd


def relative(estimate: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    return (estimate - truth).flatten(1).norm(dim=1) / truth.flatten(1).norm(dim=1)


@pytest.mark.parametrize("groups", [1, 4])
def test_each_steps_input_and_statistics_come_back_exactly(groups: int) -> None:
    fit, x, mean, sd = fitted(groups)
    assert float(relative(fit.input.value, x).max()) <= 1e-10
    assert float((fit.sd - sd).abs().max()) <= 1e-10 * float(sd.abs().max())
    assert float((fit.mean - mean).abs().max()) <= 1e-10 * float(mean.abs().max())
    assert float(fit.residual.max()) <= 1e-10


def test_a_float32_gradient_gives_the_input_to_float32_precision() -> None:
    fit, x, _, _ = fitted(4, wire=torch.float32)
    assert float(relative(fit.input.value, x).max()) <= 1e-5


def test_the_gradient_reaching_the_input_is_the_blocks_own() -> None:
    layer, norm, head = block(4)
    x = F.relu(torch.randn(1, 8, 8, 8, dtype=torch.float64) * 0.5 + 0.1).requires_grad_(True)
    output = F.relu(norm(layer.conv(x)))
    loss = F.cross_entropy(head(output.flatten(1)), torch.tensor([0]))  # one_step_each's
    (reaching,) = torch.autograd.grad(loss, [x])
    at_output, weight_gradient = one_step_each(layer, norm, head, x.detach())
    found = GroupNormBlock(layer, norm).invert(at_output,
                                               {"conv.weight": weight_gradient}.__getitem__)
    assert float(relative(found.gradient, reaching)) <= 1e-9


@pytest.mark.parametrize(("groups", "bias", "match"), [
    (16, True, "InstanceNorm"), (4, False, "without a bias")])
def test_a_block_whose_input_scale_is_normalised_away_is_refused(groups: int, bias: bool,
                                                                  match: str) -> None:
    layer, norm, _ = block(groups, bias=bias)
    with pytest.raises(ConfigError, match=match):
        GroupNormBlock(layer, norm)


def test_a_zero_gain_is_refused_naming_the_channels() -> None:
    layer, norm, _ = block(4)
    with torch.no_grad():
        norm.weight[3] = 0.0
    with pytest.raises(ConfigError, match=r"γ = 0 on channels \[3\]"):
        GroupNormBlock(layer, norm)
