"""Per-step gradients: einsum and vmap equal the autograd loop, their mean equals the batch
gradient."""

from __future__ import annotations

import pytest
import torch

from gradleak.capture.grads import (
    RULES,
    StepBatch,
    StepGradients,
    _conv2d_by_correlation,
    _conv2d_by_grouped_gradient,
    batch_gradient,
    einsum_gradients,
    loop_gradients,
    per_step_gradients,
)
from gradleak.rl.losses import LossCoefficients
from gradleak.victims import create_victim, layer_table


def make_batch(n: int, size: int, generator: torch.Generator) -> StepBatch:
    return StepBatch(images=torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8,
                                          generator=generator),
                     actions=torch.randint(0, 5, (n,), generator=generator),
                     advantages=torch.randn(n, generator=generator),
                     returns=torch.randn(n, generator=generator),
                     old_log_probs=-torch.rand(n, generator=generator) - 1.0)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())


@pytest.mark.parametrize("name, size, ppo", [("cnn-small", 64, True), ("cnn-small", 32, False),
                                             ("cnn", 84, True)])
def test_vmap_equals_loop(name: str, size: int, ppo: bool) -> None:
    torch.manual_seed(1)
    victim = create_victim(name, frame_size=size).eval()
    victim.encoder[2].running_var.fill_(2.0)  # eval-mode BatchNorm with non-trivial statistics
    batch, layers = make_batch(6, size, torch.Generator().manual_seed(2)), layer_table(victim)
    vmapped = per_step_gradients(victim, batch, LossCoefficients(), layers, ppo=ppo, chunk=4)
    summed = einsum_gradients(victim, batch, LossCoefficients(), layers, ppo=ppo, chunk=4)
    looped = loop_gradients(victim, batch, LossCoefficients(), layers, ppo=ppo)
    assert vmapped.shape == summed.shape == (6, sum(layer.size for layer in layers))
    assert relative_error(vmapped, looped) <= 1e-5
    assert relative_error(summed, looped) <= 1e-5


def test_einsum_reuses_its_buffer_and_zeroes_what_the_loss_never_reaches() -> None:
    """The buffer is overwritten call after call (a stale row would leak the last batch in);
    a layer outside the loss (the value head when c_v = 0) gets zeros, as autograd gives."""
    torch.manual_seed(6)
    victim = create_victim("cnn-small", frame_size=32).eval()
    layers, method = layer_table(victim), StepGradients("einsum", chunk=3)
    no_value = LossCoefficients(value=0.0)
    for seed in (7, 8):
        batch = make_batch(5, 32, torch.Generator().manual_seed(seed))
        method.buffer = None if seed == 7 else method.buffer.fill_(float("nan"))
        rows = method(victim, batch, no_value, layers)
        assert relative_error(rows, loop_gradients(victim, batch, no_value, layers)) <= 1e-5
    value = next(layer for layer in layers if layer.name == "value_head.weight")
    assert bool((rows[:, value.offset:value.offset + value.size] == 0).all())
    assert StepGradients("auto").resolve(victim, layers) == "einsum"
    with pytest.raises(ValueError, match="expected one of auto, einsum, vmap, loop"):
        StepGradients("opacus")


def test_reserved_buffers_are_the_ones_the_first_episode_fills() -> None:
    """A capture reserves (allocates and touches) the buffers while it waits for its first
    episode: that episode's rows land in them, no new allocation, with the rows an
    unreserved method gives; a factored layout's factors too."""
    torch.manual_seed(6)
    victim = create_victim("cnn-small", frame_size=32).eval()
    layers = layer_table(victim)
    factored = ["fc.weight", "policy_head.weight"]
    batch = make_batch(5, 32, torch.Generator().manual_seed(9))
    reserved, fresh = (StepGradients("einsum", chunk=2, factored=factored) for _ in range(2))
    reserved.reserve(victim, layers, steps=7)
    buffer, packed = reserved.buffer.data_ptr(), reserved.packed.data_ptr()
    rows, expected = (method(victim, batch, LossCoefficients(), layers)
                      for method in (reserved, fresh))
    assert reserved.buffer.data_ptr() == buffer and reserved.packed.data_ptr() == packed
    assert torch.equal(rows.dense, expected.dense) and torch.equal(rows.packed, expected.packed)
    vmapped = StepGradients("vmap")
    vmapped.reserve(victim, layers, steps=7)  # nothing to reserve: its rows are new each call
    assert vmapped.buffer is None


def test_mean_of_per_step_gradients_is_the_batch_gradient() -> None:
    torch.manual_seed(3)
    victim = create_victim("cnn-small", frame_size=32).eval()
    batch, layers = make_batch(10, 32, torch.Generator().manual_seed(4)), layer_table(victim)
    per_step = per_step_gradients(victim, batch, LossCoefficients(), layers, chunk=3)
    whole = batch_gradient(victim, batch, LossCoefficients(), layers)
    assert relative_error(per_step.mean(0), whole) <= 1e-5


def test_chunk_size_and_component_subset_do_not_change_values() -> None:
    victim = create_victim("cnn-small", frame_size=32).eval()
    batch = make_batch(7, 32, torch.Generator().manual_seed(5))
    full_layers, head_layers = layer_table(victim), layer_table(victim, ("heads",))
    full = per_step_gradients(victim, batch, LossCoefficients(), full_layers, chunk=7)
    heads = per_step_gradients(victim, batch, LossCoefficients(), head_layers, chunk=2)
    start = next(layer.offset for layer in full_layers if layer.name == "policy_head.weight")
    assert relative_error(full[:, start:], heads) <= 1e-5  # batch size changes conv kernels


def test_training_mode_is_refused() -> None:
    victim = create_victim("cnn-small", frame_size=32)  # nn.Module starts in training mode
    batch = make_batch(2, 32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="victim.eval"):
        per_step_gradients(victim, batch, LossCoefficients(), layer_table(victim))


@pytest.mark.parametrize("kernel, stride, padding, dilation", [
    ((8, 8), 4, 0, 1), ((3, 5), (2, 1), (1, 2), 1), (3, 3, 1, 2), ((4, 2), 2, 0, (1, 3))])
def test_the_conv_rule_is_each_steps_own_weight_gradient(kernel, stride, padding,
                                                         dilation) -> None:
    """The conv rule, and each of its forms (the steps as the groups of one convolution's
    weight gradient; the correlation with the steps as groups, stride and dilation swapped),
    on rectangular kernels, padding, dilation and a stride that leaves rows over: each step's
    weight (and the rule's bias) gradient as autograd gives it for that step alone."""
    torch.manual_seed(3)
    conv = torch.nn.Conv2d(3, 5, kernel, stride, padding, dilation)
    inputs = torch.randn(4, 3, 23, 21)
    deltas = torch.randn_like(conv(inputs))
    for form in (RULES[torch.nn.Conv2d], _conv2d_by_grouped_gradient, _conv2d_by_correlation):
        out = {"weight": torch.empty(4, *conv.weight.shape), "bias": torch.full((4, 5), 7.0)}
        form(conv, inputs, deltas, out)
        for step in range(4):
            weight, bias = torch.autograd.grad(conv(inputs[step:step + 1]),
                                               [conv.weight, conv.bias], deltas[step:step + 1])
            checked = [(out["weight"][step], weight)]
            checked += [(out["bias"][step], bias)] if form is RULES[torch.nn.Conv2d] else []
            # float32 sums over a few hundred positions: rounding relative to the largest entry
            for ours, reference in checked:
                assert torch.allclose(ours, reference, rtol=1e-5,
                                      atol=1e-6 * float(reference.abs().max()))
