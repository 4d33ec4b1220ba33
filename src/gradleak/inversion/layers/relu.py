"""ReLU: which units are on. Below a ReLU the walk knows the pre-activation exactly where the
unit is on (it equals the output) and only that it is ≤ 0 where it is off, and the gradient
reaching the pre-activation is the output's times the on-mask. The output comes back with noise
(a defense, the wire's rounding, the victim's float32 arithmetic), so the mask is decided: by a
margin of noise deviations around 0, or by each unit's posterior probability of being on, and
the units either leaves ambiguous are settled by alternating with the conv below (its weight
gradient is linear in δ given its input, and in its input given δ).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gradleak.inversion.layers.base import GradientOf, Known, LayerInverse, register_layer_inverse
from gradleak.inversion.layers.conv import fitted_output_gradient, robust_input, solve_input
from gradleak.inversion.layers.conv_equations import ConvLayer
from gradleak.inversion.layers.null_space import KnownOutputs


@dataclass(frozen=True)
class MaskRule:
    """How one walk decides which ReLU units are on. With a `margin`: on above that many noise
    deviations, off below minus it, the units within settled by `rounds` alternations against
    the weight gradient below. Without (the noise-aware rule): each unit's posterior
    probability of being on given its recovered value and deviation (`posterior_on`), the
    ambiguous ones settled by `rounds` alternations against a fit that down-weighs the channels
    a wrong decision shows in (`layers.conv.robust_input`)."""

    margin: float | None = None
    rounds: int = 3
    # the posterior rule's ambiguous units: by their odds times the fitted δ's evidence
    # (`likelier_on`), or, False, by whether the fitted δ is nearer the on-value than 0
    odds: bool = True

    @property
    def label(self) -> str:
        if self.margin is not None:
            return f"margin {self.margin:g}"
        return "posterior" if self.odds else "posterior, nearer"


def margin_states(at_output: Known, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Which units are surely on, and which undecided (within `threshold` noise deviations
    and the rounding bound of 0)."""
    margin = threshold * at_output.noise + at_output.rounding
    return at_output.value > margin, at_output.value.abs() <= margin


def deviations(at_output: Known) -> torch.Tensor:
    """Each unit's standard deviation: the noise's, and the rounding's taken as a third of its
    bound."""
    return at_output.noise + at_output.rounding / 3


@register_layer_inverse("relu")
class Relu(LayerInverse):
    """A ReLU above `conv`: its on-units decided by `rule`, the ambiguous ones settled with
    the conv's observed weight gradient (`weight_gradient`, (N, O, C, k, k))."""

    kinds = ("relu",)
    module_types = (nn.ReLU,)

    def __init__(self, rule: MaskRule, conv: ConvLayer, weight_gradient: torch.Tensor) -> None:
        self.rule, self.conv, self.weight_gradient = rule, conv, weight_gradient

    def invert(self, at_output: Known, gradient_of: GradientOf | None = None) -> Known:
        mask = self.decide(at_output)
        return Known(at_output.value, at_output.noise, at_output.gradient * mask,
                     at_output.rounding, on=mask)

    def decide(self, at_output: Known) -> torch.Tensor:
        """(N, C, h, w) bool: the units taken as on."""
        full, relu = at_output.gradient, at_output.value  # δ where the unit is on
        if self.rule.margin is None:
            return posterior_mask(self.conv, full, relu, deviations(at_output),
                                  self.weight_gradient, self.rule.rounds, self.rule.odds)
        sure, undecided = margin_states(at_output, self.rule.margin)
        mask = sure.clone()
        rows = undecided.flatten(1).any(1).nonzero().flatten()
        if self.rule.rounds and len(rows):
            # without the layer below: the rounds need the masks right, not every null
            # direction fixed (the linear programme is left to the final solve)
            mask[rows] = settle_masks(self.conv, full[rows], KnownOutputs(relu[rows],
                                                                          sure[rows]),
                                      undecided[rows], self.weight_gradient[rows],
                                      self.rule.rounds)
        return mask


