"""Recovery through the conv stack: every determined conv input exactly, honest noise
estimates, and clear refusals where the gradient does not determine the input."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import mlp_observation, observe, smooth_frame, victim_with_statistics

from gradleak.attacks.analytic import module_input
from gradleak.attacks.conv_inputs import observed_conv_inputs
from gradleak.capture.reader import CaptureFile
from gradleak.errors import ConfigError
from gradleak.inversion.conv_blocks import block_forward, conv_blocks, deepest_inputs
from gradleak.inversion.conv_recovery import (
    CONSISTENT,
    DEEPEST_RULES,
    MASK_RULES,
    ConvInputs,
    Run,
    walk_down,
)
from gradleak.inversion.layers import linear
from gradleak.inversion.layers.affine_norm import bn_affine
from gradleak.inversion.layers.conv import (
    least_squares,
    robust_input,
    solve_input,
    solve_input_with_noise,
)
from gradleak.inversion.layers.conv_equations import as_map
from gradleak.inversion.layers.linear import linear_input_with_noise
from gradleak.inversion.layers.null_space import KnownOutputs
from gradleak.inversion.layers.relu import MaskRule, likelier_on, nearer_on, posterior_on
from gradleak.victims import create_victim
from gradleak.victims.base import victim_at_theta0


def relative_error(estimate: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    return (estimate - truth).flatten(1).norm(dim=1) / truth.flatten(1).norm(dim=1)


@pytest.fixture(scope="module")
def trained_statistics():
    """cnn-small whose BatchNorms are far from identity, on 10 smooth 32×32 frames, with the
    per-step gradients stored exactly."""
    victim = victim_with_statistics()
    images = torch.stack([smooth_frame(32, seed) for seed in range(10)])
    observation, _ = observe(victim, images, torch.arange(10) % 5,
                             torch.linspace(-1.5, 1.5, 10), torch.linspace(-0.5, 0.8, 10))
    return observation, images


def true_inputs(observation, images, names):  # noqa: ANN001
    victim = victim_at_theta0(observation)
    with torch.no_grad():
        return {name: module_input(victim, name, images).double() for name in names}


def test_every_determined_conv_input_is_exact_without_noise(trained_statistics) -> None:
    observation, images = trained_statistics
    found = observed_conv_inputs(observation)
    assert list(found.inputs) == ["encoder.9", "encoder.6", "encoder.3"]
    truth = true_inputs(observation, images, list(found.inputs))
    for name, estimate in found.inputs.items():
        assert float(relative_error(estimate, truth[name]).max()) <= 1e-4, name


def test_exact_on_rendered_frames_from_a_float32_capture(float32_capture: Path) -> None:
    with CaptureFile(float32_capture) as capture:
        observation, target = capture.observation(), capture.target()
    images = torch.from_numpy(target.images)
    found = observed_conv_inputs(observation)
    truth = true_inputs(observation, images, list(found.inputs))
    for name, estimate in found.inputs.items():
        assert float(relative_error(estimate, truth[name]).median()) <= 1e-4, name


def test_noise_estimate_tracks_the_actual_error(trained_statistics) -> None:
    """Noise on the top conv's weight gradient: the fit's residual must predict the error of the
    recovered input (within a factor of two), since the on/off decisions below rely on it."""
    observation, images = trained_statistics
    gradients = observation.gradients.copy()
    layer = next(layer for layer in observation.layers if layer.name == "encoder.9.weight")
    columns = slice(layer.offset, layer.offset + layer.size)
    scale = np.abs(gradients[:, columns]).mean(1, keepdims=True)
    noise = np.random.default_rng(0).standard_normal(gradients[:, columns].shape)
    gradients[:, columns] += 0.01 * scale * noise.astype(np.float32)
    found = observed_conv_inputs(replace(observation, gradients=gradients), down_to="encoder.9")
    truth = true_inputs(observation, images, ["encoder.9"])["encoder.9"]
    actual = (found.inputs["encoder.9"] - truth).pow(2).mean().sqrt()
    estimated = found.noise["encoder.9"].pow(2).mean().sqrt()
    assert 0.5 <= float(estimated / actual) <= 2.0


def test_the_frame_itself_is_refused_as_underdetermined(trained_statistics) -> None:
    observation, _ = trained_statistics
    # 16 channels × 8×8 taps give 1024 rows for the 32×32 frame's 1024 pixels: rank-deficient
    assert deepest_inputs(victim_at_theta0(observation))[-1] == "encoder.3"
    assert deepest_inputs(create_victim("cnn", frame_size=84)) == [
        "encoder.9", "encoder.6", "encoder.3"]
    with pytest.raises(ConfigError, match="encoder.0.*needs a prior|needs a prior"):
        observed_conv_inputs(observation, down_to="encoder.0")
    with pytest.raises(ConfigError, match="the convs are encoder.0"):
        observed_conv_inputs(observation, down_to="fc")


def test_victims_without_a_conv_stack_are_named() -> None:
    observation, _ = mlp_observation(frames=2)
    with pytest.raises(ConfigError, match="victim mlp: .*has no conv stack"):
        observed_conv_inputs(observation)


def test_missing_conv_gradients_are_named(trained_statistics) -> None:
    observation, _ = trained_statistics
    kept = [layer for layer in observation.layers if not layer.name.startswith("encoder.9")]
    with pytest.raises(ConfigError, match="encoder.9.weight.*'cnn'"):
        observed_conv_inputs(replace(observation, layers=tuple(kept)))


def test_each_step_keeps_the_run_of_least_score_and_its_label() -> None:
    """Runs over different steps: per step the least score among the runs that walked it, the
    earlier run on a tie, with that run's own label of the step."""
    def run(scale: float, rows: list[int], labels: list[str] | None, score: list[float]) -> Run:
        inputs = torch.full((len(rows), 1, 2, 2), scale, dtype=torch.float64)
        found = ConvInputs({"c": inputs}, {"c": torch.zeros_like(inputs)},
                           {"c": torch.full((len(rows), 1, 1, 1), scale > 1)}, labels)
        return Run(torch.tensor(rows), found, torch.tensor(score, dtype=torch.float64))

    low = run(1.0, [0, 1, 2], ["margin 10", "posterior", "margin 20"], [0.1, 0.5, 0.3])
    high = run(2.0, [1, 2, 3], ["posterior"] * 3, [0.2, 0.3, float("nan")])
    kept = ConvInputs.best_of([low, high], 4)
    assert kept.inputs["c"][:, 0, 0, 0].tolist() == [1.0, 2.0, 1.0, 2.0]
    assert kept.masks["c"].flatten().tolist() == [False, True, False, True]
    assert kept.rules == ["margin 10", "posterior", "margin 20", "posterior"]
    with pytest.raises(ValueError, match="steps \\[4\\] are in no run"):
        ConvInputs.best_of([low, high], 5)
    with pytest.raises(ValueError, match="rules"):
        ConvInputs.best_of([low, run(2.0, [0], None, [0.0])], 3)


