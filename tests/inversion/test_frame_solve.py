"""The frame solve's prior and constraints: edges kept where the frame has them, the first conv's
off-units and the input range enforced, and an exact preconditioner."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import victim_with_statistics

from gradleak.attacks.exact import ExactConfig
from gradleak.errors import ConfigError
from gradleak.inversion.conv_blocks import conv_blocks
from gradleak.inversion.first_conv import FirstConvEquations
from gradleak.inversion.frame_solve import (
    Bounds,
    ColourAxes,
    FrameSolve,
    Tie,
    degree,
    edge_weights,
    normal_equations,
    same_frames,
    smoothness_normal,
    solve_frames,
    solve_inputs,
    uniform_edges,
    with_violated,
)

SIZE = 32


def blocky_frames(count: int, seed: int) -> torch.Tensor:
    """(count, SIZE, SIZE, 3) frames of flat rectangles with sharp edges, as Doom's walls,
    floors and doorways are (0..255, float64)."""
    generator = torch.Generator().manual_seed(seed)
    frames = torch.empty(count, SIZE, SIZE, 3, dtype=torch.float64)
    for frame in frames:
        frame[:] = torch.rand(3, generator=generator, dtype=torch.float64) * 255
        for _ in range(5):
            top, left = torch.randint(0, SIZE - 8, (2,), generator=generator).tolist()
            height, width = torch.randint(6, 16, (2,), generator=generator).tolist()
            frame[top:top + height, left:left + width] = \
                torch.rand(3, generator=generator, dtype=torch.float64) * 255
    return frames


@torch.no_grad()
def first_conv_equations_of(frames: torch.Tensor, seed: int = 5):
    """The first conv's equations for these frames, as the recursion would give them (units on
    where the true pre-activation is, δ₁ a random field on them: the equations are linear in x
    for any), and the true network inputs."""
    victim = victim_with_statistics(torch.float64)
    block = conv_blocks(victim)[0]
    transform = victim.roles().transform
    x = transform.apply(frames)
    z = block.conv(x)
    on = z > 0
    generator = torch.Generator().manual_seed(seed)
    delta = torch.randn(z.shape, generator=generator, dtype=torch.float64) * on
    bias = block.conv.bias.double()[:, None, None]
    equations = FirstConvEquations(block, on, ~on, (z - bias) * on, delta, None)
    gradient = equations.weight_gradient_of(x).view(len(x), *block.conv.weight.shape)
    return replace(equations, weight_gradient=gradient), transform, x


@pytest.fixture(scope="module")
def equations_of_blocky_frames():
    return first_conv_equations_of(blocky_frames(6, seed=1))


def errors(frames: torch.Tensor, x: torch.Tensor, transform) -> torch.Tensor:  # noqa: ANN001
    truth = transform.invert(x)
    return (frames - truth).flatten(1).norm(dim=1) / truth.flatten(1).norm(dim=1)


def test_edge_rounds_land_nearer_a_frame_of_flat_regions(equations_of_blocky_frames) -> None:
    """What the equations leave free is filled by the prior: weighing edges as total
    variation does keeps the rectangles' edges sharp, so every frame lands nearer the truth
    than with the quadratic smoothness (measured when written: 25-45% less error)."""
    equations, transform, x = equations_of_blocky_frames
    quadratic = solve_frames(equations, transform, FrameSolve(rounds=0), noise=None)[0]
    edges = solve_frames(equations, transform, FrameSolve(inequalities=False, rounds=6),
                         noise=None)[0]
    before, after = errors(quadratic, x, transform), errors(edges, x, transform)
    assert float(before.min()) > 1e-3  # the equations do leave the frames partly free
    assert bool((after < 0.9 * before).all())


@torch.no_grad()
def test_inequality_rounds_enforce_the_off_units_and_the_range(
        equations_of_blocky_frames) -> None:
    """The quadratic solve turns some off-units of the first conv on and leaves the input range
    (by up to 0.04-0.05 when written); the rounds that add what is violated as equalities at
    its bound cut both by more than 20x (a penalty, so not to 0: measured 66x)."""
    equations, transform, x = equations_of_blocky_frames
    bounds = Bounds.of(transform)
    ceiling = -equations.block.conv.bias.double()[:, None, None]

    def violations(inequalities: bool) -> tuple[float, float]:
        solve = FrameSolve(rounds=3, inequalities=inequalities, edge_scale=0.0)
        solution = solve_inputs(equations, torch.full_like(x, 0.5), solve, bounds=bounds)
        off = (equations.conv(solution) - ceiling).clamp_min(0)[equations.off]
        outside = (solution - bounds.high).clamp_min(0) + (bounds.low - solution).clamp_min(0)
        return float(off.max()), float(outside.max())

    free, enforced = violations(False), violations(True)
    assert free[0] > 1e-2 and free[1] > 1e-2  # there is something to enforce
    assert enforced[0] <= free[0] / 20 and enforced[1] <= free[1] / 20


def test_the_fused_product_is_the_equations_normal_operator(equations_of_blocky_frames) -> None:
    """AᵀA v from one unfold and one fold equals the product built from each set's own conv and
    adjoint, with the violated off-units and the range in it; its diagonal is AᵀA's."""
    equations, transform, x = equations_of_blocky_frames
    bounds = Bounds.of(transform)
    rows = torch.linspace(0.5, 2.0, len(x), dtype=torch.float64)
    outside = x + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(2),
                                    dtype=torch.float64)  # some off-units and pixels violated
    system = with_violated(normal_equations(equations, x.shape, rows), outside, bounds)
    assert float(system.box.sum()) > 0 and float((system.outputs * equations.off).sum()) > 0
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    delta = equations.delta.flatten(2)
    squares = delta.pow(2).sum(2, keepdim=True)  # a channel with no on-unit has no row
    gradient_rows = torch.where(squares > 0, rows[:, None, None] / squares.clamp_min(1e-300), 0)
    expected = equations.conv_adjoint(equations.conv(v) * system.outputs, x.shape) \
        + equations.weight_gradient_adjoint(equations.weight_gradient_of(v) * gradient_rows,
                                            x.shape) + system.box * v
    assert torch.allclose(system(v), expected, rtol=1e-10, atol=1e-12)
    for pixel in [(0, 0, 0, 0), (1, 2, 7, 19), (5, 1, SIZE - 1, 3)]:
        unit = torch.zeros_like(x)
        unit[pixel] = 1
        assert float(system(unit)[pixel]) == pytest.approx(float(system.diagonal[pixel]),
                                                            rel=1e-9)


