"""The victim's conv stack as Conv → ReLU [→ BatchNorm] blocks, and one block's equations: on one
sample its weight gradient is Σ_p δ(p) ⊗ patch_p(a), linear in the block's input a, with one
matrix D(δ) shared by all input channels (see `attacks.conv_recovery` for the recursion that
walks the blocks down).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypeVar

import numpy as np
import scipy.linalg
import torch
import torch.nn.functional as F
from torch import nn

from gradleak.errors import ConfigError
from gradleak.threads import computed_ahead, one_thread
from gradleak.victims.base import Victim

T = TypeVar("T")


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
    relu, deviation, rounding, gain = bn_inverse(block, y, noise)
    margin = threshold * deviation + rounding
    return relu, relu > margin, relu.abs() <= margin, gain


def unit_deviations(block: ConvBlock, y: torch.Tensor, noise: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BN⁻¹ of the block's output: the ReLU output, each unit's standard deviation (the
    noise's and BN's float32 rounding's, taken as a third of its bound), and BN's gain."""
    relu, deviation, rounding, gain = bn_inverse(block, y, noise)
    return relu, deviation + rounding / 3, gain


# The on-units' density just above 0 is read off those this many deviations up (per step)
DENSITY_WINDOW = (4.0, 12.0)


def posterior_on(relu: torch.Tensor, deviation: torch.Tensor) -> torch.Tensor:
    """(N, C, h, w) P(on | r) for each unit's recovered ReLU output r = v + ε, ε ~ N(0, s²)
    with s its estimated deviation: an off unit has v = 0 exactly (about half of them), an on
    unit's v has, near 0, a density taken as flat in deviations and read off the units
    `DENSITY_WINDOW` deviations up. A unit 1 deviation above 0 is then almost surely off (the
    margin rules leave it undecided), one 4 up almost surely on."""
    t = relu / deviation.clamp_min(1e-300)
    flat = t.flatten(1)
    low, high = DENSITY_WINDOW
    units = flat.shape[1]
    density = (((flat > low) & (flat < high)).double().sum(1) / (high - low) / units
               ).clamp_min(1 / ((high - low) * units))[:, None, None, None]
    far_on = (flat > low).double().mean(1)[:, None, None, None]
    off = (1 - far_on - low * density).clamp(0.05, 1.0)
    likely_on = density * torch.special.ndtr(t)
    likely_off = off * torch.exp(-0.5 * t ** 2) / (2 * torch.pi) ** 0.5
    return likely_on / (likely_on + likely_off)


