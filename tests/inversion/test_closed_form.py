"""The closed form x = ∇Wᵀ∇b/‖∇b‖², one implementation for every attack."""

from __future__ import annotations

import torch

from gradleak.inversion.closed_form import head_features, linear_input


def test_a_linear_layers_input_comes_back_from_its_one_sample_gradient() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(7, 4).double()
    x = torch.randn(3, 7, dtype=torch.float64)
    rows = []
    for sample in x:
        layer.zero_grad()
        layer(sample[None]).pow(2).sum().backward()
        rows.append((layer.weight.grad.clone(), layer.bias.grad.clone()))
    weight, bias = (torch.stack(parts) for parts in zip(*rows, strict=True))
    assert torch.allclose(linear_input(weight, bias), x, atol=1e-12)
    bias[1] = 0.0  # nothing flowed back: the gradient says nothing, and the result says so
    recovered = linear_input(weight, bias)
    assert torch.isnan(recovered[1]).all() and torch.isfinite(recovered[[0, 2]]).all()


def test_a_silent_policy_head_borrows_the_value_heads_input_only_when_they_share_it() -> None:
    policy = torch.tensor([[1.0, 2.0], [float("nan"), float("nan")]])
    value = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    shared, _ = head_features(policy, value, shared=True)
    assert shared[1].tolist() == [3.0, 4.0]
    separate, value_h = head_features(policy, value, shared=False)
    assert torch.isnan(separate[1]).all() and value_h is value