def test_edge_weights_are_one_on_flat_ground_and_shrink_across_an_edge() -> None:
    x = torch.zeros(1, 3, 4, 4, dtype=torch.float64)
    x[..., 2:] = 0.5  # a vertical edge of colour distance 0.5·√3 between columns 1 and 2
    rows, cols = edge_weights(x, 0.01)
    assert bool((rows == 1).all())
    assert torch.allclose(cols[..., 1], torch.full_like(cols[..., 1], 0.01 / (0.5 * 3 ** 0.5)))
    assert bool((cols[..., [0, 2]] == 1).all())


def test_the_preconditioner_is_the_prior_operators_diagonal() -> None:
    """degree(W) = diag(DᵀWD), read off the operator one unit vector at a time."""
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(1, 1, 5, 6, generator=generator, dtype=torch.float64)
    for edges in (uniform_edges(x), edge_weights(x, 0.1)):
        diagonal = torch.empty(30, dtype=torch.float64)
        for pixel in range(30):
            unit = torch.zeros(30, dtype=torch.float64)
            unit[pixel] = 1
            diagonal[pixel] = smoothness_normal(unit.view(1, 1, 5, 6), edges).flatten()[pixel]
        assert torch.allclose(degree(edges).flatten(), diagonal, atol=1e-15)