def every_rule_on_every_step(observation, rules=MASK_RULES):  # noqa: ANN001, ANN201
    """The recursion without pausing or skipping: every rule walked on every step, per step
    the first rule that is consistent, else the least inconsistent."""
    victim = victim_at_theta0(observation).double()
    blocks = conv_blocks(victim)

    def gradient_of(name: str) -> torch.Tensor:
        return torch.from_numpy(observation.block(name).astype(np.float64))

    with torch.no_grad():
        walks = [walk_down(gradient_of, victim, None, rule) for rule in rules]
    scores = torch.stack([walk.inconsistency(blocks, "encoder.3") for walk in walks])
    consistent = scores <= CONSISTENT
    first = consistent.double().argmax(0)
    best = torch.where(consistent.any(0), first, scores.argmin(0))
    return {name: torch.stack([walks[int(rule)].inputs[name][step]
                               for step, rule in enumerate(best)]) for name in walks[0].inputs}


def float16_rounded(observation):  # noqa: ANN001, ANN201
    return replace(observation, gradients=observation.gradients.astype(np.float16)
                   .astype(np.float32))


def test_a_step_a_rule_pauses_is_walked_on_by_the_next_and_the_result_is_unchanged(
        trained_statistics) -> None:
    """float16 rounding: the noise-aware walk turns inconsistent after the middle block on some
    steps; a later rule decides those (each step names the rule kept for it), and the inputs
    are those of walking every rule on every step."""
    observation, _ = trained_statistics
    rounded = float16_rounded(observation)
    found = observed_conv_inputs(rounded, deepest_rules=())
    first = MASK_RULES[0].label
    assert first in found.rules and set(found.rules) - {first}
    expected = every_rule_on_every_step(rounded)
    for name, inputs in expected.items():
        assert float(relative_error(found.inputs[name], inputs).max()) <= 1e-6


def test_a_paused_walk_no_rule_makes_consistent_is_finished(trained_statistics) -> None:
    """With the noise-aware rule alone the steps it pauses have no other rule to try: their walk
    is finished from where it stopped, and every input equals one uninterrupted walk's."""
    observation, _ = trained_statistics
    rounded = float16_rounded(observation)
    alone = MASK_RULES[:1]
    found = observed_conv_inputs(rounded, rules=alone, deepest_rules=())
    expected = every_rule_on_every_step(rounded, alone)
    for name, inputs in expected.items():
        assert float((found.inputs[name] - inputs).abs().max()) <= 1e-12 * float(
            inputs.abs().max())
    assert found.rules == [MASK_RULES[0].label] * len(found.rules)


