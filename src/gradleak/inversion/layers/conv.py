"""Conv: its input from its own weight gradient. On one sample ∇W = Σ_p δ(p) ⊗ patch_p(a) is
linear in the input a given δ (the gradient at the conv's output), one least squares per input
channel on the shared matrix D(δ) (`layers.conv_equations`): exact wherever D has as many
independent rows as a channel has pixels. Where D has a null space, the layer's known outputs
(its pre-activations at the on-units) and the inequalities from the layer below fill it in
(`layers.null_space`). The gradient reaching the input is conv_transpose(δ, W), exact given δ.
The noise of the input is estimated from the fit's residual, so the ReLU below can tell a unit
near 0 from one that is off.
"""

from __future__ import annotations

import torch
from torch import nn

from gradleak.inversion.layers.affine_norm import NormedLayer
from gradleak.inversion.layers.base import GradientOf, Known, LayerInverse, register_layer_inverse
from gradleak.inversion.layers.conv_equations import (
    ConvLayer,
    DenseOperator,
    Gram,
    InputFit,
    TapOperator,
    as_map,
    covered_pixels,
    input_patches,
    inverse_diagonal,
    solve_least_squares,
)
from gradleak.inversion.layers.null_space import (
    NULL_TOLERANCE,
    KnownOutputs,
    complete_from_outputs,
)


@register_layer_inverse("conv")
class Conv(LayerInverse):
    """`layer`'s input from its weight gradient and the δ in `at_output.gradient`. Where
    `at_output` says which units are on (`on`, with their pre-activations in `value`), those
    fill in D's null space, with the inequalities of `below` (the layer whose ReLU → norm
    output the input is; None: none)."""

    kinds = ("conv",)
    module_types = (nn.Conv2d,)

    def __init__(self, layer: ConvLayer, below: NormedLayer | None = None) -> None:
        self.layer, self.below = layer, below

    @classmethod
    def refusal(cls, module: nn.Module) -> str | None:
        if not isinstance(module, nn.Conv2d):
            return f"a {type(module).__name__}, not an nn.Conv2d"
        found = [what for what, wrong in (
            (f"groups={module.groups}", module.groups != 1),
            (f"dilation={module.dilation}", module.dilation != (1, 1)),
            (f"kernel {module.kernel_size}", len(set(module.kernel_size)) != 1),
            (f"stride {module.stride}", len(set(module.stride)) != 1)) if wrong]
        if found:
            return (f"{', '.join(found)}: the walk passes plain convolutions with square "
                    "kernels and strides (no groups, no dilation)")
        return None

    def invert(self, at_output: Known, gradient_of: GradientOf) -> Known:
        layer, delta = self.layer, at_output.gradient
        outputs = None if at_output.on is None else KnownOutputs(at_output.value, at_output.on,
                                                                 self.below)
        y, noise, completed = solve_input_with_noise(layer, delta,
                                                     gradient_of(f"{layer.name}.weight"),
                                                     outputs)
        upstream = torch.nn.grad.conv2d_input(y.shape, layer.conv.weight.detach().double(), delta,
                                              stride=layer.conv.stride,
                                              padding=layer.conv.padding)
        return Known(y, noise, upstream, completed=completed)


# nor is the completion for more null-space coefficients (C_in · nullity) than this
MAX_COEFFICIENTS = 512


# D's null space is looked for only on blocks with at most this many input pixels a channel:
# the check costs as much as the solve itself, and the null spaces met are all on the top
# block (docs/training-free.md)
NULL_CHECK_PIXELS = 256


# the noise given to input units no equation fixes, times the map's largest value
UNDETERMINED_SPREAD = 1e3
# the least noise of an input completed from its outputs, times the map's largest value: the
# completion's active-set solve carries an error the fit's residual does not show, and the
# block below must not take units within it of 0 as surely on or off
COMPLETION_NOISE = 1e-5


def least_squares(block: ConvLayer, delta: torch.Tensor, weight_gradient: torch.Tensor,
                  outputs: KnownOutputs | None = None) -> InputFit:
    """The input by least squares on D(δ), zero at the pixels no output reads (zero columns
    otherwise, every step rank-deficient). Where D itself is rank-deficient, `outputs` sets
    the part of the input in its null space (`complete_from_outputs`)."""
    count, channels_in = len(delta), block.conv.in_channels
    read = covered_pixels(block)
    operator = TapOperator.of(block, delta)
    rhs = weight_gradient.permute(0, 1, 3, 4, 2).reshape(count, -1, channels_in)
    solution = torch.zeros(count, len(read), channels_in, dtype=delta.dtype)
    gram = Gram.of(operator)
    completing = torch.zeros(count, dtype=torch.bool)
    if outputs is not None and operator.shape[-1] <= NULL_CHECK_PIXELS:
        completing = completable(gram, channels_in)
    # the completion solves its steps from D's own SVD, minimum norm and null part alike
    rest = (~completing).nonzero().flatten()
    if len(rest) == count:
        solution[:, read] = solve_least_squares(operator, rhs, gram=gram)
    elif len(rest):
        columns = solution[:, read]
        columns[rest] = solve_least_squares(operator.take(rest), rhs[rest], gram=gram.take(rest))
        solution[:, read] = columns
    fit = InputFit(operator, rhs, solution, gram)
    if not bool(completing.any()):
        return fit
    assert outputs is not None
    return complete_from_outputs(block, fit, outputs, completing)