def bn_inverse(block: ConvBlock, y: torch.Tensor, noise: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ReLU output under BN, its noise deviation, the bound on BN's rounding, BN's gain."""
    gain, shift, mean = bn_affine(block)
    relu = y / gain - shift + mean
    # The victim computed BN in float32: an off unit comes back as ±1e-7 of the terms summed.
    rounding = 1e-6 * (relu.flatten(1).abs().amax(1)[:, None, None, None] + shift.abs()
                       + mean.abs())
    return relu, noise / gain.abs(), rounding, gain



@lru_cache(maxsize=32)
def tap_map(size: int, kernel: int, stride: int, padding: int) -> torch.Tensor:
    """(Q, k², P): which input pixel each output position's kernel tap reads. Shared, read
    only: a function of the block's geometry, asked for at every solve (its unfold of the
    identity was a fifth of cnn-small's recursion)."""
    basis = torch.eye(size * size, dtype=torch.float64).view(-1, 1, size, size)
    return F.unfold(basis, kernel, padding=padding, stride=stride)


def covered_pixels(block: ConvBlock) -> torch.Tensor:
    """(Q,) bool: the input pixels some output position reads. A strided conv without padding
    can leave the last rows and columns unread (NatureCNN's 15×15 map under its 4×4, stride-2
    conv); no gradient says anything about them. Shared, read only."""
    conv = block.conv
    return read_pixels(block.input_size, conv.kernel_size[0], conv.stride[0], conv.padding[0])


@lru_cache(maxsize=32)
def read_pixels(size: int, kernel: int, stride: int, padding: int) -> torch.Tensor:
    return tap_map(size, kernel, stride, padding).flatten(1).any(1)


@lru_cache(maxsize=32)
def tap_pixels(size: int, kernel: int, stride: int, padding: int) -> torch.Tensor:
    """(k², P) the index, among the covered pixels, of the pixel kernel tap k reads at output
    position p; −1 where it reads padding. Shared, read only."""
    taps = tap_map(size, kernel, stride, padding)[read_pixels(size, kernel, stride, padding)]
    return torch.where(taps.any(0), taps.argmax(0), -1)


@lru_cache(maxsize=32)
def gram_pairs(size: int, kernel: int, stride: int, padding: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """For the Gram matrix of D(δ): each pair of output positions (p, p') a tap reads pixels at,
    as its index p·P + p' into δᵀδ and its index q·Q' + q' into the Gram matrix."""
    pixels = tap_pixels(size, kernel, stride, padding)
    positions, covered = pixels.shape[1], int(read_pixels(size, kernel, stride, padding).sum())
    source, target = [], []
    for row in pixels:
        valid = (row >= 0).nonzero().flatten()
        source.append((valid[:, None] * positions + valid[None, :]).flatten())
        target.append((row[valid][:, None] * covered + row[valid][None, :]).flatten())
    return torch.cat(source), torch.cat(target)


@dataclass(frozen=True)
class TapOperator:
    """D(δ) (N, C_out·k², Q'), with ∇W[:, i] (flattened) = D a_i for every input channel i,
    kept implicit: its row (o, k) is δ(o, ·) placed at the pixels kernel tap k reads. Its Gram
    matrix is δᵀWδ (P × P) scattered once per tap: C_out·P² + k²·P² operations a step against
    the dense product's C_out·k²·Q'², which was half the paper's cnn's recursion."""

    delta: torch.Tensor  # (N, C_out, P)
    geometry: tuple[int, int, int, int]  # input size, kernel, stride, padding

    @classmethod
    def of(cls, block: ConvBlock, delta: torch.Tensor) -> TapOperator:
        conv = block.conv
        return cls(delta.flatten(2), (block.input_size, conv.kernel_size[0], conv.stride[0],
                                      conv.padding[0]))

    @property
    def pixels(self) -> torch.Tensor:
        return tap_pixels(*self.geometry)

    @property
    def shape(self) -> tuple[int, int, int]:
        taps, _ = self.pixels.shape
        return len(self.delta), self.delta.shape[1] * taps, int(read_pixels(*self.geometry).sum())

    def take(self, rows: torch.Tensor | int) -> TapOperator:
        return TapOperator(self.delta[rows].reshape(-1, *self.delta.shape[1:]), self.geometry)

    def dense(self) -> torch.Tensor:
        """(N, C_out·k², Q'): for the solves that need the matrix itself (gelsd, the SVD)."""
        pixels, (_, _, covered) = self.pixels, self.shape
        taps = torch.zeros(*pixels.shape, covered + 1, dtype=self.delta.dtype)
        taps.scatter_(2, torch.where(pixels >= 0, pixels, covered)[..., None], 1.0)
        return torch.einsum("nop,kpq->nokq", self.delta, taps[..., :covered]).flatten(1, 2)

    def gram(self, weights: torch.Tensor | None = None) -> torch.Tensor:
        """DᵀWD (N, Q', Q'), W weighing each output channel's rows ((N, C_out); None: 1)."""
        weighted = self.delta if weights is None else self.delta * weights[..., None]
        products = weighted.transpose(1, 2) @ self.delta  # (N, P, P)
        source, target = gram_pairs(*self.geometry)
        count, _, covered = self.shape
        gram = products.new_zeros(count, covered * covered)
        gram.index_add_(1, target, products.flatten(1)[:, source])
        return gram.view(count, covered, covered)

    def adjoint(self, rows: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """DᵀW b (N, Q', C) for b (N, C_out·k², C)."""
        pixels, (count, _, covered) = self.pixels, self.shape
        weighted = self.delta if weights is None else self.delta * weights[..., None]
        per_tap = torch.einsum("nop,nokc->nkpc", weighted,
                               rows.unflatten(1, (self.delta.shape[1], len(pixels))))
        valid = (pixels >= 0).flatten()
        out = rows.new_zeros(count, covered, rows.shape[-1])
        return out.index_add_(1, pixels.flatten()[valid], per_tap.flatten(1, 2)[:, valid])

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """D x (N, C_out·k², C) for x (N, Q', C)."""
        pixels = self.pixels
        read = x[:, pixels.clamp_min(0)] * (pixels >= 0)[None, :, :, None].to(x.dtype)
        return torch.einsum("nop,nkpc->nokc", self.delta, read).flatten(1, 2)

    def row_weights(self, weights: torch.Tensor) -> torch.Tensor:
        return weights.repeat_interleave(len(self.pixels), dim=1)


@dataclass(frozen=True)
class DenseOperator:
    """A matrix (N, R, Q) behind TapOperator's interface; weights are per row (N, R)."""

    matrix: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.matrix.shape)

    def take(self, rows: torch.Tensor | int) -> DenseOperator:
        return DenseOperator(self.matrix[rows].reshape(-1, *self.matrix.shape[1:]))

    def dense(self) -> torch.Tensor:
        return self.matrix

    def gram(self, weights: torch.Tensor | None = None) -> torch.Tensor:
        weighted = self.matrix if weights is None else self.matrix * weights[..., None]
        return weighted.transpose(1, 2) @ self.matrix

    def adjoint(self, rows: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        return self.matrix.transpose(1, 2) @ (rows if weights is None
                                              else rows * weights[..., None])

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self.matrix @ x

    def row_weights(self, weights: torch.Tensor) -> torch.Tensor:
        return weights


Operator = TapOperator | DenseOperator


@dataclass(frozen=True)
class KnownOutputs:
    """What the block above says of this block's output: its pre-activation where the unit is
    on (the ReLU output, BN⁻¹ of what that block received). Each is an equation in the input
    that couples its channels, unlike the weight gradient's."""

    relu: torch.Tensor  # (N, C_out, h, w)
    on: torch.Tensor  # (N, C_out, h, w) bool: only these units' values are equations
    below: ConvBlock | None = None  # the block whose ReLU → BN output this block's input is


# D(δ)'s singular values below this fraction of its largest are its null space: on the paper's
# CNN the top block's D has one exact null direction (σ ≈ 1e-16 of the largest, 1e-3 for the
# next) on 5 of 16 trained-PPO steps, where the stride-2 conv's on-units leave a checkerboard
# unread.
NULL_TOLERANCE = 1e-9
# a row of the inequalities within this fraction of their median bound is taken as active
ACTIVE_TOLERANCE = 1e-4
# a linear programme for more free coefficients than this is not tried (their inputs are
# marked undetermined instead): above every count met on the held-out captures, below where
# one programme takes seconds (docs/training-free.md)
MAX_FREE = 160
# nor is the completion for more null-space coefficients (C_in · nullity) than this
MAX_COEFFICIENTS = 512
# Newton steps on the squared violation: 1 to 13 certified the vertex on cnn-small's
# random-init steps; a polytope with room inside never certifies (its last point is kept), and
# only a programme still violated after them goes to the linear programme
NEWTON_STEPS = 16
# inside `completions_shared`: the steps completed, by the bytes they read; else None
_SHARED: dict[bytes, Any] | None = None
# the Newton system's ridge, times its mean diagonal: the violated rows may not fix every
# coefficient
NEWTON_DAMPING = 1e-10
# D's null space is looked for only on blocks with at most this many input pixels a channel:
# the check costs as much as the solve itself, and the null spaces met are all on the top
# block (docs/training-free.md)
NULL_CHECK_PIXELS = 256
# D(δ) whose Gram matrix's Cholesky pivots span less than this (squared) is solved by its
# normal equations, and has no null space: cond(D) was 7–480 on every well-posed step of the
# held-out captures (cnn-small random init, the paper's cnn random init and PPO) and 1e16 or
# more on those with a null space, whose exact null direction leaves a pivot at rounding level
NORMAL_EQUATIONS = 1e-8
# a Gram matrix whose Cholesky pivots span more than this (squared) is inverted by the
# pseudo-inverse instead (pinv's own cut-off is 1e-13 of the largest eigenvalue)
NEAR_SINGULAR = 1e-10
# the noise given to input units no equation fixes, times the map's largest value
UNDETERMINED_SPREAD = 1e3
# the least noise of an input completed from its outputs, times the map's largest value: the
# completion's active-set solve carries an error the fit's residual does not show (up to 1.5e-5
# of the map on cnn-small's random-init top block, against a residual of 1e-7), and the block
# below then took units within it of 0 as surely on or off (50 wrong on one of 16 steps).
# 1e-5 made those steps exact; 1e-4 left so many units to settle that three other steps went
# wrong (cnn-small random init; the paper's cnn, PPO and A2C, unchanged)
COMPLETION_NOISE = 1e-5


@dataclass
class InputFit:
    """One block's input from its weight gradient (and, given, its known outputs)."""

    operator: TapOperator  # D(δ) (N, R, Q') over the read pixels
    rhs: torch.Tensor  # (N, R, C_in)
    solution: torch.Tensor  # (N, Q, C_in), zero at the pixels no output reads
    gram: Gram  # D's Gram matrix and its Cholesky factor: the solve's, reused for the noise
    undetermined: torch.Tensor | None = None  # (N, Q, C_in) bool: no equation fixes these
    completed: torch.Tensor | None = None  # (N,) bool: D(δ) had a null space on these steps

    def __post_init__(self) -> None:
        if self.completed is None:
            self.completed = torch.zeros(len(self.solution), dtype=torch.bool)


@dataclass(frozen=True)
class Gram:
    """DᵀD (N, Q, Q) of a batch of matrices, its Cholesky factor and (N,) the spread of the
    factor's pivots (smallest² / largest²; 0 where the factor failed)."""

    matrix: torch.Tensor
    factor: torch.Tensor
    spread: torch.Tensor

    @classmethod
    def of(cls, operator: Operator, weights: torch.Tensor | None = None) -> Gram:
        gram = operator.gram(weights)
        factor, info = torch.linalg.cholesky_ex(gram)
        pivots = factor.diagonal(dim1=1, dim2=2).abs()
        spread = (pivots.amin(1) / pivots.amax(1).clamp_min(1e-300)) ** 2
        return cls(gram, factor, torch.where(info == 0, spread, torch.zeros_like(spread)))

    @property
    def well_posed(self) -> torch.Tensor:
        """(N,) the steps solved by the normal equations, and taken to have no null space."""
        return self.spread > NORMAL_EQUATIONS

    def take(self, rows: torch.Tensor) -> Gram:
        return Gram(self.matrix[rows], self.factor[rows], self.spread[rows])


def solve_least_squares(operator: Operator, rhs: torch.Tensor,
                        weights: torch.Tensor | None = None, gram: Gram | None = None
                        ) -> torch.Tensor:
    """argmin ‖W^½ (D x − b)‖ per step: by the normal equations' Cholesky factor where D is
    well posed (one refinement step wins back what squaring its condition number loses), by
    gelsd's SVD where it is not: the minimum-norm solution. Not gelsy (a third of the recursion
    when it solved every step): torch's gelsy leaves LAPACK's pivot array unset (pytorch
    #187411, unfixed in torch 2.13), so on a rank-deficient matrix its rank, and its answer,
    changed from call to call (rank 11, 7, 5 or 4 of 11 over 200 calls of one matrix)."""
    gram = Gram.of(operator, weights) if gram is None else gram
    well = gram.well_posed
    if bool(well.all()):
        return refined_normal_solve(operator, rhs, weights, gram.factor)
    count, _, columns = operator.shape
    solution = rhs.new_empty(count, columns, rhs.shape[2])
    if bool(well.any()):
        solution[well] = refined_normal_solve(
            operator.take(well), rhs[well], None if weights is None else weights[well],
            gram.factor[well])
    ill = operator.take(~well)
    matrix, target = ill.dense(), rhs[~well]
    if weights is not None:
        scale = ill.row_weights(weights[~well]).sqrt()[..., None]
        matrix, target = matrix * scale, target * scale
    solution[~well] = torch.linalg.lstsq(matrix, target, driver="gelsd").solution
    return solution


def refined_normal_solve(operator: Operator, rhs: torch.Tensor, weights: torch.Tensor | None,
                         factor: torch.Tensor) -> torch.Tensor:
    x = torch.cholesky_solve(operator.adjoint(rhs, weights), factor)
    return x + torch.cholesky_solve(operator.adjoint(rhs - operator.apply(x), weights), factor)


def least_squares(block: ConvBlock, delta: torch.Tensor, weight_gradient: torch.Tensor,
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
    (σ² squares the gap: 1e-32 against 1e-7 relative on the paper's CNN; floor 1e-16)."""
    eigenvalues = torch.linalg.eigvalsh(gram)
    return (eigenvalues < NULL_TOLERANCE ** 1.5 * eigenvalues[:, -1:]).sum(1)


@dataclass(frozen=True)
class StepCompletion:
    """One step's input from `complete_step`: (Q, C_in) columns, (Q, C_in) bool where no
    equation fixes them, and whether D(δ) had a null space there."""

    solution: torch.Tensor
    undetermined: torch.Tensor
    completed: bool


@torch.no_grad()
def complete_from_outputs(block: ConvBlock, fit: InputFit, outputs: KnownOutputs,
                          steps: torch.Tensor) -> InputFit:
    """The weight gradient fixes each input channel up to D(δ)'s null space, the same for every
    channel: a_i = a_i* + Σ_j c_ij n_j. The on-units' pre-activations are linear in the c_ij,
    so one small least squares per step fixes those the live output channels reach; the rest
    are marked undetermined. Only `steps` (where D's Gram matrix has a null space) are looked
    at, and solved here whole: a* is the minimum-norm solution with the singular values under
    NULL_TOLERANCE dropped (gelsd's own cut-off is machine precision), so that it has no part
    along the null directions it is completed with."""
    solution = fit.solution.clone()
    undetermined = torch.zeros_like(solution, dtype=torch.bool)
    completed = torch.zeros(len(solution), dtype=torch.bool)
    read = covered_pixels(block)
    below = b"" if outputs.below is None else outputs.below.name.encode()

    def parts(step: int) -> tuple[bytes | torch.Tensor, ...]:  # what a completion reads
        return (b"completion", block.name.encode(), below, fit.operator.delta[step],
                fit.rhs[step], outputs.relu[step], outputs.on[step])

    order = steps.nonzero().flatten().tolist()
    keys = {step: shared_key(*parts(step)) for step in order}
    # Small solves a step, on one thread. Two steps at a time in threads was no faster: the
    # many small operations between the solves hold the GIL. The next steps' few large ones
    # (two SVDs and a conv, which release it) run ahead in a thread instead, every input bit
    # for bit the same (the timings: docs/training-free.md).
    with one_thread(), computed_ahead(
            lambda step: prepare_step(block, fit, outputs, step, read),
            first_unanswered(order, keys)) as prepared:
        for step in order:
            done = answered(keys[step],
                            lambda step=step: complete_step(block, outputs, prepared(step)))
            solution[step], undetermined[step] = done.solution, done.undetermined
            completed[step] = done.completed
    return InputFit(fit.operator, fit.rhs, solution, fit.gram, undetermined, completed)


@dataclass(frozen=True)
class FreeDirections:
    """The null-space maps the on-units leave free: (F, Q, C_in) maps, and the conv's output
    (no bias) on each, (F, C_out, h, w), from the per-direction outputs already at hand (a
    conv of the F maps themselves was half of the inequalities' cost)."""

    maps: torch.Tensor
    outputs: torch.Tensor

    def __len__(self) -> int:
        return len(self.maps)


@dataclass(frozen=True)
class PreparedStep:
    """One step's completion up to its inequalities (`prepare_step`): the minimum-norm
    solution, D(δ)'s null directions there (None: it has none) and the null-space part fitted
    to the on-units with the coefficients they leave free."""

    step: int
    solution: torch.Tensor
    directions: torch.Tensor | None = None
    part: torch.Tensor | None = None
    free: FreeDirections | None = None


def prepare_step(block: ConvBlock, fit: InputFit, outputs: KnownOutputs, step: int,
                 read: torch.Tensor) -> PreparedStep:
    """The first half of `complete_from_outputs` on one step (`read`: the block's covered
    pixels): a few large operations, free of the Python lock while they run."""
    matrix = fit.operator.take(step).dense()[0]
    left, singular, right = torch.linalg.svd(matrix, full_matrices=False)
    null = singular < NULL_TOLERANCE * singular[0]
    # where the eigenvalues saw a null space the SVD does not, gelsd's own cut-off
    kept = ~null if bool(null.any()) else \
        singular > torch.finfo(singular.dtype).eps * max(matrix.shape) * singular[0]
    solution = torch.zeros_like(fit.solution[step])
    solution[read] = right[kept].T @ (left[:, kept].T @ fit.rhs[step] / singular[kept][:, None])
    if not bool(null.any()):
        return PreparedStep(step, solution)
    directions = torch.zeros(int(null.sum()), len(read), dtype=solution.dtype)
    directions[:, read] = right[null]  # (J, Q)
    part, free = null_space_part(block, directions, solution, outputs, step)
    return PreparedStep(step, solution, directions, part, free)


def complete_step(block: ConvBlock, outputs: KnownOutputs, prepared: PreparedStep
                  ) -> StepCompletion:
    """The second half: the null-space part checked, and the free coefficients set by the
    inequalities (`resolve_free_part`)."""
    solution, directions, part, free = (prepared.solution, prepared.directions, prepared.part,
                                        prepared.free)
    undetermined = torch.zeros_like(solution, dtype=torch.bool)
    if directions is None:
        return StepCompletion(solution, undetermined, False)
    assert part is not None and free is not None
    if not plausible(part, solution):  # wrong masks above: nothing to trust here
        return StepCompletion(solution, in_every_channel(reaches(directions), block), True)
    solution = solution + part
    if not len(free):
        return StepCompletion(solution, undetermined, True)
    resolved = None if outputs.below is None else resolve_free_part(
        block, outputs.below, solution, free, outputs, prepared.step)
    if resolved is None or not plausible(resolved - solution, solution):
        return StepCompletion(solution, reaches(free.maps), True)
    return StepCompletion(resolved, undetermined, True)


def null_space_part(block: ConvBlock, directions: torch.Tensor, solution: torch.Tensor,
                    outputs: KnownOutputs, step: int) -> tuple[torch.Tensor, FreeDirections]:
    """(Q, C_in) Σ_j c_ij n_j with c fitted to the on-units' pre-activations, and the c that
    stay free: a trained victim's top conv has output channels that are off everywhere on a
    frame (40 of 64 on the paper's CNN after 6 PPO updates), and those say nothing of the
    input channels they would read."""
    channels_in = block.conv.in_channels
    columns = direction_outputs(block, directions)  # (C_out, P, C_in, J)
    on = outputs.on[step].flatten(1)  # (C_out, P)
    missing = (outputs.relu[step] - block_output(block, solution)).flatten(1)[on]
    system = columns[on].flatten(1)  # (on-units, C_in·J)
    if len(system) < system.shape[1]:  # zero rows: the reduced SVD then spans every column
        system = torch.cat([system, system.new_zeros(system.shape[1] - len(system),
                                                     system.shape[1])])
        missing = torch.cat([missing, missing.new_zeros(len(system) - len(missing))])
    left, singular, right = torch.linalg.svd(system, full_matrices=False)
    rank = int((singular > NULL_TOLERANCE * singular[:1]).sum())
    coefficients = right[:rank].T @ (left[:, :rank].T @ missing / singular[:rank])

    def as_maps(c: torch.Tensor) -> torch.Tensor:  # (F, C_in·J) → (F, Q, C_in)
        # contiguous: the inequalities reduce and gather over F (a strided amax took 1.3 ms,
        # a tenth of that after one copy)
        maps = c.reshape(-1, channels_in, len(directions)) @ directions
        return maps.transpose(1, 2).contiguous()

    free = right[rank:]
    changes = (columns.flatten(2) @ free.T).permute(2, 0, 1)  # (F, C_out, P)
    return as_maps(coefficients)[0], FreeDirections(
        as_maps(free), changes.reshape(len(free), *outputs.on.shape[1:]))


def direction_outputs(block: ConvBlock, directions: torch.Tensor) -> torch.Tensor:
    """(C_out, P, C_in, J): the conv's output (no bias) with direction j in input channel i."""
    conv, size = block.conv, block.input_size
    channels_out, channels_in, kernel, _ = conv.weight.shape
    per_channel = F.conv2d(directions.view(-1, 1, size, size),
                           conv.weight.double().reshape(-1, 1, kernel, kernel),
                           stride=conv.stride, padding=conv.padding)  # (J, C_out·C_in, h, w)
    return per_channel.view(len(directions), channels_out, channels_in, -1).permute(1, 3, 2, 0)


def convolve(block: ConvBlock, maps: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """The block's conv in float64 on (N, C_in, H, W) maps."""
    conv = block.conv
    return F.conv2d(maps, conv.weight.double(), conv.bias.double() if bias else None,
                    stride=conv.stride, padding=conv.padding)


def block_output(block: ConvBlock, columns: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """(C_out, h, w): the conv applied to one input given as (Q, C_in) columns."""
    return block_outputs(block, columns[None], bias)[0]


def block_outputs(block: ConvBlock, columns: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """(F, C_out, h, w): the conv applied to F inputs given as (F, Q, C_in) columns."""
    size = block.input_size
    maps = columns.transpose(1, 2).reshape(len(columns), block.conv.in_channels, size, size)
    return convolve(block, maps, bias)


def resolve_free_part(block: ConvBlock, below: ConvBlock, solution: torch.Tensor,
                      free: FreeDirections, outputs: KnownOutputs, step: int
                      ) -> torch.Tensor | None:
    """(Q, C_in) the input within `solution` + span(free) that best satisfies the inequalities
    left: the input is a ReLU → BatchNorm output of the block `below` (BN⁻¹ of it is ≥ 0, and
    about half of it exactly 0), and this block's off-units have pre-activations ≤ 0. Hundreds
    of those are active at the truth against tens of free coefficients, so it is the only point
    that violates none; `least_violation` finds it, minimising the total violation so that
    noise leaves it near the truth. None when there are too many free coefficients or the
    linear programme fails."""
    if len(free) > MAX_FREE:
        return None
    rows, bounds = inequalities(block, below, solution, free, ~outputs.on[step])
    z = least_violation(rows, bounds)
    if z is None:
        return None
    return solution + torch.einsum("f,fqc->qc", torch.from_numpy(z), free.maps)


def least_violation(rows: np.ndarray, bounds: np.ndarray) -> np.ndarray | None:
    """z minimising the total violation Σ max(0, rows z − bounds), at the point where the rows
    active at it agree. First a few Newton steps on the squared violation (a millisecond each),
    checked after each: where the rows near-active fix every coefficient and their least-squares
    point violates no row beyond the tolerance, that point is the vertex the linear programme
    stops at (21 of one cnn-small recovery's 24 programmes: HiGHS's vertex to 1e-5, in 2–16
    ms against 60–70). Where the steps end at a point that violates no row beyond the tolerance
    but the rows active there leave coefficients free (a polytope with room inside), that point
    is kept: the inequalities single out no vertex there, and the one HiGHS stopped at was no
    nearer the truth on the held-out captures (the paper cnn's three such programmes, PPO,
    gave the same inputs either way; cnn-small's one was on a step no rule recovers, relative
    error 1.5 against the truth either way), at 60–70 ms a programme. Otherwise (no
    convergence: noise leaves no point that violates nothing) the linear programme (HiGHS)
    decides. None when it fails."""
    end = newton_steps(rows, bounds)
    if end.certified or end.feasible:
        return end.point
    return linear_programme(rows, bounds)


def shared_key(*parts: bytes | np.ndarray | torch.Tensor) -> bytes | None:
    """The key of what a completion reads inside `completions_shared`; None outside."""
    if _SHARED is None:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(part if isinstance(part, bytes) else
                      (part.numpy() if isinstance(part, torch.Tensor) else part).tobytes())
    return digest.digest()


def answered(key: bytes | None, compute: Callable[[], T]) -> T:
    """`compute()`, answered from the first call with the same key (`shared_key`) inside
    `completions_shared`; computed afresh outside."""
    if _SHARED is None or key is None:
        return compute()
    if key not in _SHARED:
        _SHARED[key] = compute()
    return _SHARED[key]


def first_unanswered(order: list[int], keys: dict[int, bytes | None]) -> list[int]:
    """The steps of `order` `answered` will compute: neither answered already nor the same
    as an earlier step."""
    seen: set[bytes] = set()
    steps = []
    for step in order:
        key = keys[step]
        if key is None or (key not in seen and (_SHARED is None or key not in _SHARED)):
            steps.append(step)
        if key is not None:
            seen.add(key)
    return steps


@contextmanager
def completions_shared() -> Iterator[None]:
    """Within: a step's completion met again is answered from the first solve. The walks of
    the other mask rules meet the same ones on the steps they share with the first (their
    masks agree there: one cnn-small step at random init was completed nine times, as often as
    the rest together, and one of the paper cnn's linear programmes, 70 ms, recurred); one
    recovery's worth is kept, keyed by the bytes a completion reads."""
    global _SHARED
    outer, _SHARED = _SHARED, {} if _SHARED is None else _SHARED
    try:
        yield
    finally:
        _SHARED = outer


def linear_programme(rows: np.ndarray, bounds: np.ndarray) -> np.ndarray | None:
    """The least-violation vertex by HiGHS, polished on its near-active rows."""
    from scipy.optimize import linprog
    from scipy.sparse import csr_matrix, hstack, identity

    count, dims = rows.shape
    # variables: z (free coefficients, unbounded), t ≥ 0 (each row's violation)
    result = linprog(np.concatenate([np.zeros(dims), np.ones(count)]),
                     A_ub=hstack([csr_matrix(rows), -identity(count, format="csr")]),
                     b_ub=bounds, bounds=[(None, None)] * dims + [(0, None)] * count,
                     method="highs")
    if result.status != 0:
        return None
    # The programme stops at a vertex: F active rows, each off by its own rounding. Every row
    # near-active there is active at the truth (a unit exactly off), so least squares on all
    # of them averages the rounding out.
    polished = active_least_squares(rows, bounds, result.x[:dims])
    return result.x[:dims] if polished is None else polished


@dataclass(frozen=True)
class NewtonEnd:
    """Where `newton_steps` stopped: the certified vertex, or its last point, and whether that
    point violates no row beyond the tolerance."""

    point: np.ndarray
    certified: bool
    feasible: bool


def newton_steps(rows: np.ndarray, bounds: np.ndarray) -> NewtonEnd:
    """Semismooth Newton steps on ½ Σ max(0, rows z − bounds)² from z = 0, each checked by
    `active_least_squares` on its near-active rows, for at most NEWTON_STEPS."""
    z = np.zeros(rows.shape[1])
    tolerance = active_tolerance(bounds)
    residual = -bounds
    for step in range(NEWTON_STEPS):
        violated = residual > 0
        if not violated.any():
            return NewtonEnd(z, False, True)  # strictly inside: a polytope with room
        part = rows[violated]
        slope = part.T @ residual[violated]
        curvature = part.T @ part
        curvature.flat[::len(curvature) + 1] += NEWTON_DAMPING * np.trace(curvature) \
            / len(curvature)
        direction = -np.linalg.solve(curvature, slope)
        z = z + backtrack(rows, bounds, z, direction, slope, residual[violated])
        residual = rows @ z - bounds
        if step:
            certified = vertex_of_active_rows(rows, bounds, residual, tolerance, strict=True)
            if certified is not None:
                return NewtonEnd(certified, True, True)
    return NewtonEnd(z, False, bool(residual.max() <= tolerance))


def backtrack(rows: np.ndarray, bounds: np.ndarray, z: np.ndarray, direction: np.ndarray,
              slope: np.ndarray, violated: np.ndarray) -> np.ndarray:
    """The Armijo step along `direction` for the squared violation."""
    start, decrease, length = 0.5 * (violated ** 2).sum(), -slope @ direction, 1.0
    while length > 1e-4:
        trial = np.maximum(rows @ (z + length * direction) - bounds, 0)
        if 0.5 * (trial ** 2).sum() <= start - 1e-4 * length * decrease:
            break
        length /= 2
    return length * direction


def active_least_squares(rows: np.ndarray, bounds: np.ndarray, z: np.ndarray,
                         strict: bool = False) -> np.ndarray | None:
    """Least squares on the rows within ACTIVE_TOLERANCE of active at z, when they fix every
    coefficient; with `strict`, only if that point violates no row beyond the tolerance."""
    return vertex_of_active_rows(rows, bounds, rows @ z - bounds, active_tolerance(bounds),
                                 strict)


def active_tolerance(bounds: np.ndarray) -> float:
    return ACTIVE_TOLERANCE * float(np.median(np.abs(bounds)))


def vertex_of_active_rows(rows: np.ndarray, bounds: np.ndarray, residual: np.ndarray,
                          tolerance: float, strict: bool) -> np.ndarray | None:
    """`active_least_squares` given z's residual (rows z − bounds) and the tolerance."""
    active = np.abs(residual) <= tolerance
    if active.sum() < rows.shape[1]:
        return None
    point = full_rank_least_squares(rows[active], bounds[active])
    if point is None or (strict and (rows @ point - bounds).max() > tolerance):
        return None
    return point


def full_rank_least_squares(matrix: np.ndarray, rhs: np.ndarray) -> np.ndarray | None:
    """argmin ‖matrix x − rhs‖ where the matrix has full column rank, else None. By the
    normal equations' Cholesky factor and one refinement step where it is well conditioned (a
    tenth of gelsd's time: the Newton vertex asks up to 13 times a programme); otherwise a
    pivoted QR tells rank deficiency (most of those: active rows that do not yet fix every
    coefficient) at a third of gelsd's cost, and gelsd's SVD solves the rest."""
    normal = matrix.T @ matrix
    try:
        factor = scipy.linalg.cho_factor(normal, check_finite=False)
    except np.linalg.LinAlgError:
        factor = None
    if factor is not None:
        pivots = np.abs(np.diag(factor[0]))
        if pivots.min() > NORMAL_EQUATIONS ** 0.5 * pivots.max():
            point = scipy.linalg.cho_solve(factor, matrix.T @ rhs, check_finite=False)
            return point + scipy.linalg.cho_solve(
                factor, matrix.T @ (rhs - matrix @ point), check_finite=False)
    # gelsd's rank: singular values above machine precision times the larger dimension
    cutoff = np.finfo(matrix.dtype).eps * max(matrix.shape)
    triangle = scipy.linalg.qr(matrix, mode="r", pivoting=True, check_finite=False)[0]
    diagonal = np.abs(np.diag(triangle))
    if diagonal.min() <= cutoff * diagonal.max():
        return None
    point, _, rank, _ = np.linalg.lstsq(matrix, rhs, rcond=None)
    return point if rank == matrix.shape[1] else None


def in_every_channel(pixels: torch.Tensor, block: ConvBlock) -> torch.Tensor:
    """(Q,) → (Q, C_in): D(δ) is the same for every input channel, so is its null space."""
    return pixels[:, None].expand(-1, block.conv.in_channels)


def plausible(change: torch.Tensor, solution: torch.Tensor) -> bool:
    """A null-space part larger than the map it completes means inconsistent equations (the
    masks above were wrong), not a solution: on the paper's CNN it is 2% of the map."""
    return bool(change.norm() <= solution.norm())


def reaches(maps: torch.Tensor) -> torch.Tensor:
    """Where some of (F, ...) maps is not zero; the SVD leaves 1e-17 where it is."""
    peaks = maps.abs().amax(0)
    return peaks > 1e-12 * peaks.max()


def inequalities(block: ConvBlock, below: ConvBlock, solution: torch.Tensor,
                 free: FreeDirections, off: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """rows z ≤ bounds, each row of unit norm, over the units span(free) reaches: the floor of
    the ReLU below (−BN⁻¹ change ≤ BN⁻¹ of `solution`) and the off-units above."""
    gain, shift, mean = (value.flatten()[None, :] for value in bn_affine(below))
    reached = reaches(free.maps)  # (Q, C_in)
    floor_rows = (-free.maps[:, reached] / gain.expand_as(solution)[reached]).T  # (units, F)
    floor_bounds = (solution / gain - shift + mean)[reached]
    changes = free.outputs
    off = off & reaches(changes)
    rows = torch.cat([floor_rows, changes[:, off].T])
    bounds = torch.cat([floor_bounds, -block_output(block, solution)[off]])
    scale = rows.norm(dim=1).clamp_min(1e-300)
    return (rows / scale[:, None]).numpy(), (bounds / scale).numpy()


def block_forward(block: ConvBlock, inputs: torch.Tensor) -> torch.Tensor:
    """Conv → ReLU → BN (eval mode) in float64: what the block above received."""
    relu = F.relu(convolve(block, inputs))
    gain, shift, mean = bn_affine(block)
    return gain * (relu - mean + shift)


def bn_affine(block: ConvBlock) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BN (eval mode) as y = gain · (r − mean + shift): (C, 1, 1) gain, shift and mean."""
    norm = block.norm
    sd = (norm.running_var.double() + norm.eps).sqrt()
    gain = (norm.weight.double() / sd)[:, None, None]
    shift = norm.bias.double()[:, None, None] / gain
    mean = norm.running_mean.double()[:, None, None]
    return gain, shift, mean


def as_map(block: ConvBlock, columns: torch.Tensor) -> torch.Tensor:
    """(N, Q, C_in) → (N, C_in, H, W)."""
    size = block.input_size
    return columns.transpose(1, 2).reshape(len(columns), block.conv.in_channels, size, size)



def solve_input(block: ConvBlock, delta: torch.Tensor, weight_gradient: torch.Tensor,
                outputs: KnownOutputs | None = None) -> torch.Tensor:
    """The conv's input by least squares."""
    return as_map(block, least_squares(block, delta, weight_gradient, outputs).solution)


def input_patches(block: ConvBlock, inputs: torch.Tensor) -> torch.Tensor:
    """(N, C_in·k², P): what each output position of the conv reads."""
    conv = block.conv
    return F.unfold(inputs, conv.kernel_size[0], padding=conv.padding, stride=conv.stride)


def fitted_output_gradient(block: ConvBlock, inputs: torch.Tensor,
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
def robust_input(block: ConvBlock, delta: torch.Tensor, weight_gradient: torch.Tensor,
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



def inverse_diagonal(gram: Gram) -> torch.Tensor:
    """(N, Q) diag(G⁻¹) of symmetric positive semi-definite (N, Q, Q) Gram matrices: by
    their Cholesky factor where G is definite (a tenth of the pseudo-inverse's SVD cost: 0.3 s
    of the recursion's 0.5 s a frame at 84×84 went there), the pseudo-inverse on the steps
    where it is not, or nearly not (a D(δ) with a null space: the pseudo-inverse drops
    directions under 1e-13 of the largest eigenvalue, where the Cholesky factor would blow
    up)."""
    definite = gram.spread > NEAR_SINGULAR
    spread = torch.empty(gram.matrix.shape[:2], dtype=gram.matrix.dtype)
    if bool(definite.any()):
        spread[definite] = torch.cholesky_inverse(gram.factor[definite]).diagonal(dim1=1,
                                                                                  dim2=2)
    if not bool(definite.all()):
        spread[~definite] = torch.linalg.pinv(gram.matrix[~definite]).diagonal(dim1=1, dim2=2)
    return spread


def solve_input_with_noise(block: ConvBlock, delta: torch.Tensor, weight_gradient: torch.Tensor,
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
