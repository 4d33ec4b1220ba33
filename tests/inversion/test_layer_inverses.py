"""Each layer kind's inverse returns its input on a synthetic layer to float64 precision, and
the gradient reaching that input; the kinds the walk cannot pass say why, by name, before any
gradient is read."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from gradleak.errors import ConfigError
from gradleak.inversion.conv_blocks import conv_blocks
from gradleak.inversion.layers import LAYER_INVERSES, AffineNorm, Known, refusal_of
from gradleak.inversion.layers.conv import Conv
from gradleak.inversion.layers.invertible_activation import InvertibleActivation
from gradleak.inversion.layers.linear import Linear
from gradleak.inversion.layers.relu import MaskRule, Relu
from gradleak.victims import create_victim
from gradleak.victims.roles import KINDS


def relative(estimate: torch.Tensor, truth: torch.Tensor) -> float:
    return float((estimate - truth).norm() / truth.norm())


@dataclass(frozen=True)
class Layer:  # what the conv, norm and ReLU inverses read of a walk's block
    name: str
    conv: nn.Conv2d
    norm: nn.BatchNorm2d
    input_shape: tuple[int, int]


def per_sample_gradients(module: nn.Module, inputs: torch.Tensor, delta: torch.Tensor
                         ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each sample's parameter gradients for output gradient `delta`, and the gradient
    reaching each input."""
    grads: dict[str, list[torch.Tensor]] = {}
    reaching = []
    for x, d in zip(inputs, delta):
        x = x[None].clone().requires_grad_(True)
        module.zero_grad()
        module(x).backward(d[None])
        for name, parameter in module.named_parameters():
            grads.setdefault(name, []).append(parameter.grad.clone())
        reaching.append(x.grad[0])
    return {name: torch.stack(values) for name, values in grads.items()}, torch.stack(reaching)


def test_the_linear_inverse_returns_its_input_and_the_gradient_reaching_it() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(12, 5).double()
    x, delta = torch.randn(4, 12, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    grads, reaching = per_sample_gradients(layer, x, delta)
    found = Linear("fc", layer).invert(None, lambda name: grads[name.removeprefix("fc.")])
    assert relative(found.value, x) <= 1e-12
    assert relative(found.gradient, reaching) <= 1e-12
    assert float(found.noise.max()) <= 1e-12 * float(x.abs().max())


def test_the_affine_norm_inverse_returns_its_input_and_the_gradient_reaching_it() -> None:
    torch.manual_seed(1)
    norm = nn.BatchNorm2d(3).double().eval()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0), norm.bias.uniform_(-1, 1)
        norm.running_mean.uniform_(-1, 1), norm.running_var.uniform_(0.5, 2.0)
    r = torch.randn(2, 3, 5, 5, dtype=torch.float64).relu()
    delta = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    _, reaching = per_sample_gradients(norm, r, delta)
    layer = Layer("norm", nn.Conv2d(1, 3, 1), norm, (5, 5))
    found = AffineNorm(layer).invert(Known(norm(r).detach(), torch.zeros_like(r), delta))
    assert relative(found.value, r) <= 1e-12
    assert relative(found.gradient, reaching) <= 1e-12


def test_a_train_mode_batchnorms_inverse_carries_the_gradient_through_its_statistics(
        ) -> None:
    """One sample normalised by its own statistics (held in the buffers, the module left in
    train mode): the input back exactly, and the gradient reaching it as autograd's."""
    torch.manual_seed(4)
    norm = nn.BatchNorm2d(3).double()
    norm.weight.data.uniform_(0.5, 1.5)
    norm.bias.data.normal_(0, 0.3)
    r = torch.randn(1, 3, 5, 5, dtype=torch.float64).requires_grad_(True)
    y = norm.train()(r)
    delta = torch.randn_like(y)
    (reaching,) = torch.autograd.grad(y, r, delta)
    with torch.no_grad():
        norm.running_mean.copy_(r.mean((0, 2, 3)))
        norm.running_var.copy_(r.var((0, 2, 3), unbiased=False))
    layer = Layer("n", nn.Conv2d(1, 3, 1), norm, (5, 5))
    found = AffineNorm(layer).invert(Known(y.detach(), torch.zeros_like(y), delta))
    assert relative(found.value, r.detach()) <= 1e-12
    assert relative(found.gradient, reaching) <= 1e-12