def test_a_step_every_rule_pauses_is_finished_by_the_first(trained_statistics) -> None:
    """Two rules that pause the same steps (the noise-aware rule twice): no rule makes those
    steps consistent, and they keep the first rule's walk: the inputs are the noise-aware
    rule's alone."""
    observation, _ = trained_statistics
    rounded = float16_rounded(observation)
    twice = (MASK_RULES[0], MASK_RULES[0])
    found = observed_conv_inputs(rounded, rules=twice, deepest_rules=())
    expected = every_rule_on_every_step(rounded, MASK_RULES[:1])
    for name, inputs in expected.items():
        assert float((found.inputs[name] - inputs).abs().max()) <= 1e-12 * float(
            inputs.abs().max())


def test_blocks_without_batchnorm_are_walked_exactly() -> None:
    """NatureCNN (SB3's CnnPolicy): Conv → ReLU with no normalisation; at 64×64 the gradients
    determine the inputs of its last two convs exactly, and the frame needs the prior."""
    torch.manual_seed(3)
    victim = create_victim("nature-cnn", frame_size=64).eval()
    assert sum(p.numel() for p in victim.parameters()) == 603_814  # SB3's NatureCNN at 64×64, K = 5
    images = torch.stack([smooth_frame(64, seed) for seed in range(6)])
    observation, _ = observe(victim, images, torch.arange(6) % 5,
                             torch.linspace(-1.5, 1.5, 6), torch.linspace(-0.5, 0.8, 6))
    found = observed_conv_inputs(observation)
    assert list(found.inputs) == ["encoder.4", "encoder.2"]
    truth = true_inputs(observation, images, list(found.inputs))
    for name, estimate in found.inputs.items():
        known = torch.isfinite(found.noise[name])  # pixels some conv output reads
        error = relative_error(estimate * known, truth[name] * known)
        assert float(error.max()) <= 1e-4, name
    # its 4×4 stride-2 conv never reads the last row and column of the 15×15 map: unknown
    unread = ~torch.isfinite(found.noise["encoder.2"][0, 0])
    assert unread[14].all() and unread[:, 14].all() and int(unread.sum()) == 29


@pytest.fixture(scope="module")
def dead_top_channels():
    """The paper's top conv (64 → 64, 3×3, stride 2, on 10×10) with 40 output channels off
    everywhere, as after a few PPO updates: the 25 input pixels only the centre tap reads meet
    24 live channels, so D(δ) has a null space. Float32-stored weight gradients of 3 steps."""
    torch.manual_seed(0)
    victim = create_victim("cnn", frame_size=84).eval().double()
    *_, below, top = conv_blocks(victim)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        top.conv.bias[:40] = -1e3
        inputs = block_forward(below, torch.randn(3, below.conv.in_channels, *below.input_shape,
                                                  generator=generator, dtype=torch.float64))
        pre = top.conv(inputs)
        delta = torch.randn(pre.shape, generator=generator, dtype=torch.float64) * (pre > 0)
        gradient = torch.stack([torch.nn.grad.conv2d_weight(
            inputs[i:i + 1], top.conv.weight.shape, delta[i:i + 1], stride=top.conv.stride,
            padding=top.conv.padding) for i in range(3)]).float().double()
    return top, below, inputs, pre, delta, gradient


def test_the_weight_gradients_null_space_is_fixed_by_the_outputs_and_the_relu_below(
        dead_top_channels) -> None:
    top, below, inputs, pre, delta, gradient = dead_top_channels

    def error(fit) -> torch.Tensor:  # noqa: ANN001
        return relative_error(as_map(top, fit.solution), inputs)

    alone = least_squares(top, delta, gradient)
    completed = least_squares(top, delta, gradient, KnownOutputs(pre.relu(), pre > 0, below))
    assert bool(completed.completed.all())
    assert float(error(alone).min()) > 1e-2
    assert float(error(completed).max()) <= 1e-5
    assert not bool(completed.undetermined.any())


