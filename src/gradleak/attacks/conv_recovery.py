"""Closed-form recovery through the conv stack, from one per-step gradient and θ0.

The FC layer's input y (the last block's output) comes out of the gradient exactly (see
`gradleak.attacks.analytic`), and so does the gradient reaching it, g_y = W_fcᵀ ∇b_fc. Each
block is Conv → ReLU → BatchNorm (eval mode: a known per-channel affine map), so walking down one
block at a time:

1. BN⁻¹ gives the ReLU output r from y; the unit is on where r > 0, and the conv's output
   gradient is δ = g_y · γ/σ · [r > 0].
2. On one sample the conv's weight gradient is Σ_p δ(p) ⊗ patch_p(a) — linear in the conv's
   input a, with one matrix D(δ) shared by all input channels. Where D has at least as many rows
   (C_out·k²) as a channel has pixels, a is its least-squares solution: exact without noise.
3. The gradient reaching a is conv_transpose(δ, W), exact given δ; then the block below.

Where D(δ) is rank-deficient (a trained victim's top conv has output channels off on the whole
frame, and under a stride-2 conv the pixels only the centre tap reads then meet fewer live
channels than there are of them), the input is fixed in D's null space by the block's own
outputs (the on-units' pre-activations, linear in the input and coupling its channels) and then
by inequalities: the input is a ReLU → BN output of the block below (BN⁻¹ of it ≥ 0, half of it
exactly 0) and the off-units' pre-activations are ≤ 0 (`conv_blocks.complete_from_outputs`).
What stays free is marked undetermined, so the block below leaves those units undecided.

So errors do not compound through the activations, only through the on/off masks: a unit whose
recovered r is within `threshold` noise standard deviations of zero (the noise estimated from
the fit's residual) is undecided. Alternating rounds settle it: fit δ to the weight gradient
given a, and keep each undecided unit on where that δ is nearer g_y·γ/σ than 0.

The recursion stops above the first block whose D has too few rows for its unknowns (the frame
under the strided 8×8 first conv of the paper's CNN): that layer needs a prior.

Measured on the cpu-bench held-out capture (float16 gradients, cnn-small at 64×64, 16 frames):
a margin of 3 / 12 / 20 standard deviations with 0 / 2 / 3 rounds leaves a relative error
(median) of 0.55 / 0.023 / 0.031 on the 16×16×16 input of the second conv, 4e-4 on the 8×8
maps; choosing the margin per step (see `recover_conv_inputs`) brings the first to 9e-4.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gradleak.attacks.closed_form import linear_input
from gradleak.attacks.conv_blocks import (
    ConvBlock,
    KnownOutputs,
    block_forward,
    conv_blocks,
    deepest_inputs,
    solve_input,
    solve_input_with_noise,
    unit_states,
)
from gradleak.errors import ConfigError
from gradleak.threat import Observation
from gradleak.victims.base import Victim, victim_at_theta0

GradientOf = Callable[[str], torch.Tensor]  # parameter name → (N, *shape) per-step gradients


@dataclass
class ConvInputs:
    """What the recursion recovered: each conv's input, its noise estimate and output mask."""

    inputs: dict[str, torch.Tensor]  # conv name → (N, C_in, H, W)
    noise: dict[str, torch.Tensor]  # conv name → (N, C_in, H, W) estimated standard deviation
    masks: dict[str, torch.Tensor]  # conv name → (N, C_out, h, w) the ReLU units found on
    thresholds: torch.Tensor | None = None  # (N,) the on/off margin kept for each step
    # conv name → (N, C_in, H, W) the loss gradient reaching that input: with the block below's
    # BN gain and on-units it is that block's output gradient δ
    upstream: dict[str, torch.Tensor] = field(default_factory=dict)
    # conv name → (N,) bool: the steps where that input's D(δ) had a null space
    completed: dict[str, torch.Tensor] = field(default_factory=dict)

    def relative_noise(self, name: str) -> torch.Tensor:
        """(N,) ‖estimated noise‖ / ‖recovered input‖ over the pixels the gradient determines:
        tracks the true relative error."""
        noise = self.noise[name]
        known = torch.isfinite(noise)
        return (torch.where(known, noise, 0).flatten(1).norm(dim=1)
                / torch.where(known, self.inputs[name], 0).flatten(1).norm(dim=1
                                                                       ).clamp_min(1e-30))

    def pick(self, others: list[ConvInputs], name: str, thresholds: list[float]) -> ConvInputs:
        """Per step, the run (this or one of `others`) whose `name` input is least noisy."""
        runs = [self, *others]
        best = torch.stack([run.relative_noise(name) for run in runs]).argmin(0)
        rows = torch.arange(len(best))

        def choose(field: str) -> dict[str, torch.Tensor]:
            return {key: torch.stack([getattr(run, field)[key] for run in runs])[best, rows]
                    for key in getattr(self, field)}

        return ConvInputs(choose("inputs"), choose("noise"), choose("masks"),
                          torch.tensor(thresholds, dtype=torch.float64)[best], choose("upstream"),
                          choose("completed"))


