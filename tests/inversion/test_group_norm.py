"""The Conv → GroupNorm → ReLU block inverse: each step's input and group statistics from the
block's output, the gradient reaching it and the conv's weight gradient, exact to the
gradient's precision; the blocks whose input scale GroupNorm normalises away are refused."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradleak
from gradleak.attacks.exact import first_block
from gradleak.errors import ConfigError
from gradleak.fedavg.forward import identity
from gradleak.fedavg.walk import plan_walk
from gradleak.inversion.conv_recovery import recover_conv_inputs
from gradleak.inversion.layers import Known
from gradleak.inversion.layers.gauss_newton import gauss_newton
from gradleak.inversion.layers.group_norm import BlockEquations, GroupNormBlock, GroupNormFit


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


def test_the_gradients_reaching_the_conv_output_and_input_are_the_blocks_own() -> None:
    """What the walk hands on: the conv's output at the on-units and the gradient reaching it
    (`invert`, the GroupNorm's inverse), and the gradient reaching the conv's input."""
    layer, norm, head = block(4)
    x = F.relu(torch.randn(1, 8, 8, 8, dtype=torch.float64) * 0.5 + 0.1).requires_grad_(True)
    conv_output = layer.conv(x)
    output = F.relu(norm(conv_output))
    loss = F.cross_entropy(head(output.flatten(1)), torch.tensor([0]))  # one_step_each's
    at_conv, reaching = torch.autograd.grad(loss, [conv_output, x])
    at_output, weight_gradient = one_step_each(layer, norm, head, x.detach())
    gradient_of = {"conv.weight": weight_gradient}.__getitem__
    inverse = GroupNormBlock(layer, norm)
    known = inverse.invert(at_output, gradient_of)
    on = known.on
    assert on is not None and bool(on.any())
    assert float(relative(known.value[on][None], conv_output.detach()[on][None])) <= 1e-10
    assert float(relative(known.gradient, at_conv)) <= 1e-9
    found = inverse.fit(at_output, gradient_of).input
    assert float(relative(found.gradient, reaching)) <= 1e-9


def test_an_input_its_weight_gradient_leaves_short_comes_back_with_the_outputs() -> None:
    """The joint solve (for a network's input under its first block, which the weight gradient
    alone leaves short of equations) gives the same input, in float64 exactly."""
    layer, norm, head = block(4)
    x = F.relu(torch.randn(2, 8, 8, 8, dtype=torch.float64) * 0.5 + 0.1)
    at_output, weight_gradient = one_step_each(layer, norm, head, x)
    fit = GroupNormBlock(layer, norm).fit(at_output, {"conv.weight": weight_gradient}.__getitem__,
                                          jointly=True)
    assert float(relative(fit.input.value, x).max()) <= 1e-10
    assert float(fit.residual.max()) <= 1e-10


def test_the_blocks_equations_bring_back_an_input_shrunk_towards_zero() -> None:
    """The block's equations in its input alone hold at the true input, and from the input
    shrunk 100× (where the first solve can land when the conv's bias varies little within a
    group: GroupNorm then normalises the scale nearly away) Gauss-Newton on them returns it."""
    layer, norm, head = block(4)
    x = F.relu(torch.randn(2, 8, 8, 8, dtype=torch.float64) * 0.5 + 0.1)
    at_output, weight_gradient = one_step_each(layer, norm, head, x)
    on = at_output.value > 0
    equations = BlockEquations(layer, norm, at_output.value, on, at_output.gradient,
                               weight_gradient)
    assert float(equations.residual(x).abs().max()) <= 1e-14
    found, steps = gauss_newton(equations.residual, 0.01 * x)
    assert float(relative(found, x).max()) <= 1e-10
    assert bool((steps > 1).all())


def test_units_on_by_less_than_the_walk_could_call_are_found_by_the_weight_gradient() -> None:
    """A unit on by a hair that the walk's margin left off takes its δ_o out of the weight
    gradient; at the true input the units whose contributions explain the miss are exactly
    those (not the off units offered beside them), and the fit given them as undecided
    returns the input."""
    layer, norm, head = block(4)
    x = F.relu(torch.randn(1, 8, 8, 8, dtype=torch.float64) * 0.5 + 0.1)
    at_output, weight_gradient = one_step_each(layer, norm, head, x)
    a = at_output.value
    positive = a[a > 0].sort().values
    margin = float(positive[3])  # the four smallest on-units fall below it
    on = a > margin
    dropped = (a > 0) & ~on
    off = (a == 0) & (torch.arange(a.numel()).reshape(a.shape) % 7 == 0)
    equations = BlockEquations(layer, norm, a, on, at_output.gradient, weight_gradient)
    assert torch.equal(equations.flipped_units(x, dropped | off, 1), dropped)
    fit = GroupNormBlock(layer, norm).fit(replace(at_output, on=on),
                                          {"conv.weight": weight_gradient}.__getitem__,
                                          undecided=a.abs() <= margin)
    assert float(relative(fit.input.value, x).max()) <= 1e-10
    assert torch.equal(fit.output.on, a > 0)


def test_units_called_on_that_are_off_are_taken_off_by_the_weight_gradient() -> None:
    """The mirror: units off in truth that the walk called on (their estimates noise just past
    its margin) put a δ_o into the weight gradient that is not there; at the true input the
    units whose contributions the miss has no room for are exactly those (not the truly-on
    units doubted beside them), and the fit given them as doubtful returns the input."""
    layer, norm, head = block(4)
    x = F.relu(torch.randn(1, 8, 8, 8, dtype=torch.float64) * 0.5 + 0.1)
    at_output, weight_gradient = one_step_each(layer, norm, head, x)
    a = at_output.value
    spurious = torch.zeros_like(a, dtype=torch.bool)
    spurious.view(-1)[(a == 0).view(-1).nonzero()[[5, 300]]] = True
    weakest = a[a > 0].sort().values[3]
    on = (a > 0) | spurious
    doubtful = spurious | ((a > 0) & (a <= weakest))
    equations = BlockEquations(layer, norm, a, on, at_output.gradient, weight_gradient)
    assert torch.equal(equations.flipped_units(x, doubtful, -1), spurious)
    fit = GroupNormBlock(layer, norm).fit(replace(at_output, on=on),
                                          {"conv.weight": weight_gradient}.__getitem__,
                                          doubtful=doubtful)
    assert float(relative(fit.input.value, x).max()) <= 1e-10
    assert torch.equal(fit.output.on, a > 0)


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


def test_the_walk_passes_groupnorm_blocks_with_each_steps_own_statistics() -> None:
    """Down a conv stack (`inversion.conv_recovery`), three steps at once, each normalised by
    its own statistics: every conv input above the first block comes back exactly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 16, 5, 2, 2), nn.ReLU(), nn.Conv2d(16, 32, 3, 1, 1),
                          nn.GroupNorm(4, 32), nn.ReLU(), nn.Conv2d(32, 32, 3, 1, 1),
                          nn.GroupNorm(8, 32), nn.ReLU(), nn.Flatten(),
                          nn.Linear(32 * 8 * 8, 10)).double()
    network = plan_walk(model, (1, 16, 16), identity, 1, 1, "sgd", "eval").network
    images = torch.rand(3, 1, 16, 16, dtype=torch.float64)
    gradients: dict[str, list[torch.Tensor]] = {}
    inputs: dict[str, list[torch.Tensor]] = {"2": [], "5": []}
    hooks = [network.model.get_submodule(name).register_forward_hook(
        lambda _module, given, _out, name=name: inputs[name].append(given[0].detach()))
        for name in inputs]
    for step in range(3):
        loss = F.cross_entropy(network.model(images[step:step + 1]), torch.tensor([step]))
        for name, value in zip(dict(network.model.named_parameters()),
                               torch.autograd.grad(loss, list(network.model.parameters())),
                               strict=True):
            gradients.setdefault(name, []).append(value)
    for hook in hooks:
        hook.remove()
    found = recover_conv_inputs(lambda name: torch.stack(gradients[name]), network, "2")
    for name, truth in inputs.items():
        assert float(relative(found.inputs[name], torch.cat(truth)).max()) <= 1e-8


class GroupedPolicy(nn.Module):
    """A user's policy whose first conv block normalises by GroupNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 4, 4), nn.GroupNorm(4, 16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, 1, 1), nn.ReLU(), nn.Flatten(),
                                  nn.Linear(16 * 8 * 8, 32), nn.ReLU())
        self.pi, self.v = nn.Linear(32, 4), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.pi(h), self.v(h)


def test_the_rl_frame_solve_refuses_a_first_block_with_groupnorm_up_front() -> None:
    victim = gradleak.wrap(GroupedPolicy(), policy_head="pi", value_head="v",
                           frame_shape=(32, 32, 3))
    with pytest.raises(ConfigError, match="first conv block normalises each step by its own "
                                          "GroupNorm statistics"):
        first_block(victim)
