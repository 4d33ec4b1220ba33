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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gradleak.attacks.closed_form import linear_input
from gradleak.errors import ConfigError
from gradleak.threat import Observation
from gradleak.victims.base import Victim, victim_at_theta0

GradientOf = Callable[[str], torch.Tensor]  # parameter name → (N, *shape) per-step gradients


@dataclass(frozen=True)
class ConvBlock:
    name: str  # the conv module's name, e.g. "encoder.3"
    conv: nn.Conv2d
    norm: nn.BatchNorm2d  # the identity (`identity_norm`) when the block has none
    input_size: int  # the square input map's side


@dataclass
class ConvInputs:
    """What the recursion recovered: each conv's input, its noise estimate and output mask."""

    inputs: dict[str, torch.Tensor]  # conv name → (N, C_in, H, W)
    noise: dict[str, torch.Tensor]  # conv name → (N, C_in, H, W) estimated standard deviation
    masks: dict[str, torch.Tensor]  # conv name → (N, C_out, h, w) the ReLU units found on
    thresholds: torch.Tensor | None = None  # (N,) the on/off margin kept for each step

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
                          torch.tensor(thresholds, dtype=torch.float64)[best])


def conv_blocks(victim: Victim) -> list[ConvBlock]:
    """The victim's conv stack (its roles) as Conv → ReLU [→ BatchNorm] blocks in order, read
    by a Linear layer (its `feature_linear`). A block without BatchNorm (NatureCNN, SB3's
    CnnPolicy) gets the identity as its affine map. Anything else is refused here, before any
    work, naming the first module the recursion cannot pass and why."""
    roles = victim.roles()
    name = victim.config.name
    if not roles.conv_stack or roles.feature_linear is None:
        raise ConfigError(f"victim {name}: recovery through the conv stack needs conv layers "
                          "read by a biased Linear layer applied once per sample; this victim "
                          f"has {'no conv stack' if not roles.conv_stack else 'none after it'}")
    steps = [step for step in roles.conv_stack if step.kind != "flatten"]
    blocks, i = [], 0
    while i < len(steps):
        conv, after = steps[i], [s.kind for s in steps[i + 1:i + 3]]
        if conv.kind != "conv" or after[:1] != ["relu"]:
            what = conv if conv.kind != "conv" else steps[i + 1] if i + 1 < len(steps) else conv
            raise ConfigError(f"victim {name}: the recursion through the conv stack passes "
                              "Conv → ReLU [→ BatchNorm] blocks only; "
                              f"{what.module} is a {what.kind}" + REASONS.get(what.kind, ""))
        module = victim.get_submodule(conv.module)
        if module.groups != 1 or module.dilation != (1, 1) or module.bias is None \
                or conv.input_shape[1] != conv.input_shape[2] \
                or len(set(module.kernel_size)) != 1 or len(set(module.stride)) != 1:
            raise ConfigError(f"victim {name}: {conv.module}: the recursion passes plain biased "
                              "convolutions with square kernels and strides on square maps")
        normed = after[1:] == ["batchnorm"]
        norm = victim.get_submodule(steps[i + 2].module) if normed \
            else identity_norm(module.out_channels)
        blocks.append(ConvBlock(conv.module, module, norm, conv.input_shape[1]))
        i += 3 if normed else 2
    if not roles.conv_chain:
        raise ConfigError(f"victim {name}: composing its conv modules in call order does not "
                          f"give what {roles.feature_linear} reads (a residual addition or a "
                          "function between them): the recursion cannot pass it")
    return blocks


# why the recursion stops at a module of this kind
REASONS = {"maxpool": " (max-pooling: the gradient gives the argmax switches, not yet used)",
           "groupnorm": " (GroupNorm: per-sample statistics, two unknowns per group)",
           "conv": " not followed by a ReLU"}


def identity_norm(channels: int) -> nn.BatchNorm2d:
    """The affine map of a block without normalisation: γ = 1, β = 0, μ = 0, σ = 1 exactly."""
    return nn.BatchNorm2d(channels, eps=0.0).eval()


def solvable(block: ConvBlock) -> bool:
    """Does the weight gradient pin the input down? D needs at least as many independent rows
    as a channel has pixels, and the ReLU switches about half the output units off (their rows
    vanish): ask for twice as many rows. The frame under the first conv fails this at 32×32
    (1024 rows for 1024 pixels, rank-deficient in practice) and at 64×64."""
    out_channels, _, kernel, _ = block.conv.weight.shape
    return out_channels * kernel * kernel >= 2 * block.input_size ** 2