def test_what_no_equation_fixes_is_left_undecided_for_the_block_below(
        dead_top_channels) -> None:
    """Without the ReLU below, the live outputs fix only part of the null space: the rest is
    marked, and its noise is large enough that the block below leaves those units undecided."""
    top, _, inputs, pre, delta, gradient = dead_top_channels
    outputs = KnownOutputs(pre.relu(), pre > 0)
    fit = least_squares(top, delta, gradient, outputs)
    free = as_map(top, fit.undetermined)
    assert 0.1 < float(free.double().mean()) < 0.5
    recovered, noise, completed = solve_input_with_noise(top, delta, gradient, outputs)
    assert bool(completed.all())
    assert bool((noise[free] > inputs.abs().amax()).all())
    assert float(relative_error(recovered * ~free, inputs * ~free).max()) <= 1e-5


def test_a_completed_input_is_no_surer_than_its_completion(dead_top_channels) -> None:
    """The completion's own error (float32 weight gradients: ~1e-6 of the map) is above the
    fit's residual; its noise is floored at COMPLETION_NOISE of the map's largest value, so the
    block below does not take a unit that close to 0 as surely on or off."""
    from gradleak.inversion.layers.conv import COMPLETION_NOISE

    top, below, inputs, pre, delta, gradient = dead_top_channels
    outputs = KnownOutputs(pre.relu(), pre > 0, below)
    recovered, noise, completed = solve_input_with_noise(top, delta, gradient, outputs)
    assert bool(completed.all())
    largest = recovered.abs().flatten(1).amax(1)[:, None, None, None]
    read = torch.isfinite(noise)
    assert bool((noise[read] >= (COMPLETION_NOISE * largest).expand_as(noise)[read]).all())
    # the floor covers the error the residual alone would not
    assert bool(((recovered - inputs).abs()[read] <= 3 * noise[read]).all())


def test_a_completed_input_is_replaced_by_the_forward_pass_of_the_exact_one_below() -> None:
    from gradleak.inversion.conv_recovery import refresh_upward

    torch.manual_seed(0)
    blocks = conv_blocks(create_victim("cnn", frame_size=84).eval().double())
    lower_block = blocks[-2]
    lower = torch.randn(2, lower_block.conv.in_channels, *lower_block.input_shape,
                        dtype=torch.float64)
    upper = block_forward(lower_block, lower)
    wrong = upper + 0.1
    found = ConvInputs({"encoder.9": wrong.clone(), "encoder.6": lower}, {}, {},
                       completed={"encoder.9": torch.tensor([True, False]),
                                  "encoder.6": torch.tensor([False, False])})
    refreshed = refresh_upward(found, blocks).inputs["encoder.9"]
    assert torch.equal(refreshed[0], upper[0])
    assert torch.equal(refreshed[1], wrong[1])


def test_the_noise_spread_is_the_pseudo_inverses_diagonal_on_definite_and_singular_grams(
) -> None:
    """diag(G⁻¹) by Cholesky where G is definite equals the pseudo-inverse's; a singular G
    (a null direction, as on a trained victim's top conv) and an all-zero one (every unit
    off under a defense) in the same batch fall back to the pseudo-inverse instead of failing."""
    from gradleak.inversion.layers.conv_equations import DenseOperator, Gram, inverse_diagonal

    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 12, 5, generator=generator, dtype=torch.float64)
    rows[1, :, 4] = rows[1, :, 3]  # two equal columns: a null direction
    rows[2] = 0
    gram = Gram.of(DenseOperator(rows))
    expected = torch.linalg.pinv(gram.matrix).diagonal(dim1=1, dim2=2)
    assert torch.allclose(inverse_diagonal(gram), expected, rtol=1e-9, atol=1e-12)


def test_least_squares_by_normal_equations_match_gelsd_and_fall_back_where_singular() -> None:
    """Well-posed steps are solved through the Gram matrix's Cholesky factor (with one
    refinement step) to the SVD's answer; a step with a null direction and an all-zero one in
    the same batch are not well posed, and get the minimum-norm solution, not a failed
    factor's, the same on every call (torch's gelsy returned rank 11, 7, 5 or 4 for the
    rank-11 step from one call to the next)."""
    from gradleak.inversion.layers.conv_equations import DenseOperator, Gram, solve_least_squares

    generator = torch.Generator().manual_seed(1)
    matrix = torch.randn(4, 40, 12, generator=generator, dtype=torch.float64)
    matrix[0] = matrix[0] @ torch.diag(torch.logspace(0, -3, 12, dtype=torch.float64))
    matrix[2, :, 7] = matrix[2, :, 3]
    matrix[3] = 0
    rhs = torch.randn(4, 40, 3, generator=generator, dtype=torch.float64)
    assert Gram.of(DenseOperator(matrix)).well_posed.tolist() == [True, True, False, False]
    expected = torch.linalg.pinv(matrix) @ rhs  # the minimum-norm least-squares solutions
    got = solve_least_squares(DenseOperator(matrix), rhs)
    assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12)
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    for _ in range(20):
        assert torch.equal(solve_least_squares(DenseOperator(matrix), rhs), got)