# a unit whose posterior is within this of 0 or 1 keeps it; the rest are settled by the fit
DECIDED = 1e-3


def posterior_mask(block: ConvLayer, full: torch.Tensor, relu: torch.Tensor,
                   deviation: torch.Tensor, weight_gradient: torch.Tensor, rounds: int = 1,
                   odds: bool = True) -> torch.Tensor:
    """On where the posterior says so; the ambiguous units by the δ fitted to the weight
    gradient given the channel-robust input: with `odds`, by their posterior odds times that
    δ's evidence (`likelier_on`), else where it is nearer the on-value than 0 (which calls on
    the off units whose δ would be within the fit's noise; under coarse quantisation, whose
    errors are not Gaussian, it is still the better rule on some steps)."""
    probability = posterior_on(relu, deviation)
    mask = probability > 0.5
    ambiguous = (probability > DECIDED) & (probability < 1 - DECIDED)
    log_odds = torch.log(probability) - torch.log1p(-probability)
    rows = ambiguous.flatten(1).any(1).nonzero().flatten()
    for _ in range(rounds):
        if not len(rows):
            break
        inputs = robust_input(block, (full * mask)[rows], weight_gradient[rows])
        fitted = fitted_output_gradient(block, inputs, weight_gradient[rows])
        on = likelier_on(fitted, full[rows], log_odds[rows], probability[rows]) if odds \
            else nearer_on(fitted, full[rows])
        settled = torch.where(ambiguous[rows], on, mask[rows])
        moved = (settled != mask[rows]).flatten(1).any(1)
        mask[rows] = settled
        rows = rows[moved]  # a step whose units all stayed is settled
    return mask


def likelier_on(fitted: torch.Tensor, full: torch.Tensor, log_odds: torch.Tensor,
                probability: torch.Tensor) -> torch.Tensor:
    """(N, C, h, w) where on is the likelier state: the unit's prior log-odds plus the log
    likelihood ratio of its fitted δ, Gaussian about `full` (on) or 0 (off) with the fit's
    deviation. That deviation is read per step and channel off the units the posterior decided
    (their fitted δ against their known state; a channel with none takes its step's), so a unit
    whose δ would be within the fit's noise keeps its prior."""
    decided_off, decided_on = probability < DECIDED, probability > 1 - DECIDED
    residual = torch.where(decided_off, fitted, torch.where(decided_on, fitted - full, torch.nan))
    spread = MAD_TO_DEVIATION * torch.nanmedian(residual.abs().flatten(2), 2).values
    of_step = MAD_TO_DEVIATION * torch.nanmedian(residual.abs().flatten(1), 1).values
    spread = torch.where(torch.isnan(spread), of_step[:, None], spread)[..., None, None]
    evidence = (fitted ** 2 - (fitted - full) ** 2) / (2 * spread ** 2)
    evidence = torch.nan_to_num(evidence, nan=0.0)  # a step with no decided unit: the prior
    return log_odds + evidence > 0


# a Gaussian's standard deviation over the median absolute deviation from its centre
MAD_TO_DEVIATION = 1.4826


def settle_masks(block: ConvLayer, full: torch.Tensor, surely_on: KnownOutputs,
                 undecided: torch.Tensor, weight_gradient: torch.Tensor,
                 rounds: int) -> torch.Tensor:
    """Alternate: input from δ, δ from input; keep an undecided unit on where the fitted δ is
    nearer the on-value than 0. Only the surely-on units' values are trusted as equations."""
    sure = surely_on.on
    mask = sure.clone()
    for _ in range(rounds):
        a = solve_input(block, full * mask, weight_gradient, surely_on)
        fitted = fitted_output_gradient(block, a, weight_gradient)
        mask = torch.where(undecided, nearer_on(fitted, full), sure)
    return mask


def nearer_on(fitted: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Where the fitted δ is nearer its on-value `full` than 0."""
    return (fitted - full).abs() < fitted.abs()


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