def test_the_colour_weighted_preconditioner_is_its_operators_diagonal() -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.rand(1, 3, 4, 5, generator=generator, dtype=torch.float64)
    edges = edge_weights(x, 0.1)
    diagonal = torch.empty(60, dtype=torch.float64)
    for entry in range(60):
        unit = torch.zeros(60, dtype=torch.float64)
        unit[entry] = 1
        diagonal[entry] = smoothness_normal(unit.view(1, 3, 4, 5), edges, 5.0).flatten()[entry]
    expected = degree(edges, 5.0, 3).expand(1, 3, 4, 5).flatten()
    assert torch.allclose(expected, diagonal, atol=1e-15)


def test_colour_changes_cost_chroma_times_a_brightness_change() -> None:
    """xᵀ(DᵀWDK)x: a ramp shared by every channel costs as at chroma 1, a ramp that only
    changes the colour (channels summing to zero) chroma times as much; the operator is
    symmetric, so CG stays valid."""
    ramp = torch.linspace(0, 1, 6, dtype=torch.float64).expand(4, 6)
    grey = ramp.expand(1, 3, 4, 6)
    colour = torch.stack([ramp, -ramp, 0 * ramp])[None]
    edges = uniform_edges(grey)

    def energy(x: torch.Tensor, chroma: float) -> float:
        return float((x * smoothness_normal(x, edges, chroma)).sum())

    assert energy(grey, 5.0) == pytest.approx(energy(grey, 1.0), rel=1e-12)
    assert energy(colour, 5.0) == pytest.approx(5 * energy(colour, 1.0), rel=1e-12)
    a, b = (torch.rand(1, 3, 4, 6, generator=torch.Generator().manual_seed(i),
                       dtype=torch.float64) for i in (2, 3))
    assert float((a * smoothness_normal(b, edges, 5.0)).sum()) == pytest.approx(
        float((b * smoothness_normal(a, edges, 5.0)).sum()), rel=1e-12)


def tinted_frame(tint: torch.Tensor, seed: int) -> torch.Tensor:
    """(1, 3, 6, 7) a random brightness pattern along `tint`, plus a 10× weaker one along the
    first channel: the third colour direction never varies."""
    generator = torch.Generator().manual_seed(seed)
    pattern, weak = (torch.rand(2, 1, 1, 6, 7, generator=generator, dtype=torch.float64))
    return pattern * tint[None, :, None, None] + 0.1 * weak * torch.tensor(
        [1.0, 0.0, 0.0], dtype=torch.float64)[None, :, None, None]


def test_a_frames_colour_axes_weigh_its_own_tint_least() -> None:
    """A frame whose differences run along a warm tint has that tint as its axis of weight 1;
    the others weigh (λ_max / λ)^power, as their difference variances say. A flat frame keeps
    every axis at weight 1."""
    tint = torch.tensor([0.8, 0.5, 0.33], dtype=torch.float64)
    tint = tint / tint.norm()
    x = tinted_frame(tint, 0)
    axes = ColourAxes.of(x, 0.5)
    assert abs(float(axes.axes[0, :, -1] @ tint)) == pytest.approx(1.0, abs=1e-2)
    assert float(axes.weights[0, -1]) == 1.0
    differences = torch.cat([(x[..., 1:, :] - x[..., :-1, :]).flatten(2),
                             (x[..., :, 1:] - x[..., :, :-1]).flatten(2)], 2)[0]
    variances = ((axes.axes[0].t() @ differences) ** 2).sum(1)
    # the third colour direction never varies: its weight stops at a variance 1e-6 of the largest
    assert float(axes.weights[0, 1]) == pytest.approx(float(variances[-1] / variances[1]) ** 0.5,
                                                      rel=1e-9)
    assert float(axes.weights[0, 1]) > 3 and float(axes.weights[0, 0]) == pytest.approx(1e3)
    flat = ColourAxes.of(torch.full((1, 3, 4, 4), 0.3, dtype=torch.float64), 0.5)
    assert torch.equal(flat.weights, torch.ones(1, 3, dtype=torch.float64))