def test_the_noise_aware_rule_keeps_the_masks_the_margins_lose_under_added_noise(
        trained_statistics) -> None:
    """Gaussian noise of 1% of the gradients' RMS on every entry: the margins leave the 16×16
    map at a median relative error of 0.25 (margin 10) and 0.94 (20), the posterior rule at
    0.085; the default keeps, per step, the run most consistent with the features."""
    observation, images = trained_statistics
    gradients = observation.gradients.astype(np.float64)
    noise = np.random.default_rng(0).standard_normal(gradients.shape)
    noisy = replace(observation, gradients=(gradients + 0.01 * np.sqrt((gradients ** 2).mean())
                                            * noise).astype(np.float32))
    truth = true_inputs(observation, images, ["encoder.3"])["encoder.3"]

    def median_error(rules: tuple[MaskRule, ...] = MASK_RULES,
                     deepest_rules: tuple[MaskRule, ...] = ()) -> float:
        found = observed_conv_inputs(noisy, rules=rules, deepest_rules=deepest_rules)
        return float(relative_error(found.inputs["encoder.3"], truth).median())

    margins = [median_error((MaskRule(margin),)) for margin in (10.0, 20.0)]
    posterior = median_error(MASK_RULES[:1])
    assert posterior <= 0.5 * min(margins)
    assert median_error() <= posterior + 1e-9
    # deciding the deepest block's units again, where no walk is consistent, never loses
    assert median_error(deepest_rules=DEEPEST_RULES) <= median_error() + 1e-9


def test_the_odds_rule_keeps_the_prior_where_the_fitted_delta_is_within_its_noise() -> None:
    """Units whose δ, if on, would be a tenth of the fit's noise: the fitted δ alone (nearer its
    on-value than 0) calls nearly half of the off ones on; the odds rule keeps their prior.
    Units whose δ is ten deviations: both rules read the fit. The deviation is read off the
    decided units (posterior 0 or 1), whose fitted δ has the same noise."""
    generator = torch.Generator().manual_seed(0)
    shape, noise = (2, 4, 32, 32), 0.5
    full = torch.where(torch.rand(shape, generator=generator) < 0.5, 0.1, 10.0).double() * noise
    on = torch.rand(shape, generator=generator) < 0.3
    decided = torch.rand(shape, generator=generator) < 0.3
    probability = torch.where(decided, on.double(), torch.full(shape, 0.3, dtype=torch.float64))
    fitted = full * on + noise * torch.randn(shape, generator=generator, dtype=torch.float64)
    log_odds = torch.log(probability) - torch.log1p(-probability)
    by_odds = likelier_on(fitted, full, log_odds, probability)
    nearer = nearer_on(fitted, full)
    weak, strong = ~decided & (full < noise), ~decided & (full > noise)

    def wrong(called: torch.Tensor, units: torch.Tensor) -> float:
        return float((called != on)[units].double().mean())

    assert wrong(nearer, weak & ~on) > 0.4 and wrong(by_odds, weak) == wrong(
        torch.zeros_like(on), weak)  # the prior (0.3: off) on every weak unit
    assert wrong(by_odds, strong) < 1e-3 and wrong(nearer, strong) < 1e-3


def test_the_posterior_calls_a_unit_near_zero_off_and_one_four_deviations_up_on() -> None:
    generator = torch.Generator().manual_seed(0)
    on = torch.rand(1, 1, 64, 64, generator=generator) < 0.5
    values = torch.where(on, 50 * torch.rand(1, 1, 64, 64, generator=generator), 0.0)
    relu = (values + torch.randn(1, 1, 64, 64, generator=generator)).double()
    probability = posterior_on(relu, torch.ones_like(relu))
    order = relu.flatten().argsort()
    assert bool((probability.flatten()[order].diff() >= -1e-12).all())  # monotone in r
    assert float(probability[relu.abs() < 1].max()) < 0.1
    assert float(probability[relu > 4].min()) > 0.99
    def wrong(called_on: torch.Tensor) -> float:
        return float((called_on != on).double().mean())

    assert wrong(probability > 0.5) <= min(wrong(relu > k) for k in range(11)) + 1e-3


