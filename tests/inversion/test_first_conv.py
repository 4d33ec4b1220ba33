"""The frame under the first conv from its own equations: exact algebra against autograd, a
solve that fits them and errs only where they leave the frame free, and clear refusals."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import observe, smooth_frame, victim_with_statistics

from gradleak.attacks.conv_inputs import observed_conv_inputs
from gradleak.attacks.equation_rank import equation_rank, equation_space
from gradleak.errors import ConfigError
from gradleak.inversion.conv_blocks import conv_blocks
from gradleak.inversion.first_conv import (
    FirstConvEquations,
    NoiseModel,
    first_conv_equations,
    mean_colour,
)
from gradleak.inversion.frame_solve import FrameSolve, solve_frames, solve_inputs
from gradleak.rl.losses import LossCoefficients, actor_critic_loss
from gradleak.victims import create_victim

STEPS = dict(actions=torch.arange(6) % 5, advantages=torch.linspace(-1.5, 1.5, 6),
             returns=torch.linspace(-0.5, 0.8, 6))


@pytest.fixture(scope="module", params=[torch.float64, torch.float32])
def steps(request: pytest.FixtureRequest):
    return observed_steps(request.param)


@pytest.fixture(scope="module")
def exact_steps():
    """The same steps with float64 gradients: exact to rounding."""
    return observed_steps(torch.float64)


def observed_steps(dtype: torch.dtype):
    """Six smooth frames, their per-step gradients (float64, or float32 as a client sends),
    and autograd's δ₁ (the first conv's output gradient) and pre-activation for each."""
    victim = victim_with_statistics(dtype)
    images = torch.stack([smooth_frame(32, seed) for seed in range(6)])
    frames = images.double() if dtype == torch.float64 else images
    observation, _ = observe(victim, frames, STEPS["actions"],
                             STEPS["advantages"].to(dtype), STEPS["returns"].to(dtype))
    double = victim_with_statistics(torch.float64)
    first = conv_blocks(double)[0]
    kept = {}
    hook = first.conv.register_forward_hook(lambda m, a, out: kept.update(z=out) or
                                            out.retain_grad())
    logits, values = double(images.double())
    hook.remove()
    log_probs = torch.log_softmax(logits, -1).gather(-1, STEPS["actions"][:, None])[:, 0]
    loss = actor_critic_loss(logits, values, STEPS["actions"], STEPS["advantages"].double(),
                             STEPS["returns"].double(), LossCoefficients(), log_probs.detach())
    loss.sum().backward()  # eval mode: each step's loss reaches only its own activations
    x = double.roles().transform.apply(images.double())
    return observation, double, x, kept["z"].grad.detach(), kept["z"].detach()


@pytest.fixture(scope="module")
def unprioritised(exact_steps):
    """The solve with no smoothness from a flat start (6,000 iterations), and the truth."""
    observation, victim, x, _, _ = exact_steps
    equations = recovered(observation, victim)
    solution = solve_inputs(equations, torch.full_like(x, 0.5),
                            FrameSolve(smoothness=0.0, iterations=6000, rounds=0))
    return equations, solution, x


def recovered(observation, victim) -> FirstConvEquations:  # noqa: ANN001
    found = observed_conv_inputs(observation)
    deepest = list(found.inputs)[-1]
    first = conv_blocks(victim)[0]
    gradient = torch.from_numpy(observation.block(f"{first.name}.weight").astype(np.float64))
    return first_conv_equations(victim, found.inputs[deepest], found.noise[deepest],
                                found.upstream[deepest], gradient)


def test_delta_from_the_recursion_is_autograds(steps) -> None:
    """δ₁ = (gradient reaching the first block's output) · γ/σ · [on], from the gradients
    alone, equals autograd's δ₁: to rounding on float64 gradients, to float32's precision on
    what a client sends."""
    observation, victim, _, delta, _ = steps
    equations = recovered(observation, victim)
    error = (equations.delta - delta).flatten(1).norm(dim=1) / delta.flatten(1).norm(dim=1)
    limit = 1e-9 if observation.gradients.dtype == np.float64 else 1e-5
    assert float(error.max()) <= limit


def test_the_true_frame_satisfies_both_sets_of_equations(exact_steps) -> None:
    """Built from autograd's δ₁ and the true pre-activations, the output equations and the
    observed ∇W₁ hold at the true frame to 1e-10 (float64 gradients); a frame one pixel off
    breaks them."""
    observation, victim, x, delta, z = exact_steps
    first = conv_blocks(victim)[0]
    bias = first.conv.bias.detach()[:, None, None]
    on = z > 0
    gradient = torch.from_numpy(observation.block(f"{first.name}.weight"))
    equations = FirstConvEquations(first, on, ~on, (z - bias) * on, delta, gradient)
    assert all(float(r.max()) <= 1e-10 for r in equations.residuals(x).values())
    nudged = x.clone()
    nudged[:, :, 10, 10] += 0.05
    assert float(equations.residuals(nudged)["weight_gradient"].min()) > 1e-6


@pytest.mark.slow
def test_without_a_prior_the_solve_fits_both_sets_and_errs_only_in_their_null_space(
        unprioritised) -> None:
    """With no smoothness the solve reproduces every equation (to 1e-10 on the frames where it
    converges within the budget, 2e-6 on all); where it does, its error e has A e = 0, and on
    some frames e is far from 0: the equations leave part of the frame free (6,000 iterations;
    measured when written: residuals 2e-14 on half the frames, 1e-6 at worst, errors 0.14-0.19
    where converged)."""
    equations, solution, x = unprioritised
    residual = torch.stack(list(equations.residuals(solution).values())).amax(0)
    assert float(residual.max()) <= 2e-6
    error = (solution - x).flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1)
    converged = residual <= 1e-10
    assert int(converged.sum()) >= 2 and float(error[converged].max()) > 0.05


@pytest.mark.slow
def test_the_solve_errs_only_in_the_computed_null_space(unprioritised) -> None:
    """The computed row space of a frame's equations: the unprioritised solve has the true
    input's row-space part (P x̂ = P x, P the row-space projector) on the first frame where it
    converged, so its error lies wholly in the null space, and a frame moved along
    the row space breaks the equations; the rank is below the unknowns and the per-pixel
    leverages are in [0, 1] and add up to it."""
    equations, solution, x = unprioritised
    converged = torch.stack(list(equations.residuals(solution).values())).amax(0) <= 1e-10
    assert int(converged.sum()) >= 2
    for frame in map(int, torch.nonzero(converged).flatten()[:1]):
        space = equation_space(equations, frame, x.shape)
        assert 0 < space.rank < space.unknowns == x[0].numel()
        assert equation_rank(equations, frame, x.shape) == space.rank  # eigenvalues alone
        leverage = space.leverage(tuple(x.shape[1:]))
        assert float(leverage.min()) >= -1e-9 and float(leverage.max()) <= 1 + 1e-9
        assert float(leverage.sum()) == pytest.approx(space.rank, rel=1e-9)
        error = solution[frame] - x[frame]
        assert float(space.row_space_part(error).norm() / error.norm()) <= 1e-5
        assert float(error.norm() / x[frame].norm()) > 0.05  # and there is an error to place
        moved = solution.clone()
        moved[frame] += space.basis[0].view(x[frame].shape)  # one unit along the row space
        assert float(equations.residuals(moved)["outputs"][frame]) > 1e-3


def test_the_weight_gradient_equations_bring_the_frame_closer(steps) -> None:
    """The same solve with ∇W₁'s equations added lands nearer the true frame on every step."""
    observation, victim, x, _, _ = steps
    with_gradient = recovered(observation, victim)
    outputs_only = FirstConvEquations(with_gradient.block, with_gradient.on, with_gradient.off,
                                      with_gradient.outputs, with_gradient.delta, None)
    transform = victim.roles().transform
    truth = transform.invert(x)
    errors = [(solve_frames(equations, transform)[0] - truth).flatten(1).norm(dim=1)
              for equations in (outputs_only, with_gradient)]
    assert bool((errors[1] < errors[0]).all())


def test_a_victim_without_a_conv_under_its_first_layer_is_refused() -> None:
    victim = create_victim("mlp", frame_size=12, options={"hidden": 32}).double()
    nothing = torch.zeros(1, 1, 1, 1)
    with pytest.raises(ConfigError, match="needs conv layers"):
        first_conv_equations(victim, nothing, nothing, nothing, None)


def with_bias_check(observation, victim) -> FirstConvEquations:  # noqa: ANN001
    found = observed_conv_inputs(observation)
    deepest = list(found.inputs)[-1]
    first = conv_blocks(victim)[0]

    def block(name: str) -> torch.Tensor:
        return torch.from_numpy(observation.block(f"{first.name}.{name}").astype(np.float64))

    return first_conv_equations(victim, found.inputs[deepest], found.noise[deepest],
                                found.upstream[deepest], block("weight"),
                                bias_gradient=block("bias"))


@pytest.mark.slow
def test_on_what_a_client_sends_the_noise_model_changes_nothing(steps) -> None:
    """float32 gradients: Σ_p δ₁(p) meets the observed ∇b₁ to float32's precision, so the
    weight-gradient equations keep their full weight and the frames are those of the solve
    that takes every equation as exact: to 1e-3 of 255 by the converged quadratic solve in
    float64; by the default solve (150 iterations, float32 arithmetic, edge rounds that
    reweigh from the frame: each carries the weights' 1e-4 change on) to 0.25, less than the
    rounding to a stored frame."""
    observation, victim, _, _, _ = steps
    equations = with_bias_check(observation, victim)
    assert float(equations.bias_check.max()) <= 1e-5
    assert float(NoiseModel().gradient_weight(equations).min()) >= 1 - 1e-4
    transform = victim.roles().transform
    for solve, tolerance in ((FrameSolve(iterations=400, rounds=0, precision="float64"), 1e-3),
                             (FrameSolve(), 0.25)):
        aware, exact = (solve_frames(equations, transform, solve, noise=noise)[0]
                        for noise in (NoiseModel(), None))
        assert float((aware - exact).abs().max()) <= tolerance


def test_a_wrong_delta_is_caught_by_the_bias_gradient_and_weighed_down(exact_steps) -> None:
    """δ₁ with a twentieth of its on-units dropped (as a wrong mask drops them): the ∇b₁ check
    sees an error of the size the weight-gradient equations now have at the true frame
    (within a factor 2), and the solve that weighs them by it lands nearer the truth than the
    one that fits them exactly, on every step."""
    observation, victim, x, _, _ = exact_steps
    equations = with_bias_check(observation, victim)
    generator = torch.Generator().manual_seed(0)
    dropped = equations.on & (torch.rand(equations.on.shape, generator=generator) < 0.05)
    delta = torch.where(dropped, 0.0, equations.delta)
    bias = torch.from_numpy(observation.block(f"{equations.block.name}.bias")).double()
    wrong = replace(equations, delta=delta,
                    bias_check=(delta.sum((2, 3)) - bias).norm(dim=1) / bias.norm(dim=1))
    residual = wrong.residuals(x)["weight_gradient"]
    ratio = wrong.bias_check / residual
    assert float(residual.min()) > 1e-3 and bool(((ratio > 0.5) & (ratio < 2)).all())
    transform = victim.roles().transform
    truth = transform.invert(x)
    errors = [(solve_frames(wrong, transform, noise=noise)[0] - truth).flatten(1).norm(dim=1)
              for noise in (NoiseModel(), None)]
    assert bool((errors[0] < errors[1]).all())


def test_noisier_outputs_get_more_smoothness() -> None:
    """The smoothness grows with the on-units' noise past the reference, never below the
    configured weight."""
    on = torch.ones(3, 1, 1, 1, dtype=torch.bool)
    block = conv_blocks(victim_with_statistics(torch.float64))[0]
    equations = FirstConvEquations(block, on, ~on, on.double(), on.double(), None,
                                   output_noise=torch.tensor([0.0, 0.01, 0.1],
                                                             dtype=torch.float64))
    weights = NoiseModel(noise_reference=0.01).smoothness(equations, 1e-3).flatten()
    assert torch.allclose(weights, torch.tensor([1e-3, 1e-3, 1e-1], dtype=torch.float64))


def test_the_mean_colour_of_a_constant_input_comes_from_the_gradients_alone() -> None:
    """For a constant input, ∇W₁ = m ⊗ ∇b₁ tap by tap whatever δ₁ is, so the colour comes
    back exactly with no δ₁ (δ₁ is zero on the border, where a padded tap reads zeros)."""
    block = conv_blocks(victim_with_statistics(torch.float64))[0]
    generator = torch.Generator().manual_seed(3)
    colour = torch.tensor([[0.2, -0.4, 0.7], [1.0, 0.5, 0.0]], dtype=torch.float64)
    x = colour[:, :, None, None].expand(-1, -1, 32, 32)
    side = block.conv(x).shape[-1]
    on = torch.ones(2, block.conv.out_channels, side, side, dtype=torch.bool)
    delta = torch.randn(on.shape, generator=generator, dtype=torch.float64)
    delta[..., :1, :], delta[..., -1:, :], delta[..., :, :1], delta[..., :, -1:] = 0, 0, 0, 0
    equations = FirstConvEquations(block, on, ~on, delta, delta, None)
    gradient = equations.weight_gradient_of(x).view(2, block.conv.out_channels, 3,
                                                    *block.conv.kernel_size)
    recovered = mean_colour(gradient, delta.sum((2, 3)))
    assert torch.allclose(recovered, colour, atol=1e-12)


def test_a_step_whose_recursion_failed_keeps_the_mean_colour_frame(exact_steps) -> None:
    """Where δ₁ misses all of ∇b₁ (here: every on-unit dropped) the equations say nothing
    reliable: the frame is the mean-colour one, not whatever the wrong equations fit."""
    observation, victim, x, _, _ = exact_steps
    equations = with_bias_check(observation, victim)
    bias = torch.from_numpy(observation.block(f"{equations.block.name}.bias")).double()
    failed = replace(equations, delta=torch.zeros_like(equations.delta),
                     bias_check=torch.ones(len(bias), dtype=torch.float64))
    transform = victim.roles().transform
    frames = solve_frames(failed, transform)[0]
    low, high = (transform.apply(torch.full((1, 32, 32, 3), value, dtype=torch.float64))
                 for value in (0.0, 255.0))
    colour = transform.invert(torch.maximum(torch.minimum(
        failed.colour[:, :, None, None].expand_as(x), high), low))
    assert float((frames - colour).abs().max()) <= 1e-9


def test_an_undecided_units_ceiling_holds_at_the_true_frame_whether_it_is_on_or_off(
        exact_steps) -> None:
    """A first-block map whose units carry bounded noise (at most one deviation): at every unit
    the equations count as off, the true frame's conv₁(x) stays under its ceiling (the unit's
    value plus three deviations, or −b₁). Taking each such unit as exactly off (−b₁) is
    violated at the true frame by the on-units the margin left undecided."""
    observation, victim, x, _, z = exact_steps
    first = conv_blocks(victim)[0]
    relu = torch.relu(z)
    deviation = 0.02 * relu.amax((1, 2, 3), keepdim=True)
    noise = (2 * torch.rand(relu.shape, generator=torch.Generator().manual_seed(0),
                            dtype=torch.float64) - 1) * deviation
    with torch.no_grad():
        output = first.norm(relu + noise)
    gain = first.norm.weight.detach().double() / (first.norm.running_var.double()
                                                  + first.norm.eps).sqrt()
    spread = (deviation * gain.abs()[:, None, None]).expand_as(relu)
    equations = first_conv_equations(victim, output, spread, torch.zeros_like(z), None)
    conv = equations.conv(x)
    assert int((equations.off & (z > 0)).sum()) > 0  # on-units counted off: the case at issue
    assert bool((conv <= equations.ceiling + 1e-9)[equations.off].all())
    assert not bool((conv <= -equations.bias + 1e-9)[equations.off].all())
