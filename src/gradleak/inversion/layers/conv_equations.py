"""One conv's weight-gradient equations and their least squares.

On one sample a conv's weight gradient is Σ_p δ(p) ⊗ patch_p(a): linear in the conv's input a,
with one matrix D(δ) shared by all input channels (row (o, k): δ(o, ·) placed at the pixels
kernel tap k reads). `TapOperator` keeps D implicit, `Gram` holds DᵀD and its Cholesky factor,
`solve_least_squares` solves a batch of steps at once. The conv's inverse (`layers.conv`) and
the null-space completion (`layers.null_space`) are built on these.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class ConvLayer(Protocol):
    """What a conv's inverse reads: a plain Conv2d with a bias (square kernel and stride, no
    groups or dilation) on a map of any shape (the walk's `ConvBlock` is one)."""

    name: str  # the conv module's name, e.g. "encoder.3"
    conv: nn.Conv2d
    input_shape: tuple[int, int]  # the input map's height and width


@lru_cache(maxsize=32)
def tap_map(shape: tuple[int, int], kernel: int, stride: int, padding: int) -> torch.Tensor:
    """(Q, k², P): which input pixel each output position's kernel tap reads. Shared, read
    only: a function of the block's geometry, asked for at every solve."""
    height, width = shape
    basis = torch.eye(height * width, dtype=torch.float64).view(-1, 1, height, width)
    return F.unfold(basis, kernel, padding=padding, stride=stride)


def covered_pixels(block: ConvLayer) -> torch.Tensor:
    """(Q,) bool: the input pixels some output position reads. A strided conv without padding
    can leave the last rows and columns unread (NatureCNN's 15×15 map under its 4×4, stride-2
    conv); no gradient says anything about them. Shared, read only."""
    conv = block.conv
    return read_pixels(block.input_shape, conv.kernel_size[0], conv.stride[0],
                       conv.padding[0])


@lru_cache(maxsize=32)
def read_pixels(shape: tuple[int, int], kernel: int, stride: int, padding: int
                ) -> torch.Tensor:
    return tap_map(shape, kernel, stride, padding).flatten(1).any(1)


@lru_cache(maxsize=32)
def tap_pixels(shape: tuple[int, int], kernel: int, stride: int, padding: int
               ) -> torch.Tensor:
    """(k², P) the index, among the covered pixels, of the pixel kernel tap k reads at output
    position p; −1 where it reads padding. Shared, read only."""
    taps = tap_map(shape, kernel, stride, padding)[read_pixels(shape, kernel, stride,
                                                                padding)]
    return torch.where(taps.any(0), taps.argmax(0), -1)


@lru_cache(maxsize=32)
def gram_pairs(shape: tuple[int, int], kernel: int, stride: int, padding: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """For the Gram matrix of D(δ): each pair of output positions (p, p') a tap reads pixels at,
    as its index p·P + p' into δᵀδ and its index q·Q' + q' into the Gram matrix."""
    pixels = tap_pixels(shape, kernel, stride, padding)
    positions, covered = pixels.shape[1], int(read_pixels(shape, kernel, stride, padding).sum())
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
    the dense product's C_out·k²·Q'²."""

    delta: torch.Tensor  # (N, C_out, P)
    geometry: tuple[tuple[int, int], int, int, int]  # input shape, kernel, stride, padding

    @classmethod
    def of(cls, block: ConvLayer, delta: torch.Tensor) -> TapOperator:
        conv = block.conv
        return cls(delta.flatten(2), (block.input_shape, conv.kernel_size[0], conv.stride[0],
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


# D(δ) whose Gram matrix's Cholesky pivots span less than this (squared) is solved by its
# normal equations, and has no null space: an exact null direction leaves a pivot at rounding
# level, far below any well-posed D's
NORMAL_EQUATIONS = 1e-8
# a Gram matrix whose Cholesky pivots span more than this (squared) is inverted by the
# pseudo-inverse instead (pinv's own cut-off is 1e-13 of the largest eigenvalue)
NEAR_SINGULAR = 1e-10


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


def convolve(block: ConvLayer, maps: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """The block's conv in float64 on (N, C_in, H, W) maps."""
    conv = block.conv
    return F.conv2d(maps, conv.weight.double(), conv.bias.double() if bias else None,
                    stride=conv.stride, padding=conv.padding)


def block_output(block: ConvLayer, columns: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """(C_out, h, w): the conv applied to one input given as (Q, C_in) columns."""
    return block_outputs(block, columns[None], bias)[0]


def block_outputs(block: ConvLayer, columns: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """(F, C_out, h, w): the conv applied to F inputs given as (F, Q, C_in) columns."""
    return convolve(block, as_map(block, columns), bias)


def as_map(block: ConvLayer, columns: torch.Tensor) -> torch.Tensor:
    """(N, Q, C_in) → (N, C_in, H, W)."""
    return columns.transpose(1, 2).reshape(len(columns), block.conv.in_channels,
                                           *block.input_shape)


def input_patches(block: ConvLayer, inputs: torch.Tensor) -> torch.Tensor:
    """(N, C_in·k², P): what each output position of the conv reads."""
    conv = block.conv
    return F.unfold(inputs, conv.kernel_size[0], padding=conv.padding, stride=conv.stride)