def test_the_relu_inverse_keeps_the_on_units_and_masks_the_gradient() -> None:
    torch.manual_seed(2)
    pre = torch.randn(3, 4, 6, 6, dtype=torch.float64)
    delta = torch.randn_like(pre)
    conv = nn.Conv2d(2, 4, 3, padding=1).double()
    layer = Layer("c", conv, nn.BatchNorm2d(4), (6, 6))
    relu = Relu(MaskRule(None, rounds=0), layer, torch.zeros(3, 4, 2, 3, 3, dtype=torch.float64))
    found = relu.invert(Known(pre.relu(), torch.full_like(pre, 1e-9), delta))
    assert torch.equal(found.on, pre > 0)
    assert torch.equal(found.gradient, delta * (pre > 0))
    assert torch.equal(found.value[found.on], pre[pre > 0])


@pytest.mark.parametrize("module", [nn.LeakyReLU(0.1), nn.ELU(0.7), nn.Sigmoid(), nn.Tanh()],
                         ids=lambda module: type(module).__name__)
def test_a_one_to_one_activations_inverse_returns_every_unit_and_the_gradient(module) -> None:
    torch.manual_seed(5)
    pre = torch.randn(3, 4, 6, 6, dtype=torch.float64)
    pre.requires_grad_(True)
    output = module(pre)
    delta = torch.randn_like(output)
    (reaching,) = torch.autograd.grad(output, pre, delta)
    found = InvertibleActivation(module).invert(Known(output.detach(),
                                                      torch.zeros_like(delta), delta))
    assert bool(found.on.all())  # every pre-activation is an equation below
    assert relative(found.value, pre.detach()) <= 1e-12
    # (torch's LeakyReLU backward holds its slope in float32: 1.5e-9)
    assert relative(found.gradient, reaching) <= 1e-8
    assert relative(InvertibleActivation(module).forward(found.value), output.detach()) <= 1e-14


def test_the_conv_inverse_returns_its_input_and_the_gradient_reaching_it() -> None:
    """32 output channels × 9 taps = 288 equations per input channel for its 36 pixels."""
    torch.manual_seed(3)
    conv = nn.Conv2d(3, 32, 3, padding=1).double()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    delta = torch.randn(4, 32, 6, 6, dtype=torch.float64)
    grads, reaching = per_sample_gradients(conv, x, delta)
    layer = Layer("c", conv, nn.BatchNorm2d(32), (6, 6))
    found = Conv(layer).invert(Known(torch.zeros_like(delta), torch.zeros_like(delta), delta),
                               lambda name: grads[name.removeprefix("c.")])
    assert relative(found.value, x) <= 1e-10
    assert relative(found.gradient, reaching) <= 1e-12


def test_every_conv_stack_kind_has_an_inverse_or_a_stated_reason() -> None:
    kinds = {kind for name in LAYER_INVERSES for kind in LAYER_INVERSES.get(name).kinds}
    assert set(KINDS.values()) - {"flatten"} <= kinds
    assert "argmax switches" in refusal_of("maxpool", nn.MaxPool2d(2))
    assert refusal_of("groupnorm", nn.GroupNorm(2, 4)) is None  # in a Conv → GN → ReLU block
    assert "no layer inverse is registered for a gelu" in refusal_of("gelu", nn.GELU())
    assert refusal_of("leakyrelu", nn.LeakyReLU()) is None
    assert "one-to-one only where that is positive" in refusal_of("leakyrelu",
                                                                  nn.LeakyReLU(0.0))
    assert "no groups, no dilation" in refusal_of("conv", nn.Conv2d(2, 2, 3, dilation=2))
    assert refusal_of("conv", nn.Conv2d(2, 2, 3)) is None
    assert "running statistics" in refusal_of("batchnorm",
                                              nn.BatchNorm2d(2, track_running_stats=False))


