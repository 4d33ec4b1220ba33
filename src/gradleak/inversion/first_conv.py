"""The frame under the first conv block, from the equations one step's gradient gives for it.

The recursion (`inversion.conv_recovery`) stops above the first block: its weight gradient has
fewer equations than the frame has pixels. What it does give, exactly, is the first block's
output (so the first conv's pre-activation at every unit that is on, and which units are off)
and the gradient reaching that output (so δ₁ = g · γ/σ · [on], the first conv's output
gradient). Two sets of equations are then linear in the network input x:

- outputs: conv₁(x) = r at the on-units (r = the recovered ReLU output minus the bias), and
  conv₁(x) ≤ −b at the off-units;
- the weight gradient: ∇W₁ = Σ_p δ₁(p) · patch_p(x)ᵀ, O·C·k² equations (∇b₁ = Σ_p δ₁(p) does
  not involve x: it checks δ₁).

`inversion.frame_solve` solves them together, batched over frames, with a prior for the part of
x they leave free.

When the gradient is not exact (float16 or bfloat16 on the wire, a defense), δ₁ inherits the
recursion's error and the weight-gradient equations, which the solve otherwise fits exactly,
bend the frame towards it. ∇b₁ measures that error for free (Σ_p δ₁(p) against the observed
∇b₁ tracks the equations' residual at the true frame), so `NoiseModel` weighs those equations
down by it and raises the smoothness with the on-units' estimated noise; CG starts from the
step's mean colour, which ∇W₁ and ∇b₁ give without δ₁ (`mean_colour`), and a step whose check
says the recursion failed keeps it (measured: `docs/training-free.md`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from gradleak.inversion.conv_blocks import ConvBlock, conv_blocks
from gradleak.inversion.layers.affine_norm import AffineNorm, through_batch_statistics
from gradleak.inversion.layers.base import Known
from gradleak.inversion.layers.relu import margin_states
from gradleak.inversion.network import Network


@dataclass
class FirstConvEquations:
    """The linear equations one step's gradient gives for the network input x under the first
    conv, for N steps at once (float64)."""

    block: ConvBlock
    on: torch.Tensor  # (N, O, h, w) bool: units surely on
    off: torch.Tensor  # (N, O, h, w) bool: units off (undecided ones count as off)
    outputs: torch.Tensor  # (N, O, h, w) conv₁(x) without its bias, at the on-units (0 elsewhere)
    delta: torch.Tensor  # (N, O, h, w) δ₁, the first conv's output gradient
    weight_gradient: torch.Tensor | None  # (N, O, C, k, k) the observed ∇W₁; None: not used
    # (N,) ‖Σ_p δ₁(p) − ∇b₁‖ / ‖∇b₁‖: δ₁'s own error, which the weight-gradient equations
    # inherit (None: no bias gradient to check against)
    bias_check: torch.Tensor | None = None
    # (N,) the on-units' estimated noise relative to their values, from the recursion's
    output_noise: torch.Tensor | None = None
    # (N, C) each step's mean input per channel, from ∇W₁ and ∇b₁ alone (`mean_colour`)
    colour: torch.Tensor | None = None
    # (N, O, h, w) the bound conv₁(x) (without its bias) keeps at an off-unit; None: −b₁, the
    # unit exactly off. An undecided unit may be on, so its bound is its recovered value plus
    # `CEILING_DEVIATIONS` deviations (`first_conv_equations`)
    ceiling: torch.Tensor | None = None

    @property
    def kernel(self) -> int:
        return self.block.conv.kernel_size[0]

    @property
    def weight(self) -> torch.Tensor:
        """W₁ in the equations' precision."""
        return self.block.conv.weight.detach().to(self.outputs.dtype)

    @property
    def bias(self) -> torch.Tensor:
        """(O, 1, 1) b₁ in the equations' precision."""
        return self.block.conv.bias.detach().to(self.outputs.dtype)[:, None, None]

    def to(self, dtype: torch.dtype) -> FirstConvEquations:
        """The same equations in `dtype` (the masks stay boolean)."""
        return replace(self, outputs=self.outputs.to(dtype), delta=self.delta.to(dtype),
                       weight_gradient=cast(self.weight_gradient, dtype),
                       ceiling=cast(self.ceiling, dtype))

    def off_ceiling(self) -> torch.Tensor:
        """(N, O, h, w) the bound on conv₁(x) at each off-unit."""
        return -self.bias.expand_as(self.outputs) if self.ceiling is None else self.ceiling

    def conv(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.block.conv
        return F.conv2d(x, self.weight, None, conv.stride, conv.padding)

    def conv_adjoint(self, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        conv = self.block.conv
        return torch.nn.grad.conv2d_input(shape, self.weight, y, conv.stride, conv.padding)

    def patches(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.block.conv
        return F.unfold(x, self.kernel, padding=conv.padding, stride=conv.stride)

    def weight_gradient_of(self, x: torch.Tensor) -> torch.Tensor:
        """Σ_p δ₁(p) · patch_p(x)ᵀ, (N, O, C·k²): what ∇W₁ would be for the input x."""
        return torch.bmm(self.delta.flatten(2), self.patches(x).transpose(1, 2))

    def weight_gradient_adjoint(self, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        conv = self.block.conv
        columns = torch.bmm(y.transpose(1, 2), self.delta.flatten(2))  # (N, C·k², P)
        return F.fold(columns, shape[-2:], self.kernel, padding=conv.padding,
                      stride=conv.stride)

    @torch.no_grad()
    def residuals(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """(N,) relative residuals of each set of equations at x; ≈ 0 for the true input."""
        out = {"outputs": relative(self.conv(x) * self.on - self.outputs, self.outputs)}
        if self.weight_gradient is not None:
            observed = self.weight_gradient.flatten(2)
            out["weight_gradient"] = relative(self.weight_gradient_of(x) - observed, observed)
        if self.bias_check is not None:  # does not involve x: it checks δ₁
            out["bias_gradient"] = self.bias_check
        return out


GRADIENT_TOLERANCE = 1e-3
# A first-block unit counts as on this many noise deviations above 0, and as off below: the
# frame's equations take it as exact either way, and no weight gradient settles the rest
# (`first_conv_equations`). 10 was the best of 20 / 10 / 5 over noisy and reduced-precision
# captures (docs/training-free.md, "Measured choices").
FIRST_BLOCK_MARGIN = 10.0
# An undecided unit's pre-activation is at most its recovered value plus this many deviations,
# whether it is on (then it is that value, up to its noise) or off (then it is ≤ 0): a bound
# that holds for both, where −b₁ (exactly off) is wrong for every undecided unit that is on
CEILING_DEVIATIONS = 3.0
NOISE_REFERENCE = 1e-2
# A step whose bias check exceeds this keeps its mean-colour frame: the recursion failed
# there (failed steps' checks and good ones' lie on either side: docs/training-free.md)
FAILED_CHECK = 0.95


@dataclass(frozen=True)
class NoiseModel:
    """How the solve weighs equations that are not exact. The weight-gradient equations of a
    step count 1 / (1 + (bias check / `gradient_tolerance`)²): fully on float32 (check ≈ 1e-7),
    hardly at all once δ₁ is a few percent off. The smoothness is multiplied by
    max(1, (output noise / `noise_reference`)²), so the prior takes over as the on-units'
    values get noisier. The tolerance was chosen on float16 and bfloat16 captures
    (docs/training-free.md, "Measured choices"); the weight costs nothing on exact steps."""

    gradient_tolerance: float = GRADIENT_TOLERANCE
    noise_reference: float = NOISE_REFERENCE
    failed_check: float = FAILED_CHECK

    def failed(self, equations: FirstConvEquations) -> torch.Tensor:
        """(N,) bool: steps whose δ₁ misses nearly all of ∇b₁, where the recursion failed and
        its equations say nothing reliable (they keep the mean-colour frame)."""
        if equations.bias_check is None or equations.colour is None:
            return torch.zeros(len(equations.on), dtype=torch.bool)
        return equations.bias_check >= self.failed_check

    def gradient_weight(self, equations: FirstConvEquations) -> torch.Tensor | None:
        """(N,) the weight-gradient equations' weight per step; None: weigh them fully."""
        if equations.bias_check is None:
            return None
        return 1 / (1 + (equations.bias_check / self.gradient_tolerance) ** 2)

    def smoothness(self, equations: FirstConvEquations, smoothness: float) -> torch.Tensor:
        """(N, 1, 1, 1) the smoothness weight per step."""
        noise = torch.zeros(len(equations.on), dtype=torch.float64) \
            if equations.output_noise is None else equations.output_noise
        return per_frame(smoothness * (noise / self.noise_reference).pow(2).clamp_min(1.0))


def mean_colour(weight_gradient: torch.Tensor, bias_gradient: torch.Tensor) -> torch.Tensor:
    """(N, C) each step's mean input per channel from the first conv's gradients alone, no δ₁:
    for a constant input m, ∇W₁[o, c, tap] = m_c · ∇b₁[o] (padding aside), so m_c is the
    least-squares ratio over o and the taps. For a real frame it is a δ₁-weighted average
    colour; robust where the recursion fails, since it needs no δ₁."""
    gradient, bias = weight_gradient.double().flatten(3), bias_gradient.double()
    taps = gradient.shape[-1]
    return torch.einsum("noct,no->nc", gradient, bias) / (
        taps * bias.pow(2).sum(1, keepdim=True)).clamp_min(1e-300)


def relative(error: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    return error.flatten(1).norm(dim=1) / reference.flatten(1).norm(dim=1).clamp_min(1e-300)


def first_conv_equations(network: Network, first_output: torch.Tensor, noise: torch.Tensor,
                         upstream: torch.Tensor, weight_gradient: torch.Tensor | None,
                         threshold: float = FIRST_BLOCK_MARGIN,
                         bias_gradient: torch.Tensor | None = None) -> FirstConvEquations:
    """The equations from the recursion's first-block output (its noise estimate) and the
    gradient reaching it; with the observed ∇b₁ (`bias_gradient`, (N, O)), how far δ₁ is off.
    Only units surely on count as on: the weight gradient leaves the frame under-determined,
    so the alternation that settles undecided units elsewhere (`settle_masks`) has nothing to
    settle them with here."""
    first = conv_blocks(network)[0]
    with torch.no_grad():
        relu_output = AffineNorm(first).invert(Known(first_output.double(), noise.double(),
                                                     upstream.double()))
        relu, deviation, rounding = relu_output.value, relu_output.noise, relu_output.rounding
        on, _ = margin_states(relu_output, threshold)
        if first.activation is not None:  # one-to-one: every unit's pre-activation is known
            relu_output = first.activation.invert(relu_output)
            relu, on = relu_output.value, relu_output.on
        known = torch.isfinite(noise)  # a unit no conv above reads says nothing
        on, off = on & known, ~on & known
        bias = first.conv.bias.double()[:, None, None]
        outputs, delta = (relu - bias) * on, relu_output.gradient * on
        spread = torch.where(known, CEILING_DEVIATIONS * deviation + rounding, 0.0)
        ceiling = (relu + spread).clamp_min(0.0) - bias
        unit_noise = torch.where(known, relu_output.noise, 0.0) * on
        output_noise = relative(unit_noise, outputs)
        bias_check = None if bias_gradient is None else relative(
            delta.sum((2, 3)) - bias_gradient.double(), bias_gradient.double())
        colour = None if bias_gradient is None or weight_gradient is None else mean_colour(
            weight_gradient, bias_gradient)
    return FirstConvEquations(first, on, off, outputs, delta,
                              None if weight_gradient is None else weight_gradient.double(),
                              bias_check, output_noise, colour, ceiling)


def with_batch_statistics(equations: FirstConvEquations, on_delta: torch.Tensor,
                          inputs: torch.Tensor | None) -> FirstConvEquations:
    """The equations of a first block whose BatchNorm normalised the sample by its own
    statistics (train mode, folded in: `ConvBlock.batch_norm`): δ₁ at every unit carries them
    (`through_batch_statistics`), the off-units' through the conv's own output there, taken at
    `inputs` (None: at the boundary, 0 after the BatchNorm). `on_delta`: δ₁ as the block's
    output gives it, at the on-units. No bias gradient checks δ₁ then (Σ_p δ₁(p) is 0)."""
    block, on = equations.block, equations.on
    off = torch.zeros_like(equations.outputs) if inputs is None \
        else (equations.conv(inputs) + equations.bias).clamp_max(0.0)
    output = torch.where(on, equations.outputs + equations.bias, off)
    delta = through_batch_statistics(on_delta, block.batch_normalised(output))
    return replace(equations, delta=delta.to(equations.delta.dtype), bias_check=None,
                   colour=None)


def cast(value: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if value is None else value.to(dtype)


def per_frame(values: torch.Tensor) -> torch.Tensor:
    return values[:, None, None, None]
