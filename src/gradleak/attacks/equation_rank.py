"""How much of a frame the first conv's equations pin down, and where the prior decides.

The equations of one step (`inversion.first_conv`) are linear in the network input x: A x = b,
A stacking the on-units' output rows and the weight-gradient rows (each scaled to unit norm,
as the solver scales them). The frame is determined up to A's null space. This module forms A
for one frame as a dense matrix and reads its spectrum: the rank (as a fraction of the C·H·W
unknowns), the projector onto the row space, and its diagonal per pixel (the leverage: 1 where
the equations fix a pixel's value, 0 where only the prior sets it). It is an analysis tool,
sized for one frame at a time (84×84: a 13k × 21k matrix; the rank alone takes minutes on 2
cores, the basis more).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from gradleak.inversion.first_conv import FirstConvEquations

BASIS_BATCH = 512  # unit vectors pushed through the equations at once


@dataclass
class EquationSpace:
    """The row space of one frame's equations."""

    rank: int
    unknowns: int
    basis: torch.Tensor  # (rank, C·H·W) orthonormal rows spanning A's row space
    singular_values: torch.Tensor  # every singular value, largest first

    @property
    def rank_fraction(self) -> float:
        return self.rank / self.unknowns

    def leverage(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Per input entry, how much of it the equations fix (diag of the row-space projector),
        shaped like the network input (C, H, W)."""
        return self.basis.pow(2).sum(0).view(shape)

    def row_space_part(self, x: torch.Tensor) -> torch.Tensor:
        """The component of x (C, H, W) the equations see; what is left lies in the null space."""
        flat = x.reshape(-1).double()
        return (self.basis.T @ (self.basis @ flat)).view(x.shape)


@torch.no_grad()
def equation_matrix(equations: FirstConvEquations, frame: int, shape: torch.Size
                    ) -> torch.Tensor:
    """The row-scaled equations of frame `frame` as a dense (rows, C·H·W) float64 matrix:
    the outputs at its on-units, then ∇W₁'s entries when the weight gradient is used."""
    one = select_frame(equations, frame)
    unknowns = int(torch.tensor(shape[1:]).prod())
    weight = one.block.conv.weight.double()
    out_scale = 1 / weight.flatten(1).norm(dim=1)[None, :, None, None]
    on = one.on[0].flatten()
    blocks = []
    for start in range(0, unknowns, BASIS_BATCH):
        count = min(BASIS_BATCH, unknowns - start)
        basis = torch.zeros(count, unknowns, dtype=torch.float64)
        basis[torch.arange(count), torch.arange(start, start + count)] = 1.0
        basis = basis.view(count, *shape[1:])
        rows = [(one.conv(basis) * out_scale).flatten(1)[:, on]]
        if one.weight_gradient is not None:
            delta = one.delta.expand(count, *one.delta.shape[1:])
            wide = FirstConvEquations(one.block, one.on, one.off, one.outputs, delta, None)
            norms = one.delta.flatten(2).norm(dim=2)  # (1, O)
            scale = torch.where(norms > 0, 1 / norms.clamp_min(1e-300), 0.0)[..., None]
            rows.append((wide.weight_gradient_of(basis) * scale).flatten(1))
        blocks.append(torch.cat(rows, 1))  # (count, rows): columns of A
    return torch.cat(blocks).T.contiguous()


def select_frame(equations: FirstConvEquations, frame: int) -> FirstConvEquations:
    pick = slice(frame, frame + 1)
    gradient = None if equations.weight_gradient is None else equations.weight_gradient[pick]
    return replace(equations, on=equations.on[pick], off=equations.off[pick],
                   outputs=equations.outputs[pick], delta=equations.delta[pick],
                   weight_gradient=gradient, bias_check=None, output_noise=None, colour=None,
                   ceiling=None if equations.ceiling is None else equations.ceiling[pick])


def gram(matrix: torch.Tensor) -> torch.Tensor:
    """The Gram matrix of the shorter side: the same nonzero spectrum, the smaller problem."""
    return matrix @ matrix.T if matrix.shape[0] <= matrix.shape[1] else matrix.T @ matrix


def singular_values(matrix: torch.Tensor) -> torch.Tensor:
    return torch.linalg.eigvalsh(gram(matrix)).flip(0).clamp_min(0).sqrt()


def rank_above(singular: torch.Tensor, tolerance: float) -> int:
    return int((singular > tolerance * singular[0]).sum()) if len(singular) else 0


@torch.no_grad()
def equation_rank(equations: FirstConvEquations, frame: int, shape: torch.Size,
                  tolerance: float = 1e-6) -> int:
    """The rank alone, from eigenvalues without eigenvectors: minutes for one 84×84 frame of
    the paper's cnn (docs/training-free.md)."""
    return rank_above(singular_values(equation_matrix(equations, frame, shape)), tolerance)


@torch.no_grad()
def equation_space(equations: FirstConvEquations, frame: int, shape: torch.Size,
                   tolerance: float = 1e-6) -> EquationSpace:
    """A's row space for one frame: singular values above `tolerance` × the largest count.
    They come from the Gram matrix of the shorter side (the cost is set by the fewer of rows
    and unknowns), whose eigenvalues resolve singular values down to ~1e-8 of the largest;
    below that a direction counts as free."""
    matrix = equation_matrix(equations, frame, shape)
    rows, unknowns = matrix.shape
    values, vectors = torch.linalg.eigh(gram(matrix))
    singular, vectors = values.flip(0).clamp_min(0).sqrt(), vectors.flip(1)
    rank = rank_above(singular, tolerance)
    # the right singular vectors: Aᵀu/σ from the rows' Gram, or the unknowns' own eigenvectors
    basis = (matrix.T @ vectors[:, :rank] / singular[:rank]).T if rows <= unknowns \
        else vectors[:, :rank].T
    return EquationSpace(rank, unknowns, basis.contiguous(), singular)
