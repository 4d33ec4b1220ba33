"""Gauss-Newton on N independent least-squares problems at once (one per step).

`residual` maps the unknowns (N, ...) to residuals (N, R) whose row n depends on unknown n
alone. Each step's Jacobian is reached only through products (`torch.func.jvp` and `vjp`); its
damped normal equations are solved by conjugate gradients to a tolerance that tightens as the
residual falls (inexact Newton: loose while far, tight near the solution, where the
convergence is then quadratic), and each step is halved until the residual falls. A problem
stops when its residual is below `floor`, or when a step no longer takes off a fraction
`STALLED` of it (the data's own precision reached). `deviations` then says how far the
solution moves with the data's noise: the residual left, taken as that noise, sent through
the normal equations a few times.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.func import jvp, vjp

Residual = Callable[[torch.Tensor], torch.Tensor]

STEPS = 40  # Gauss-Newton steps at most
ITERATIONS = 1000  # conjugate-gradient iterations a step, at most
DAMPING = 1e-9  # λ of (JᵀJ + λI): keeps the unknowns no residual reads where they started
HALVINGS = 20  # backtracking halvings of a step before the problem stops
STALLED = 0.01  # a step that takes off less than this fraction of the residual ends the solve
SAMPLES = 8  # noise draws that estimate each unknown's deviation


def gauss_newton(residual: Residual, start: torch.Tensor, floor: float = 1e-14,
                 steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """The unknowns that minimise each problem's ‖residual‖, from `start`, and how many steps
    each problem took ((N,) int)."""
    x = start.clone()
    norms = residual(x).flatten(1).norm(dim=1)
    active = norms > floor
    taken = torch.zeros(len(x), dtype=torch.int64)
    for _ in range(steps):
        if not bool(active.any()):
            break
        values, pullback = vjp(residual, x)
        gradient = pullback(values)[0]

        def normal(v: torch.Tensor, x: torch.Tensor = x,
                   pullback: Callable = pullback) -> torch.Tensor:
            return pullback(jvp(residual, (x,), (v,))[1])[0] + DAMPING * v

        tolerance = norms.sqrt().clamp(max=0.1)
        direction = conjugate_gradients(normal, -gradient, tolerance, active)
        scale = torch.ones(len(x), dtype=x.dtype)
        pending = active.clone()
        new_norms = norms.clone()
        for _ in range(HALVINGS):
            tried = residual(x + per_step(scale, x) * direction).flatten(1).norm(dim=1)
            better = pending & (tried < norms)
            new_norms = torch.where(better, tried, new_norms)
            pending = pending & ~better
            if not bool(pending.any()):
                break
            scale = torch.where(pending, scale / 2, scale)
        moved = active & ~pending
        x = torch.where(per_step(moved, x), x + per_step(scale, x) * direction, x)
        taken += moved.long()
        active = moved & (new_norms > floor) & (new_norms < (1 - STALLED) * norms)
        norms = new_norms
    return x, taken


def deviations(residual: Residual, x: torch.Tensor, samples: int = SAMPLES) -> torch.Tensor:
    """Each unknown's standard deviation at the least-squares point x, were the residual left
    there noise of one level across the rows: σ² diag((JᵀJ)⁻¹), with σ the residual's rms
    (corrected for the unknowns fitted), estimated from `samples` noise draws ε as the mean of
    ((JᵀJ)⁻¹Jᵀε)². Seeded: the same x gives the same estimate."""
    values, pullback = vjp(residual, x)
    rows = values.flatten(1).shape[1]
    unknowns = x[0].numel()
    sigma = values.flatten(1).norm(dim=1) / max(rows - unknowns, 1) ** 0.5

    def normal(v: torch.Tensor) -> torch.Tensor:
        return pullback(jvp(residual, (x,), (v,))[1])[0] + DAMPING * v

    generator = torch.Generator().manual_seed(0)
    active = torch.ones(len(x), dtype=torch.bool)
    total = torch.zeros_like(x)
    for _ in range(samples):
        noise = torch.randn(values.shape, generator=generator, dtype=values.dtype)
        rhs = pullback(noise * per_step(sigma, values))[0]
        total = total + conjugate_gradients(normal, rhs, torch.full_like(sigma, 0.01),
                                            active).pow(2)
    return (total / samples).sqrt()


def conjugate_gradients(normal: Callable[[torch.Tensor], torch.Tensor], rhs: torch.Tensor,
                        tolerance: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Per problem, `normal`(d) = rhs to ‖residual‖ ≤ tolerance·‖rhs‖ (problems not `active`
    stay at 0)."""
    def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * b).flatten(1).sum(1)

    solution = torch.zeros_like(rhs)
    remainder = torch.where(per_step(active, rhs), rhs, 0.0)
    direction = remainder.clone()
    squared = dot(remainder, remainder)
    goal = (tolerance * rhs.flatten(1).norm(dim=1)) ** 2
    running = active & (squared > goal)
    for _ in range(ITERATIONS):
        if not bool(running.any()):
            break
        product = normal(direction)
        curvature = dot(direction, product)
        alpha = torch.where(running, squared / curvature.clamp_min(1e-300), 0.0)
        solution = solution + per_step(alpha, rhs) * direction
        remainder = remainder - per_step(alpha, rhs) * product
        new_squared = dot(remainder, remainder)
        beta = torch.where(running, new_squared / squared.clamp_min(1e-300), 0.0)
        direction = remainder + per_step(beta, rhs) * direction
        squared = new_squared
        running = running & (squared > goal)
    return solution


def per_step(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(N,) values shaped to broadcast over (N, ...)."""
    return values.reshape(-1, *[1] * (like.dim() - 1))