@torch.no_grad()
def recover_conv_inputs(gradient_of: GradientOf, victim: Victim, down_to: str | None = None,
                        thresholds: tuple[float, ...] = (10.0, 20.0, 40.0), rounds: int = 3
                        ) -> ConvInputs:
    """Walk down from the FC layer to the input of conv `down_to` (default: as far as the
    gradients determine it). `victim` holds θ0 and is in eval mode; float64 throughout.

    Why several on/off margins: no single one suits every step (a unit's noise varies with the
    step's advantage and how many units are on), and the fit's own residual says which run went
    right. Per step the run whose deepest map has the least relative noise is kept; on 96
    cpu-bench held-out steps that choice equals the oracle's (relative error of the 16×16×16
    map: median 9e-4, 8 steps above 0.1; a fixed margin of 20 gives 2.3e-2 and 18)."""
    read: dict[str, torch.Tensor] = {}

    def once(name: str) -> torch.Tensor:  # every walk reads the same gradients
        if name not in read:
            read[name] = gradient_of(name).double()
        return read[name]

    runs = [walk_down(once, victim, down_to, threshold, rounds)
            for threshold in thresholds]
    deepest = list(runs[0].inputs)[-1]
    return runs[0].pick(runs[1:], deepest, list(thresholds))


def walk_down(gradient_of: GradientOf, victim: Victim, down_to: str | None, threshold: float,
              rounds: int) -> ConvInputs:
    """One pass of the recursion with a fixed on/off margin of `threshold` deviations."""
    blocks = conv_blocks(victim)
    reachable = deepest_inputs(victim)
    target = down_to or reachable[-1]
    if target not in reachable:
        known = [block.name for block in blocks]
        raise ConfigError(f"conv input {target!r}: the gradients determine the inputs of "
                          f"{', '.join(reachable) or 'none'}" + (
                              " only (below, a conv's weight gradient has fewer equations than "
                              "its input has pixels: that layer needs a prior)"
                              if target in known else f"; the convs are {', '.join(known)}"))
    feature_linear = victim.roles().feature_linear
    fc_weight, fc_bias = gradient_of(f"{feature_linear}.weight"), gradient_of(
        f"{feature_linear}.bias")
    count = len(fc_bias)
    last = blocks[-1].conv.out_channels
    side = int(round((fc_weight.shape[-1] / last) ** 0.5))
    y, noise = linear_input_with_noise(fc_weight, fc_bias)
    y, noise = y.view(count, last, side, side), noise.view(count, last, side, side)
    upstream = (fc_bias @ victim.get_submodule(feature_linear).weight.double()).view_as(y)
    found = ConvInputs({}, {}, {})
    for index in reversed(range(len(blocks))):
        block, below = blocks[index], blocks[index - 1] if index else None
        weight_gradient = gradient_of(f"{block.name}.weight")
        delta, outputs = output_gradient(block, below, y, noise, upstream, weight_gradient,
                                         threshold, rounds)
        y, noise, completed = solve_input_with_noise(block, delta, weight_gradient, outputs)
        found.inputs[block.name], found.noise[block.name] = y, noise
        found.masks[block.name], found.completed[block.name] = outputs.on, completed
        upstream = torch.nn.grad.conv2d_input(y.shape, block.conv.weight.double(), delta,
                                              stride=block.conv.stride,
                                              padding=block.conv.padding)
        found.upstream[block.name] = upstream
        if block.name == target:
            return refresh_upward(found, blocks)
    raise AssertionError("unreachable: the target is one of the blocks")