def test_the_colour_axes_prior_is_symmetric_and_its_preconditioner_its_diagonal() -> None:
    """U S DᵀW_kD Uᵀ with one edge weight per axis: ⟨a, Lb⟩ = ⟨La, b⟩ (CG needs it), and
    degree() is its diagonal, read off one unit vector at a time."""
    x = tinted_frame(torch.tensor([0.6, 0.6, 0.53], dtype=torch.float64), 4)
    axes = ColourAxes.of(x, 0.5)
    edges = edge_weights(x, 0.05, axes)
    assert edges[0].shape == (1, 3, 5, 7) and edges[1].shape == (1, 3, 6, 6)
    a, b = (torch.rand(1, 3, 6, 7, generator=torch.Generator().manual_seed(i),
                       dtype=torch.float64) for i in (5, 6))
    assert float((a * smoothness_normal(b, edges, axes)).sum()) == pytest.approx(
        float((b * smoothness_normal(a, edges, axes)).sum()), rel=1e-12)
    diagonal = torch.empty(126, dtype=torch.float64)
    for entry in range(126):
        unit = torch.zeros(126, dtype=torch.float64)
        unit[entry] = 1
        diagonal[entry] = smoothness_normal(unit.view(1, 3, 6, 7), edges, axes).flatten()[entry]
    assert torch.allclose(degree(edges, axes, 3).flatten(), diagonal, atol=1e-13)
    shared = uniform_edges(x)  # the quadratic prior on the axes: one weight for all of them
    assert degree(shared, axes, 3).shape == (1, 3, 6, 7)


@pytest.mark.slow
@torch.no_grad()
def test_a_frame_whose_equations_are_not_trusted_keeps_the_chroma_weighting(
        equations_of_blocky_frames) -> None:
    """Trust 0 (noisy equations) solves the frame as with the colour axes off, trust 1 as with
    them alone; a blend of frames solves each as alone."""
    equations, transform, x = equations_of_blocky_frames
    bounds = Bounds.of(transform)
    start = ((bounds.low + bounds.high) / 2).expand_as(x).clone()
    axes, off = FrameSolve(rounds=2), FrameSolve(rounds=2, colour_power=0.0)
    trust = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64)

    def solved(solve: FrameSolve, weight: torch.Tensor | None) -> torch.Tensor:
        return solve_inputs(equations, start, solve, weight, bounds=bounds)

    blended = solved(axes, trust)
    untrusted, trusted = trust == 0, trust == 1
    assert torch.allclose(blended[untrusted], solved(off, trust)[untrusted], rtol=0, atol=1e-12)
    alone = solve_inputs(equations, start, axes, None, bounds=bounds)
    assert torch.allclose(blended[trusted], alone[trusted], rtol=0, atol=1e-12)
    assert not torch.allclose(alone[untrusted], solved(off, trust)[untrusted], atol=1e-6)


@pytest.mark.parametrize("field, value, message", [
    ("rounds", -1, "rounds -1"), ("round_iterations", 0, "round_iterations 0"),
    ("edge_scale", -0.1, "edge_scale"), ("iterations", 0, "iterations 0"),
    ("chroma", 0.0, "chroma 0.0"), ("colour_power", -0.5, "colour_power -0.5")])
