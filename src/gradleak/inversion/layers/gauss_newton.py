"""Gauss-Newton on N independent least-squares problems at once (one per step).

`residual` maps the unknowns (N, ...) to residuals (N, R) whose row n depends on unknown n
alone. Each step's Jacobian is reached only through products, J v and Jᵀ u, both by reverse
mode from one forward pass at that step's point (`Linearisation`); its damped normal equations
are solved by conjugate gradients to a tolerance that tightens as the residual falls (inexact
Newton: loose while far, tight near the solution, where the convergence is then quadratic),
and each step is halved until the residual falls. A problem stops when its residual is below
`floor`, or when a step no longer takes off a fraction `STALLED` of it (the data's own
precision reached). `deviations` then says how far the solution moves with the data's noise:
the residual left, taken as that noise, sent through the normal equations a few times.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

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
        jacobian = Linearisation(residual, x)
        gradient = jacobian.transposed_times(jacobian.values)
        tolerance = norms.sqrt().clamp(max=0.1)
        direction = conjugate_gradients(jacobian.normal, -gradient, tolerance, active)
        del jacobian  # its graph
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
    jacobian = Linearisation(residual, x)
    values = jacobian.values
    rows = values.flatten(1).shape[1]
    unknowns = x[0].numel()
    sigma = values.flatten(1).norm(dim=1) / max(rows - unknowns, 1) ** 0.5

    generator = torch.Generator().manual_seed(0)
    active = torch.ones(len(x), dtype=torch.bool)
    total = torch.zeros_like(x)
    for _ in range(samples):
        noise = torch.randn(values.shape, generator=generator, dtype=values.dtype)
        rhs = jacobian.transposed_times(noise * per_step(sigma, values))
        total = total + conjugate_gradients(jacobian.normal, rhs, torch.full_like(sigma, 0.01),
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


class Linearisation:
    """The residual's Jacobian J at x as products, from one forward pass: Jᵀ u by reverse mode,
    and J v by reverse mode through Jᵀ u (linear in u, so its gradient with respect to u is J v).
    Forward mode is the direct way to J v, but it redoes the forward pass for every product, and
    PyTorch's forward mode takes a slow Python path for each operation that mixes a dual tensor
    with a plain one (the blocks' constants)."""

    def __init__(self, residual: Residual, x: torch.Tensor) -> None:
        self.x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            values = residual(self.x)
            self.u = torch.zeros_like(values, requires_grad=True)
            self.transposed = self._grad(values, self.x, self.u, create_graph=True)
        self._values, self.values = values, values.detach()

    def transposed_times(self, u: torch.Tensor) -> torch.Tensor:
        """Jᵀ u."""
        return self._grad(self._values, self.x, u).detach()

    def times(self, v: torch.Tensor) -> torch.Tensor:
        """J v."""
        return self._grad(self.transposed, self.u, v).detach()

    def normal(self, v: torch.Tensor) -> torch.Tensor:
        """(JᵀJ + λI) v."""
        return self.transposed_times(self.times(v)) + DAMPING * v

    @staticmethod
    def _grad(output: torch.Tensor, wrt: torch.Tensor, weights: torch.Tensor,
              create_graph: bool = False) -> torch.Tensor:
        if not output.requires_grad:  # a residual that does not read the unknowns
            return torch.zeros_like(wrt)
        with torch.enable_grad():
            (gradient,) = torch.autograd.grad(output, wrt, weights, retain_graph=True,
                                              create_graph=create_graph, allow_unused=True)
        return torch.zeros_like(wrt) if gradient is None else gradient


def per_step(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(N,) values shaped to broadcast over (N, ...)."""
    return values.reshape(-1, *[1] * (like.dim() - 1))