def test_a_channel_holding_a_wrong_unit_is_down_weighted(trained_statistics) -> None:
    """One on-unit called off leaves its δ·patch in its channel's rows: plain least squares
    spreads it over the whole input, the channel-robust fit sets that channel aside."""
    observation, images = trained_statistics
    found = observed_conv_inputs(observation)
    victim = victim_at_theta0(observation).double()
    blocks = conv_blocks(victim)
    block = blocks[1]  # encoder.3: its input is the deepest map
    gain = bn_affine(block)[0]
    delta = found.upstream["encoder.6"] * gain * found.masks["encoder.3"]
    wrong = delta.clone()
    strongest = delta[0].abs().flatten().argmax()
    wrong[0].view(-1)[strongest] = 0.0
    gradient = torch.from_numpy(observation.block("encoder.3.weight").astype(np.float64))
    truth = true_inputs(observation, images, ["encoder.3"])["encoder.3"][:1]
    with torch.no_grad():  # closed-form solves: θ0's weights need no graph
        plain = relative_error(solve_input(block, wrong[:1], gradient[:1]), truth)
        robust = relative_error(robust_input(block, wrong[:1], gradient[:1]), truth)
    assert float(plain) > 1e-2
    assert float(robust) <= 0.3 * float(plain)


def test_only_the_steps_the_first_walk_leaves_inconsistent_are_walked_again(
        trained_statistics) -> None:
    """Exact steps keep the noise-aware walk alone (one walk instead of three); a noisy step is
    walked with the margins too, and the merge puts each step's run back in its own row."""
    observation, images = trained_statistics
    gradients = observation.gradients.astype(np.float64)
    noisy = [1, 4, 7]
    noise = np.random.default_rng(1).standard_normal(gradients[noisy].shape)
    gradients[noisy] += 0.01 * np.sqrt((gradients ** 2).mean()) * noise
    found = observed_conv_inputs(replace(observation, gradients=gradients.astype(np.float32)))
    truth = true_inputs(observation, images, ["encoder.3"])["encoder.3"]
    errors = relative_error(found.inputs["encoder.3"], truth)
    exact = [row for row in range(10) if row not in noisy]
    assert float(errors[exact].max()) <= 1e-4
    assert [found.rules[row] for row in exact] == [MASK_RULES[0].label] * len(exact)
    assert float(errors[noisy].min()) > 1e-3  # the noisy rows are their own, not an exact one's
    victim = victim_at_theta0(observation).double()
    blocks = conv_blocks(victim)
    assert float(found.inconsistency(blocks, "encoder.3")[exact].max()) <= 1e-4