def completable(gram: Gram, channels_in: int) -> torch.Tensor:
    """(N,) the steps whose D(δ) has a null space the outputs can fix. A δ this sparse, with
    more null coefficients than MAX_COEFFICIENTS, means the masks above collapsed (a defense's
    noise): the outputs cannot fix so many directions, and those steps keep the minimum-norm
    solve."""
    nullity = torch.zeros(len(gram.spread), dtype=torch.long)
    unsure = ~gram.well_posed
    if bool(unsure.any()):
        nullity[unsure] = null_space_size(gram.matrix[unsure])
    return (nullity > 0) & (nullity * channels_in <= MAX_COEFFICIENTS)


def null_space_size(gram: torch.Tensor) -> torch.Tensor:
    """(N,) D's nullity from its Gram matrix's eigenvalues, at a quarter of an SVD's cost
    (σ² squares the gap between the null directions and the rest)."""
    eigenvalues = torch.linalg.eigvalsh(gram)
    return (eigenvalues < NULL_TOLERANCE ** 1.5 * eigenvalues[:, -1:]).sum(1)


def solve_input(block: ConvLayer, delta: torch.Tensor, weight_gradient: torch.Tensor,
                outputs: KnownOutputs | None = None) -> torch.Tensor:
    """The conv's input by least squares."""
    return as_map(block, least_squares(block, delta, weight_gradient, outputs).solution)


def fitted_output_gradient(block: ConvLayer, inputs: torch.Tensor,
                           weight_gradient: torch.Tensor) -> torch.Tensor:
    """(N, C_out, h, w) the δ that best explains the weight gradient given the input: C_in·k²
    equations per output channel for its h·w positions."""
    patches = input_patches(block, inputs)
    fitted = solve_least_squares(DenseOperator(patches),
                                 weight_gradient.flatten(2).transpose(1, 2))
    conv = block.conv
    height, width = ((size + 2 * conv.padding[i] - conv.kernel_size[i]) // conv.stride[i] + 1
                     for i, size in enumerate(inputs.shape[-2:]))
    return fitted.transpose(1, 2).reshape(len(inputs), conv.out_channels, height, width)


# A channel whose residual is this many times the median channel's gets half the weight: a
# unit whose mask is wrong leaves its whole δ·patch in its channel's rows, far above the noise
ROBUST_SPREAD = 9.0


@torch.no_grad()
def robust_input(block: ConvLayer, delta: torch.Tensor, weight_gradient: torch.Tensor,
                 rounds: int = 8) -> torch.Tensor:
    """The conv's input by least squares with each output channel's rows reweighted (Cauchy
    weights on its residual against the median channel's), so that the few channels holding a
    wrong on/off decision do not pull the input away (the gain under noise:
    docs/training-free.md)."""
    fit = least_squares(block, delta, weight_gradient)  # the first, unweighted round
    read, taps = covered_pixels(block), block.conv.kernel_size[0] ** 2
    solution = fit.solution[:, read]
    for _ in range(rounds):
        # D's rows run over (output channel, tap): sum each channel's squared residuals
        residuals = (fit.operator.apply(solution) - fit.rhs).pow(2).unflatten(
            1, (-1, taps)).sum((2, 3))
        typical = residuals.median(1, keepdim=True).values.clamp_min(1e-300)
        weights = 1 / (1 + residuals / (ROBUST_SPREAD * typical))
        solution = solve_least_squares(fit.operator, fit.rhs, weights)
    columns = torch.zeros_like(fit.solution)
    columns[:, read] = solution
    return as_map(block, columns)


def solve_input_with_noise(block: ConvLayer, delta: torch.Tensor, weight_gradient: torch.Tensor,
                           outputs: KnownOutputs | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv's input and its per-pixel noise standard deviation, from the fit's residual;
    infinite at the pixels no output reads (unknown, not zero); and (N,) bool, the steps where
    D(δ) had a null space (completed from `outputs`: the block below may be more exact)."""
    fit = least_squares(block, delta, weight_gradient, outputs)
    operator, rhs, solution = fit.operator, fit.rhs, fit.solution
    read = covered_pixels(block)
    residual = (operator.apply(solution[:, read]) - rhs).pow(2).sum(1)  # (N, C_in)
    _, rows, columns = operator.shape
    sigma = (residual / max(1, rows - columns)).sqrt()
    spread = inverse_diagonal(fit.gram)
    std = torch.full_like(solution, float("inf"))
    std[:, read] = sigma[:, None, :] * spread.clamp_min(0).sqrt()[:, :, None]  # (N, Q', C_in)
    largest = solution.abs().flatten(1).amax(1)[:, None, None]
    if fit.undetermined is not None:
        # free along a null direction: any value is consistent, so the block below must
        # treat these units as undecided (finite, unlike the pixels no output reads)
        std = torch.where(fit.undetermined, (UNDETERMINED_SPREAD * largest).expand_as(std), std)
    std = torch.where(fit.completed[:, None, None],
                      torch.maximum(std, COMPLETION_NOISE * largest), std)
    return as_map(block, solution), as_map(block, std), fit.completed
