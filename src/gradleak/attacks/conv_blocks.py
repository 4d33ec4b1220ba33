"""The victim's conv stack as Conv → ReLU [→ BatchNorm] blocks, and one block's equations: on one
sample its weight gradient is Σ_p δ(p) ⊗ patch_p(a), linear in the block's input a, with one
matrix D(δ) shared by all input channels (see `attacks.conv_recovery` for the recursion that
walks the blocks down).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gradleak.errors import ConfigError
from gradleak.victims.base import Victim


@dataclass(frozen=True)
class ConvBlock:
    name: str  # the conv module's name, e.g. "encoder.3"
    conv: nn.Conv2d
    norm: nn.BatchNorm2d  # the identity (`identity_norm`) when the block has none
    input_size: int  # the square input map's side



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



def unfold_identity(block: ConvBlock) -> torch.Tensor:
    """(Q, k², P): which input pixel each output position's kernel tap reads."""
    size, kernel = block.input_size, block.conv.kernel_size[0]
    basis = torch.eye(size * size, dtype=torch.float64).view(-1, 1, size, size)
    return F.unfold(basis, kernel, padding=block.conv.padding, stride=block.conv.stride)



def covered_pixels(block: ConvBlock) -> torch.Tensor:
    """(Q,) bool: the input pixels some output position reads. A strided conv without padding
    can leave the last rows and columns unread (NatureCNN's 15×15 map under its 4×4, stride-2
    conv); no gradient says anything about them."""
    return unfold_identity(block).flatten(1).any(1)



def weight_gradient_matrix(block: ConvBlock, delta: torch.Tensor,
                           taps: torch.Tensor) -> torch.Tensor:
    """D(δ): (N, C_out·k², Q), so that ∇W[:, i] (flattened) = D a_i for every input channel i."""
    return torch.einsum("nop,qkp->nokq", delta.flatten(2), taps).flatten(1, 2)



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