def vertex_programme(slack_everywhere: bool = False, seed: int = 0
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rows z ≤ bounds with unit rows, 30 coefficients and 400 rows: at the truth 120 rows are
    active to float32 rounding (units exactly off) and the rest have slack; with
    `slack_everywhere` none is active, so the polytope has room inside."""
    rng = np.random.default_rng(seed)
    truth = rng.standard_normal(30)
    rows = rng.standard_normal((400, 30))
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    slack = rng.uniform(0.1, 1.0, 400)
    if not slack_everywhere:
        slack[:120] = 1e-7 * rng.standard_normal(120)
    return rows, rows @ truth + slack, truth


def test_the_newton_vertex_is_the_linear_programmes_and_the_truth() -> None:
    from gradleak.inversion.layers.least_violation import (
        least_violation,
        linear_programme,
        newton_steps,
    )

    rows, bounds, truth = vertex_programme()
    end = newton_steps(rows, bounds)
    assert end.certified
    newton = end.point
    assert np.abs(newton - linear_programme(rows, bounds)).max() <= 1e-9
    assert np.abs(newton - truth).max() <= 1e-6
    assert np.array_equal(least_violation(rows, bounds), newton)


def test_a_polytope_with_room_inside_keeps_the_feasible_point_without_a_programme(
        monkeypatch) -> None:
    """Where the rows leave room (strictly inside at the start, or the Newton steps ending at a
    point that violates nothing while the active rows leave coefficients free), no vertex is
    singled out: that point is kept and HiGHS is not asked. Where noise leaves no point that
    violates nothing, the linear programme still decides."""
    import gradleak.inversion.layers.least_violation as blocks

    programmes = []
    solve = blocks.linear_programme
    monkeypatch.setattr(blocks, "linear_programme",
                        lambda *a: programmes.append(1) or solve(*a))
    rows, bounds, _ = vertex_programme(slack_everywhere=True)
    assert not blocks.newton_steps(rows, bounds).certified  # nothing certifies a vertex there
    z = blocks.least_violation(rows, bounds)
    assert z is not None and float((rows @ z - bounds).max()) <= 1e-9 and not programmes
    # room after some steps: the truth violates nothing, only 20 rows are active there
    rng = np.random.default_rng(2)
    truth = rng.standard_normal(30)
    roomy = rng.standard_normal((400, 30))
    roomy /= np.linalg.norm(roomy, axis=1, keepdims=True)
    slack = rng.uniform(0.1, 1.0, 400)
    slack[:20] = 0.0
    shifted = roomy @ truth + slack - roomy @ (truth + 0.5)  # bounds of z around −0.5 off
    end = blocks.newton_steps(roomy, shifted)
    assert not end.certified and end.feasible
    assert np.array_equal(blocks.least_violation(roomy, shifted), end.point) and not programmes
    # contradictory rows (z₀ ≤ −1 and −z₀ ≤ −1): nothing is feasible, HiGHS decides
    clash = np.zeros((2, 30))
    clash[0, 0], clash[1, 0] = 1.0, -1.0
    contradictory = np.vstack([rows, clash])
    assert blocks.least_violation(contradictory, np.concatenate([bounds, [-1.0, -1.0]])) \
        is not None
    assert programmes == [1]


def test_completions_run_ahead_in_a_thread_equal_those_run_one_by_one(dead_top_channels,
                                                                      monkeypatch) -> None:
    """The next steps' SVDs run in a worker thread while this one's inequalities are solved
    (the first step's in this one, beside the worker's second): the same operations on the
    same inputs, so the same bits as one step after another."""
    import contextlib
    import threading

    import gradleak.inversion.layers.null_space as blocks

    top, below, _, pre, delta, gradient = dead_top_channels
    outputs = KnownOutputs(pre.relu(), pre > 0, below)
    threads: dict[int, list[str]] = {}  # step → the threads that prepared it
    prepare = blocks.prepare_step
    monkeypatch.setattr(blocks, "prepare_step", lambda *a: threads.setdefault(a[3], []).append(
        threading.current_thread().name) or prepare(*a))
    ahead = least_squares(top, delta, gradient, outputs)
    here = threading.current_thread().name
    assert [names[0] == here for _, names in sorted(threads.items())] == [True, False, False]
    assert all(names[0].startswith("gradleak-ahead") for step, names in threads.items() if step)

    @contextlib.contextmanager
    def one_by_one(compute, keys):  # noqa: ANN001, ANN202
        yield compute

    monkeypatch.setattr(blocks, "computed_ahead", one_by_one)
    alone = least_squares(top, delta, gradient, outputs)
    assert all(names[1:] == [here] for names in threads.values())
    assert bool(alone.completed.all())
    for field in ("solution", "undetermined", "completed"):
        assert torch.equal(getattr(ahead, field), getattr(alone, field)), field


def test_a_completion_met_again_within_one_recovery_is_solved_once(dead_top_channels,
                                                                    monkeypatch) -> None:
    """The mask rules' walks meet the same completions on the steps where their masks agree:
    inside one recovery each is solved once and answered alike after; outside, a benchmark's
    repeats pay for every solve."""
    import gradleak.inversion.layers.null_space as blocks

    top, below, _, pre, delta, gradient = dead_top_channels
    outputs = KnownOutputs(pre.relu(), pre > 0, below)
    calls = []
    complete = blocks.complete_step
    monkeypatch.setattr(blocks, "complete_step", lambda *a: calls.append(1) or complete(*a))
    with blocks.completions_shared():
        first = least_squares(top, delta, gradient, outputs)
        again = least_squares(top, delta.clone(), gradient.clone(), outputs)
        assert len(calls) == 3  # one a step
        # a step whose masks differ is a new completion
        changed = outputs.on.clone()
        changed[1].view(-1)[changed[1].flatten().nonzero()[0]] = False
        least_squares(top, delta * changed, gradient, KnownOutputs(outputs.relu, changed, below))
        assert len(calls) == 4
    assert torch.equal(first.solution, again.solution)
    assert torch.equal(first.undetermined, again.undetermined)
    least_squares(top, delta, gradient, outputs)
    assert len(calls) == 7


@pytest.mark.parametrize("geometry", [((21, 21), 4, 2, 0), ((8, 8), 3, 1, 1), ((15, 15), 4, 2, 0),
                                      ((12, 9), 3, 2, 1)])
def test_the_implicit_weight_gradient_operator_equals_the_dense_matrix(geometry) -> None:
    """D(δ)'s Gram matrix, adjoint and product, computed tap by tap without forming D, equal
    the dense matrix's (with per-channel weights), for a strided conv, a padded one, one that
    leaves the last rows and columns unread, and a rectangular map."""
    from gradleak.inversion.layers.conv_equations import TapOperator, read_pixels, tap_map

    _, kernel, stride, padding = geometry
    generator = torch.Generator().manual_seed(2)
    positions = tap_map(*geometry).shape[2]
    delta = torch.randn(3, 5, positions, generator=generator, dtype=torch.float64)
    operator = TapOperator(delta, geometry)
    taps = tap_map(*geometry)[read_pixels(*geometry)]  # (Q', k², P)
    dense = torch.einsum("nop,qkp->nokq", delta, taps).flatten(1, 2)
    assert torch.equal(operator.dense(), dense)
    weights = torch.rand(3, 5, generator=generator, dtype=torch.float64)
    rows = weights.repeat_interleave(kernel * kernel, dim=1)[..., None]
    assert torch.allclose(operator.gram(weights), dense.transpose(1, 2) @ (dense * rows),
                          rtol=1e-12, atol=1e-12)
    rhs = torch.randn(3, dense.shape[1], 4, generator=generator, dtype=torch.float64)
    assert torch.allclose(operator.adjoint(rhs, weights), dense.transpose(1, 2) @ (rhs * rows),
                          rtol=1e-12, atol=1e-12)
    x = torch.randn(3, dense.shape[2], 4, generator=generator, dtype=torch.float64)
    assert torch.allclose(operator.apply(x), dense @ x, rtol=1e-12, atol=1e-12)


def test_the_fc_fit_a_few_steps_at_a_time_equals_all_at_once(monkeypatch) -> None:
    """float32 rows fitted in float64 chunks of two steps give the very bits of one float64 pass
    (each step's products and norms are its own); no steps give empty results."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(5, 6, 7, generator=generator)
    bias = torch.randn(5, 6, generator=generator)
    bias[3] = 0  # nothing flowed back: x is 0 there
    whole = linear_input_with_noise(weight.double(), bias.double())
    monkeypatch.setattr(linear, "FLOAT64_CHUNK_BYTES", 2 * 8 * 6 * 7)
    chunked = linear_input_with_noise(weight, bias)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))
    assert float(chunked[0][3].abs().max()) == 0.0
    empty = linear_input_with_noise(weight[:0], bias[:0])
    assert [part.shape for part in empty] == [(0, 7), (0, 7)]