def test_a_victim_the_walk_cannot_pass_is_refused_naming_the_module_and_why() -> None:
    with pytest.raises(ConfigError, match=r"cannot pass encoder\.\S+, a maxpool: max-pooling"):
        conv_blocks(create_victim("impala-small"))


def test_the_residual_inverse_walks_impalas_last_stage_exactly_where_it_is_determined() -> None:
    """From the FC gradient down both residual blocks of a random-init impala-small's last
    stage (float64 per-step gradients): each block's input comes back to float64 precision
    wherever relu(x) is on or the block's output is known, on most of the map."""
    from gradleak.inversion.layers.residual import ConvAt, ResidualBlock

    torch.manual_seed(0)
    victim = create_victim("impala-small").double().eval()
    frames = victim.example_inputs(batch=3, seed=3)[0].double()
    inputs: dict[str, torch.Tensor] = {}
    hooks = [module.register_forward_hook(
        lambda m, i, o, name=name: inputs.update({name: i[0].detach()}))
        for name, module in victim.named_modules() if type(module).__name__ == "ResidualBlock"]
    steps = []
    for k in range(len(frames)):
        victim.zero_grad()
        policy, value = victim(frames[k:k + 1])[:2]
        (policy.log_softmax(-1)[0, 1] * 0.7 + value.sum() * 0.3).backward()
        steps.append({n: p.grad.clone() for n, p in victim.named_parameters()})
    with torch.no_grad():
        victim(frames)
    for hook in hooks:
        hook.remove()
    gradients = {name: torch.stack([step[name] for step in steps]) for name in steps[0]}
    top = Linear("fc", victim.fc).invert(None, gradients.__getitem__)
    stage = victim.encoder[-1]
    channels = stage[0].out_channels
    side = int(round((top.value.shape[1] / channels) ** 0.5))
    u, g = top.value.view(3, channels, side, side), top.gradient.view(3, channels, side, side)
    on = u > 0
    known = Known(torch.where(on, u, torch.nan), torch.where(on, 0.0, torch.inf), g * on)
    for index in (4, 3):
        name = f"encoder.{len(victim.encoder) - 1}.{index}"
        block = victim.get_submodule(name)
        inverse = ResidualBlock(ConvAt(f"{name}.conv0", block.conv0, (side, side)),
                                ConvAt(f"{name}.conv1", block.conv1, (side, side)))
        known = inverse.invert(known, gradients.__getitem__)
        found = torch.isfinite(known.value)
        assert float(found.double().mean()) >= 0.6, name
        assert relative(known.value[found], inputs[name][found]) <= 1e-10, name


def test_dropout_and_identity_pass_through_the_walk() -> None:
    """A user's conv stack with Dropout2d and an Identity placeholder between its blocks is
    walked as if they were not there (a capture is taken in eval mode)."""
    import gradleak

    model = nn.Sequential(nn.Conv2d(3, 8, 4, 4), nn.ReLU(), nn.Dropout2d(0.2), nn.Identity(),
                          nn.Conv2d(8, 16, 3, 1, 1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(16 * 8 * 8, 32), nn.ReLU())

    class Policy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.pi, self.v = model, nn.Linear(32, 4), nn.Linear(32, 1)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.body(x)
            return self.pi(h), self.v(h)

    victim = gradleak.wrap(Policy(), policy_head="pi", value_head="v", frame_shape=(32, 32, 3))
    assert refusal_of("dropout2d", nn.Dropout2d()) is None
    assert [block.name for block in conv_blocks(victim)] == ["body.0", "body.4"]