def deepest_inputs(victim: Victim) -> list[str]:
    """The conv modules whose input the recursion reaches, from the top down."""
    names = []
    for block in reversed(conv_blocks(victim)):
        if not solvable(block):
            break
        names.append(block.name)
    if not names:
        raise ConfigError(f"victim {victim.config.name}: no conv input is determined by its "
                          "gradient (each conv's weight gradient has fewer equations than its "
                          "input has pixels)")
    return names


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
    for block in reversed(blocks):
        weight_gradient = gradient_of(f"{block.name}.weight")
        delta, mask = output_gradient(block, y, noise, upstream, weight_gradient, threshold,
                                      rounds)
        y, noise = solve_input_with_noise(block, delta, weight_gradient)
        found.inputs[block.name], found.noise[block.name], found.masks[block.name] = y, noise, mask
        if block.name == target:
            return found
        upstream = torch.nn.grad.conv2d_input(y.shape, block.conv.weight.double(), delta,
                                              stride=block.conv.stride,
                                              padding=block.conv.padding)
    raise AssertionError("unreachable: the target is one of the blocks")


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


def unfold_identity(block: ConvBlock) -> torch.Tensor:
    """(Q, k², P): which input pixel each output position's kernel tap reads."""
    size, kernel = block.input_size, block.conv.kernel_size[0]
    basis = torch.eye(size * size, dtype=torch.float64).view(-1, 1, size, size)
    return F.unfold(basis, kernel, padding=block.conv.padding, stride=block.conv.stride)


def weight_gradient_matrix(block: ConvBlock, delta: torch.Tensor,
                           taps: torch.Tensor) -> torch.Tensor:
    """D(δ): (N, C_out·k², Q), so that ∇W[:, i] (flattened) = D a_i for every input channel i."""
    return torch.einsum("nop,qkp->nokq", delta.flatten(2), taps).flatten(1, 2)


def output_gradient(block: ConvBlock, y: torch.Tensor, noise: torch.Tensor,
                    upstream: torch.Tensor, weight_gradient: torch.Tensor, threshold: float,
                    rounds: int) -> tuple[torch.Tensor, torch.Tensor]:
    """δ at the conv's output (before ReLU) and the on/off mask it used."""
    _, sure, undecided, gain = unit_states(block, y, noise, threshold)
    full = upstream * gain  # δ where the unit is on
    mask = sure.clone()
    rows = undecided.flatten(1).any(1).nonzero().flatten()
    if rounds and len(rows):
        mask[rows] = settle_masks(block, full[rows], sure[rows], undecided[rows],
                                  weight_gradient[rows], rounds)
    return full * mask, mask


