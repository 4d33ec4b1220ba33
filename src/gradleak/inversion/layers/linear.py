"""Linear: its input from its own gradient in closed form. On one sample ∇W = δ xᵀ and ∇b = δ,
so x = ∇Wᵀ∇b / ‖∇b‖² (`inversion.closed_form.linear_input`), and the gradient reaching x is
Wᵀ∇b. The residual of that rank-one fit estimates the noise on x (a defense, the wire's
rounding), which the ReLU below needs to decide its units. The walk starts here: the Linear
reading the conv stack's features needs nothing from above.
"""

from __future__ import annotations

import torch
from torch import nn

from gradleak.inversion.closed_form import linear_input
from gradleak.inversion.layers.base import GradientOf, Known, LayerInverse, register_layer_inverse

FLOAT64_CHUNK_BYTES = 16 << 20  # float64 temporaries within what malloc keeps for reuse


@register_layer_inverse("linear")
class Linear(LayerInverse):
    """The input of the biased Linear `name` (`module`), flat (N, in), its noise, and the
    gradient reaching it; what is known at its output is not needed."""

    kinds = ("linear",)
    module_types = (nn.Linear,)

    def __init__(self, name: str, module: nn.Linear) -> None:
        self.name, self.module = name, module

    @classmethod
    def refusal(cls, module: nn.Module) -> str | None:
        if isinstance(module, nn.Linear) and module.bias is None:
            return "a Linear layer without a bias: x = ∇Wᵀ∇b / ‖∇b‖² needs ∇b"
        return None

    def invert(self, at_output: Known | None, gradient_of: GradientOf) -> Known:
        bias_gradient = gradient_of(f"{self.name}.bias").double()
        x, noise = linear_input_with_noise(gradient_of(f"{self.name}.weight"), bias_gradient)
        upstream = bias_gradient @ self.module.weight.detach().double()
        return Known(x, noise, upstream)


def linear_input_with_noise(weight_gradient: torch.Tensor, bias_gradient: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """x = ∇Wᵀ∇b/‖∇b‖² (N, in), and its noise: the rank-one fit's residual per entry over ‖∇b‖.
    Storage rounding alone makes a unit that is exactly off come back as ±1e-7 (float32) or
    ±1e-3 (float16) after BN⁻¹, so even the top layer needs this margin. In float64, a few
    steps at a time from the stored (float32) rows: a float64 copy of many steps of a large FC
    gradient is beyond what glibc's malloc keeps for reuse, and mapping it afresh each time
    pays page faults that cost more than the fit."""
    size = max(1, FLOAT64_CHUNK_BYTES // (8 * max(1, weight_gradient.shape[1:].numel())))
    parts = [rank_one_fit(weight_gradient[start:start + size].double(),
                          bias_gradient[start:start + size].double())
             for start in range(0, max(1, len(bias_gradient)), size)]  # no steps: one empty
    return torch.cat([x for x, _ in parts]), torch.cat([noise for _, noise in parts])


def rank_one_fit(weight_gradient: torch.Tensor, bias_gradient: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear_input_with_noise` on float64 rows."""
    norm = (bias_gradient ** 2).sum(1, keepdim=True)
    x = torch.nan_to_num(linear_input(weight_gradient, bias_gradient), nan=0.0)
    # one fused product and a norm: the paper's FC gradient is 1.6M entries a step, and
    # forming (W − b xᵀ)² in separate passes took 2.5x as long
    residual = torch.baddbmm(weight_gradient, bias_gradient[:, :, None], x[:, None, :],
                             alpha=-1)
    outputs, inputs = weight_gradient.shape[1:]
    dof = max(1, outputs * inputs - outputs - inputs)
    squares = torch.linalg.vector_norm(residual, dim=(1, 2)) ** 2
    sigma = torch.nan_to_num((squares / dof / norm[:, 0]).sqrt())
    return x, sigma[:, None].expand_as(x)