def test_bad_solve_settings_are_refused(field: str, value: float, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ExactConfig(solve=FrameSolve(**{field: value})).check()


@pytest.mark.slow
@torch.no_grad()
def test_projection_keeps_what_the_equations_fix_and_the_guess_elsewhere(
        equations_of_blocky_frames) -> None:
    """A learned prior's guess goes back through the equations: the true frame comes back as
    it is (it satisfies them), and a guess off by noise comes back with the equations fitted
    (residuals cut 500-fold) and nearer the truth (the noise's row-space part removed), while
    what they leave free keeps the guess's error (none of it on a frame they fix whole)."""
    from gradleak.inversion.frame_solve import project_frames

    equations, transform, x = equations_of_blocky_frames
    truth = transform.invert(x)
    solve = FrameSolve(precision="float64")
    kept, residuals = project_frames(equations, transform, truth, 200, solve, noise=None)
    assert float((kept - truth).abs().max()) <= 1e-3  # CG on rounding alone
    generator = torch.Generator().manual_seed(2)
    guess = truth + 20 * torch.randn(truth.shape, generator=generator, dtype=torch.float64)
    projected, residuals = project_frames(equations, transform, guess, 2000, solve, noise=None)
    off = equations.residuals(transform.apply(guess))
    for name, value in residuals.items():  # a pull towards the guess keeps it from 0
        assert bool((value <= 2e-3 * off[name]).all()), name
    before, after = errors(guess, x, transform), errors(projected, x, transform)
    assert bool((after < 0.8 * before).all()) and int((after > 0.05 * before).sum()) >= 3


@pytest.mark.slow
def test_steps_that_saw_one_frame_fix_it_together() -> None:
    """Three steps that saw one frame each give their own weight-gradient equations (each its
    own δ₁). Solved as one they fix more of it: one frame for all three, nearer the truth than
    any step's own solve (measured when written: 30-40x less error), and a step tied to no other
    comes out as it does alone."""
    frame, other = blocky_frames(2, seed=3)
    equations, transform, x = first_conv_equations_of(torch.stack([frame, frame, frame, other]))
    solve = FrameSolve(precision="float64")
    alone = solve_frames(equations, transform, solve, noise=None)[0]
    tied = solve_frames(equations, transform, solve, noise=None,
                        tie=Tie.of(torch.tensor([0, 0, 0, 1])))[0]
    assert torch.equal(tied[0], tied[1]) and torch.equal(tied[0], tied[2])
    assert bool((errors(tied, x, transform)[0] < 0.1 * errors(alone, x, transform)[:3]).all())
    # the same iterations on another batch: float64 rounding, 5e-7 of 255 on some hosts
    assert torch.allclose(tied[3], alone[3], rtol=0, atol=1e-5)
    untied = solve_frames(equations, transform, solve, noise=None, tie=Tie.of(torch.arange(4)))
    assert torch.equal(untied[0], alone)


def test_same_frames_are_consecutive_steps_of_an_episode_with_one_first_block_map() -> None:
    generator = torch.Generator().manual_seed(0)
    maps = torch.rand(7, 4, 5, 5, generator=generator, dtype=torch.float64)
    maps[1] = maps[0] * (1 + 1e-7)  # rounding: the same frame
    maps[2] = maps[1]
    maps[4] = maps[3]  # the same map, but the next episode
    maps[5] = maps[4] * 1.01  # a different frame
    maps[6] = 0.0  # a map with every unit off says nothing
    episodes = np.array([0, 0, 0, 0, 1, 1, 1])
    steps = np.array([0, 1, 2, 3, 0, 1, 2])
    tie = same_frames(maps, episodes, steps, 1e-4)
    assert tie.group.tolist() == [0, 0, 0, 1, 2, 3, 4]
    assert tie.size.tolist() == [3, 3, 3, 1, 1, 1, 1]
    skipped = np.array([0, 1, 3, 4, 5, 6, 7])  # a step left out between the second and third
    assert same_frames(maps, np.zeros(7, int), skipped, 1e-4).group.tolist()[:3] == [0, 0, 1]
    zero = torch.zeros(2, 3)
    assert same_frames(zero, np.zeros(2, int), np.arange(2), 1e-4).group.tolist() == [0, 1]
    assert same_frames(maps, episodes, steps, 0.0).group.tolist() == list(range(7))
