"""The point of a few free coefficients that violates a set of inequalities least.

rows z ≤ bounds, hundreds of rows against tens of coefficients: the null-space completion's
inequalities (`layers.null_space`). A few semismooth Newton steps on the squared violation
find the vertex where the active rows agree in most cases; the linear programme (HiGHS) decides
where they do not converge. Pure numpy: no layer in sight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.linalg

from gradleak.inversion.layers.conv_equations import NORMAL_EQUATIONS

# a row of the inequalities within this fraction of their median bound is taken as active
ACTIVE_TOLERANCE = 1e-4


# Newton steps on the squared violation before giving up on a certified vertex; a polytope with
# room inside never certifies (its last point is kept), and only a programme still violated
# after them goes to the linear programme
NEWTON_STEPS = 16


# the Newton system's ridge, times its mean diagonal: the violated rows may not fix every
# coefficient
NEWTON_DAMPING = 1e-10


def least_violation(rows: np.ndarray, bounds: np.ndarray) -> np.ndarray | None:
    """z minimising the total violation Σ max(0, rows z − bounds), at the point where the rows
    active at it agree. First a few Newton steps on the squared violation (a millisecond each),
    checked after each: where the rows near-active fix every coefficient and their least-squares
    point violates no row beyond the tolerance, that point is the vertex the linear programme
    stops at, found at a fraction of its cost. Where the steps end at a point that violates no
    row beyond the tolerance but the rows active there leave coefficients free (a polytope with
    room inside), that point is kept: the inequalities single out no vertex there, and the one
    a linear programme would stop at is no nearer the truth. Otherwise (no convergence: noise
    leaves no point that violates nothing) the linear programme (HiGHS) decides. None when it
    fails."""
    end = newton_steps(rows, bounds)
    if end.certified or end.feasible:
        return end.point
    return linear_programme(rows, bounds)


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