def unit_states(block: ConvBlock, y: torch.Tensor, noise: torch.Tensor, threshold: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """BN⁻¹ of the block's output: the ReLU output, which units are surely on, which are
    undecided (within `threshold` noise deviations of 0), and BN's gain γ/σ (C, 1, 1)."""
    norm = block.norm
    sd = (norm.running_var.double() + norm.eps).sqrt()
    gain = (norm.weight.double() / sd)[:, None, None]
    shift = norm.bias.double()[:, None, None] / gain
    mean = norm.running_mean.double()[:, None, None]
    relu = y / gain - shift + mean
    # The victim computed BN in float32: an off unit comes back as ±1e-7 of the terms summed.
    rounding = 1e-6 * (relu.flatten(1).abs().amax(1)[:, None, None, None] + shift.abs()
                       + mean.abs())
    margin = threshold * noise / gain.abs() + rounding
    return relu, relu > margin, relu.abs() <= margin, gain


def frames_from_first_block(victim: Victim, output: torch.Tensor, noise: torch.Tensor,
                            threshold: float = 20.0, tv: float = 1e-3, rounds: int = 3,
                            iterations: int = 300) -> torch.Tensor:
    """The frame under the first block, which its gradient leaves under-determined: frames
    (N, H, W, C) in frame units (0..255) whose first conv reproduces the recovered on-units and
    keeps the off-units off, with a quadratic smoothness prior; L-BFGS, clamped to the valid
    range of the victim's input transform between rounds.
    Measured on 16 cpu-bench held-out frames: tv 1e-3 gives 29.0 dB from the true map."""
    first = conv_blocks(victim)[0]
    transform = victim.roles().transform
    height, width, channels = transform.frame_shape
    low = transform.apply(torch.zeros(1, height, width, channels, dtype=torch.float64))
    high = transform.apply(torch.full((1, height, width, channels), 255.0, dtype=torch.float64))
    with torch.no_grad():  # an undecided unit is near 0 either way: hold it off
        relu, on, _, _ = unit_states(first, output, noise, threshold)
    known = torch.isfinite(noise)  # a pixel no conv above reads says nothing of the frame
    on, off = on & known, ~on & known
    conv = first.conv
    weight, bias = conv.weight.detach().double(), conv.bias.detach().double()
    scale = (relu * on).pow(2).flatten(1).sum(1).clamp_min(1e-12)
    images = ((low + high) / 2).repeat(len(output), 1, 1, 1).requires_grad_(True)
    optimiser = torch.optim.LBFGS([images], lr=1, max_iter=iterations, history_size=20,
                                  line_search_fn="strong_wolfe")

    def objective() -> torch.Tensor:
        optimiser.zero_grad()
        z = F.conv2d(images, weight, bias, stride=conv.stride, padding=conv.padding)
        mismatch = ((z - relu) * on).pow(2) + (F.relu(z) * off).pow(2)
        smooth = ((images[..., 1:, :] - images[..., :-1, :]).pow(2).flatten(1).sum(1)
                  + (images[..., :, 1:] - images[..., :, :-1]).pow(2).flatten(1).sum(1))
        loss = (mismatch.flatten(1).sum(1) / scale + tv * smooth).sum()
        loss.backward()
        return loss

    for _ in range(rounds):
        optimiser.step(objective)
        with torch.no_grad():
            images.copy_(torch.maximum(torch.minimum(images, high), low))
    return transform.invert(images.detach())


def settle_masks(block: ConvBlock, full: torch.Tensor, sure: torch.Tensor,
                 undecided: torch.Tensor, weight_gradient: torch.Tensor,
                 rounds: int) -> torch.Tensor:
    """Alternate: input from δ, δ from input; keep an undecided unit on where the fitted δ is
    nearer the on-value than 0."""
    mask, kernel = sure.clone(), block.conv.kernel_size[0]
    for _ in range(rounds):
        a = solve_input(block, full * mask, weight_gradient)
        patches = F.unfold(a, kernel, padding=block.conv.padding, stride=block.conv.stride)
        fitted = torch.linalg.lstsq(patches, weight_gradient.flatten(2).transpose(1, 2)
                                    ).solution  # (N, P, C_out)
        fitted = fitted.transpose(1, 2).reshape(full.shape)
        nearer_on = (fitted - full).abs() < fitted.abs()
        mask = torch.where(undecided, nearer_on, sure)
    return mask


def covered_pixels(block: ConvBlock) -> torch.Tensor:
    """(Q,) bool: the input pixels some output position reads. A strided conv without padding
    can leave the last rows and columns unread (NatureCNN's 15×15 map under its 4×4, stride-2
    conv); no gradient says anything about them."""
    return unfold_identity(block).flatten(1).any(1)


def least_squares(block: ConvBlock, delta: torch.Tensor, weight_gradient: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """D(δ) (N, R, Q') over the read pixels, the right-hand sides (N, R, C_in) and the solution
    (N, Q, C_in), zero at the pixels no output reads (rank-deficient columns otherwise, which
    gelsy does not solve)."""
    count, channels_in = len(delta), block.conv.in_channels
    read = covered_pixels(block)
    matrix = weight_gradient_matrix(block, delta, unfold_identity(block)[read])
    rhs = weight_gradient.permute(0, 1, 3, 4, 2).reshape(count, -1, channels_in)
    solution = torch.zeros(count, len(read), channels_in, dtype=matrix.dtype)
    solution[:, read] = torch.linalg.lstsq(matrix, rhs, driver="gelsy").solution
    return matrix, rhs, solution


def as_map(block: ConvBlock, columns: torch.Tensor) -> torch.Tensor:
    """(N, Q, C_in) → (N, C_in, H, W)."""
    size = block.input_size
    return columns.transpose(1, 2).reshape(len(columns), block.conv.in_channels, size, size)


def solve_input(block: ConvBlock, delta: torch.Tensor, weight_gradient: torch.Tensor
                ) -> torch.Tensor:
    """The conv's input by least squares."""
    return as_map(block, least_squares(block, delta, weight_gradient)[2])


def solve_input_with_noise(block: ConvBlock, delta: torch.Tensor, weight_gradient: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv's input and its per-pixel noise standard deviation, from the fit's residual;
    infinite at the pixels no output reads (unknown, not zero)."""
    matrix, rhs, solution = least_squares(block, delta, weight_gradient)
    read = covered_pixels(block)
    residual = (matrix @ solution[:, read] - rhs).pow(2).sum(1)  # (N, C_in)
    sigma = (residual / max(1, matrix.shape[1] - matrix.shape[2])).sqrt()
    spread = torch.linalg.pinv(matrix.transpose(1, 2) @ matrix).diagonal(dim1=1, dim2=2)
    std = torch.full_like(solution, float("inf"))
    std[:, read] = sigma[:, None, :] * spread.clamp_min(0).sqrt()[:, :, None]  # (N, Q', C_in)
    return as_map(block, solution), as_map(block, std)


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