def test_the_active_rows_least_squares_matches_gelsd_and_refuses_rank_deficiency() -> None:
    """The Newton checks' least squares: the normal equations where they are well conditioned,
    gelsd where they are not, None where the rows do not fix every coefficient (exactly, or
    to machine precision), as gelsd's rank says."""
    from gradleak.inversion.layers.least_violation import full_rank_least_squares

    rng = np.random.default_rng(0)
    matrix, target = rng.standard_normal((300, 100)), rng.standard_normal(300)
    reference = np.linalg.lstsq(matrix, target, rcond=None)[0]
    assert np.abs(full_rank_least_squares(matrix, target) - reference).max() <= 1e-12
    # conditioned past the normal equations (cond 1e7): gelsd's answer
    left, _, right = np.linalg.svd(matrix, full_matrices=False)
    stretched = left @ np.diag(np.logspace(0, -7, 100)) @ right
    assert np.array_equal(full_rank_least_squares(stretched, target),
                          np.linalg.lstsq(stretched, target, rcond=None)[0])
    deficient = matrix.copy()
    deficient[:, -1] = deficient[:, :3] @ np.array([1.0, -2.0, 0.5])
    assert full_rank_least_squares(deficient, target) is None
    assert full_rank_least_squares(left @ np.diag(np.logspace(0, -16, 100)) @ right,
                                   target) is None


def test_the_deepest_block_decided_again_only_where_it_brings_the_features_closer(
        trained_statistics) -> None:
    """Gaussian noise of 1% of the gradients' RMS leaves every walk inconsistent; deciding the
    deepest block's units again replaces a step's deepest input only where its decisions change
    and it reproduces the features better (the attacker's own criterion), says so in the
    step's label, and leaves every other step's input as the walks found it."""
    observation, _ = trained_statistics
    gradients = observation.gradients.astype(np.float64)
    noise = np.random.default_rng(0).standard_normal(gradients.shape)
    noisy = replace(observation, gradients=(gradients + 0.01 * np.sqrt((gradients ** 2).mean())
                                            * noise).astype(np.float32))
    blocks = conv_blocks(victim_at_theta0(observation).double())
    walked = observed_conv_inputs(noisy, deepest_rules=())
    found = observed_conv_inputs(noisy)
    before, after = (f.inconsistency(blocks, "encoder.3") for f in (walked, found))
    changed = ~torch.all((found.inputs["encoder.3"] == walked.inputs["encoder.3"]).flatten(1), 1)
    assert bool(changed.any()) and not bool(changed.all())
    assert bool((after[changed] < before[changed]).all())
    assert torch.equal(after[~changed], before[~changed])
    assert all((" ×4 at encoder.3" in label) == bool(moved)
               for label, moved in zip(found.rules, changed.tolist()))
