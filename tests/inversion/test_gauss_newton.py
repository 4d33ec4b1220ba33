"""Gauss-Newton on N independent problems at once: each converges to its own solution, as if
solved alone, and a problem already solved takes no step."""

from __future__ import annotations

import torch

from gradleak.inversion.layers.gauss_newton import gauss_newton


def problems(count: int, seed: int = 0):
    """Overdetermined smooth systems A_n tanh(x_n) = A_n tanh(x*_n) (6 equations, 4 unknowns)."""
    generator = torch.Generator().manual_seed(seed)
    matrices = torch.randn(count, 6, 4, dtype=torch.float64, generator=generator)
    truth = 0.8 * torch.randn(count, 4, dtype=torch.float64, generator=generator)
    target = torch.einsum("nij,nj->ni", matrices, torch.tanh(truth))

    def residual(x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("nij,nj->ni", matrices, torch.tanh(x)) - target

    return residual, truth


def test_each_problem_reaches_its_own_solution_and_a_solved_one_stays() -> None:
    residual, truth = problems(3)
    start = truth + 0.3 * torch.sin(torch.arange(12, dtype=torch.float64)).view(3, 4)
    start[1] = truth[1]  # already solved
    found, steps = gauss_newton(residual, start)
    assert float((found - truth).abs().max()) <= 1e-10
    assert steps[1] == 0 and bool((steps[[0, 2]] > 0).all())
    alone, _ = gauss_newton(lambda x: residual(torch.cat([x, truth[1:]]))[:1], start[:1])
    assert float((alone - found[:1]).abs().max()) <= 1e-12  # the others do not change it


def test_an_inconsistent_problem_stops_at_its_least_squares_point() -> None:
    """With data off by noise the residual cannot vanish: the solve stops where a step no longer
    lowers it, at a point whose gradient Jᵀr is (near) zero."""
    residual, truth = problems(2, seed=1)
    noise = 1e-3 * torch.randn(2, 6, dtype=torch.float64,
                               generator=torch.Generator().manual_seed(5))

    def noisy(x: torch.Tensor) -> torch.Tensor:
        return residual(x) + noise

    found, steps = gauss_newton(noisy, truth.clone())
    x = found.clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(0.5 * noisy(x).pow(2).sum(), x)
    assert float(gradient.abs().max()) <= 1e-7  # Jᵀr; r itself is ~1e-3
    assert float((found - truth).abs().max()) <= 1e-2
    assert bool((steps >= 1).all()) and bool((steps < 40).all())