def refresh_upward(found: ConvInputs, blocks: list[ConvBlock]) -> ConvInputs:
    """Where a block's D(δ) had a null space its input may keep an error the inequalities did
    not remove, while the block below, solved with the right masks, is exact: there the input is
    the forward pass of the input below (on 3 of 16 trained-PPO steps of the paper's CNN, the
    top conv's input goes from 5e-2 to 1e-6)."""
    names = [block.name for block in blocks]
    reached = [name for name in names if name in found.inputs]  # bottom-up
    for lower, upper in zip(reached, reached[1:]):
        steps = found.completed[upper]
        if steps.any():
            block = blocks[names.index(lower)]
            forward = block_forward(block, found.inputs[lower][steps])
            found.inputs[upper][steps] = forward
    return found


def linear_input_with_noise(weight_gradient: torch.Tensor, bias_gradient: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """x = ∇Wᵀ∇b/‖∇b‖² (N, in), and its noise: the rank-one fit's residual per entry over ‖∇b‖.
    Storage rounding alone makes a unit that is exactly off come back as ±1e-7 (float32) or
    ±1e-3 (float16) after BN⁻¹, so even the top layer needs this margin."""
    norm = (bias_gradient ** 2).sum(1, keepdim=True)
    x = torch.nan_to_num(linear_input(weight_gradient, bias_gradient), nan=0.0)
    residual = weight_gradient - bias_gradient[:, :, None] * x[:, None, :]
    outputs, inputs = weight_gradient.shape[1:]
    dof = max(1, outputs * inputs - outputs - inputs)
    sigma = torch.nan_to_num(((residual ** 2).sum((1, 2)) / dof / norm[:, 0]).sqrt())
    return x, sigma[:, None].expand_as(x)


def output_gradient(block: ConvBlock, below: ConvBlock | None, y: torch.Tensor,
                    noise: torch.Tensor, upstream: torch.Tensor, weight_gradient: torch.Tensor,
                    threshold: float, rounds: int) -> tuple[torch.Tensor, KnownOutputs]:
    """δ at the conv's output (before ReLU), and the ReLU output with the on-units it used."""
    relu, sure, undecided, gain = unit_states(block, y, noise, threshold)
    full = upstream * gain  # δ where the unit is on
    mask = sure.clone()
    rows = undecided.flatten(1).any(1).nonzero().flatten()
    if rounds and len(rows):
        # without `below`: the rounds need the masks right, not every null direction fixed
        # (the linear programme, 0.1 s a step, is left to the final solve)
        mask[rows] = settle_masks(block, full[rows], KnownOutputs(relu[rows], sure[rows]),
                                  undecided[rows], weight_gradient[rows], rounds)
    return full * mask, KnownOutputs(relu, mask, below)


def settle_masks(block: ConvBlock, full: torch.Tensor, surely_on: KnownOutputs,
                 undecided: torch.Tensor, weight_gradient: torch.Tensor,
                 rounds: int) -> torch.Tensor:
    """Alternate: input from δ, δ from input; keep an undecided unit on where the fitted δ is
    nearer the on-value than 0. Only the surely-on units' values are trusted as equations."""
    sure, kernel = surely_on.on, block.conv.kernel_size[0]
    mask = sure.clone()
    for _ in range(rounds):
        a = solve_input(block, full * mask, weight_gradient, surely_on)
        patches = F.unfold(a, kernel, padding=block.conv.padding, stride=block.conv.stride)
        fitted = torch.linalg.lstsq(patches, weight_gradient.flatten(2).transpose(1, 2)
                                    ).solution  # (N, P, C_out)
        fitted = fitted.transpose(1, 2).reshape(full.shape)
        nearer_on = (fitted - full).abs() < fitted.abs()
        mask = torch.where(undecided, nearer_on, sure)
    return mask


def observed_conv_inputs(observation: Observation, down_to: str | None = None,
                         thresholds: tuple[float, ...] = (10.0, 20.0, 40.0),
                         rounds: int = 3) -> ConvInputs:
    """`recover_conv_inputs` on what the server holds: the observation's gradients and θ0."""
    victim = victim_at_theta0(observation).double()

    def gradient_of(name: str) -> torch.Tensor:
        try:
            return torch.from_numpy(observation.block(name).astype("float64"))
        except KeyError:
            raise ConfigError(f"recovery through the conv stack needs the gradient of {name}: "
                              "capture with --components including 'cnn' and 'fc'") from None

    return recover_conv_inputs(gradient_of, victim, down_to, thresholds, rounds)
