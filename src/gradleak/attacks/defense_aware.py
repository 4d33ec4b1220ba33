"""The training-free attack that knows the defense: each entry's likelihood instead of equalities.

The training-free attack (`attacks.exact`) reads each step's gradient as exact. A defense that
leaves the update almost whole (pruning to 10%, 8-bit quantisation, a little noise) breaks its
equalities and its frames fall to the mean image, while the information is still there. This
attack takes the defense as the server that set the policy knows it — its kind and parameters
(`Observation.defense`: bits, kept fraction, σ, clipping norm), never its random draws — as a
`Channel` from the clean gradient g to the observed row y:

- an interval per entry (`cast`, `quant`, `prune`): g lies in y's rounding interval (cast: half
  the spacing of the dtype at y; quant: half the step, read off the row's range, within its
  minimum and maximum), or a kept entry is exact and a pruned one is bounded by the smallest
  kept magnitude (never "missing = 0");
- Gaussian noise of known σ (`noise`; `dpsgd`: σ·C, with the clipping an unknown positive
  scale: the direction survives).

Then, per step:

1. every Linear layer's gradient is rank one, δ hᵀ (with its bias gradient δ as one more
   column): it is fitted as such under the channel — the top singular pair under noise, a
   weighted alternating least-squares fit within the intervals under cast, quant and prune
   (completion of the pruned entries within their bound). The action, A and R come from the
   fitted heads by the closed form;
2. the frames start from the exact attack on the observed stream (its recursion estimates its
   own noise from each layer's residual, which a rank-one-fitted stream would hide);
3. L-BFGS finishes them on the channel's negative log-likelihood of the whole observed row
   given the gradient the frame, the action and the fitted A and R produce (the victim's exact
   loss at θ0): squared error over σ² under noise, after fitting the unknown scale under
   DP-SGD; under an interval channel each entry as uniform on its interval (Gaussian with the
   interval's variance, w²/12, about its centre), a kept entry of a pruned row as exact up to
   float32; plus total variation weighed by how much the channel leaves uncertain (a row it
   leaves all but exact keeps the exact attack's frame). A ReLU network's matching loss reaches
   the frame only through its activations, never through which units are on, so the finish climbs a
   ladder of softplus networks, sharper stage by stage, beginning at the softest one that fits
   the start about as well as the ReLU network (a start near its frame under a precise channel,
   bfloat16, would be pulled off by softer ones); one L-BFGS per frame; again from the mean
   colour of the frames that stayed far less likely than the others. Each frame keeps the most
   likely of its start and its stages' frames under the ReLU network itself (the attacker's own
   criterion; the private frame is never read).

With no defense the exact attack's frames come back unchanged. A chain of several transforms,
aggregation and 1-bit quantisation (a sign with an unknown scale) are refused up front, named.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gradleak.attacks.analytic import check_supported, linear_layers, recover_analytically
from gradleak.attacks.exact import ExactAttack, ExactConfig, not_applicable
from gradleak.attacks.frame_refiner import FrameRefiner
from gradleak.attacks.optim.matching import (
    DummyGradient,
    MatchingConfig,
    coefficients_from,
    total_variation,
)
from gradleak.errors import ConfigError
from gradleak.names import DEFENSE_AWARE
from gradleak.attacks.single_step import Context, single_step
from gradleak.registry import Registry
from gradleak.threat import Observation, Reconstruction
from gradleak.victims.base import victim_at_theta0

NAME = DEFENSE_AWARE
Bounds = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Channel:
    """How an observed row y came from the clean gradient g (per entry)."""

    name: str
    sigma: float = 0.0  # Gaussian noise on every entry
    scale_free: bool = False  # an unknown positive scale on g (DP-SGD's clipping)
    interval: Bounds | None = None  # (N, d) observed rows → (lower, upper) bounds on g

    @property
    def exact(self) -> bool:
        return self.interval is None and self.sigma == 0.0 and not self.scale_free


CHANNELS: Registry[Callable[[dict[str, Any]], Channel]] = Registry("defense likelihood")


@CHANNELS.register("cast")
def cast_channel(transform: dict[str, Any]) -> Channel:
    mantissa = {"bfloat16": 7, "float16": 10}[transform["dtype"]]
    smallest = {"bfloat16": 2.0 ** -133, "float16": 2.0 ** -24}[transform["dtype"]]

    def bounds(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, exponent = torch.frexp(y)  # |y| = m·2^e, m in [0.5, 1): its spacing is 2^(e-1-p)
        spacing = torch.ldexp(torch.ones_like(y), exponent - 1 - mantissa).clamp_min(smallest)
        # a zero came of an entry under half the smallest subnormal (frexp(0) says nothing)
        spacing = torch.where(y == 0, torch.full_like(y, smallest), spacing)
        return y - spacing / 2, y + spacing / 2

    return Channel("cast", interval=bounds)


@CHANNELS.register("quant")
def quant_channel(transform: dict[str, Any]) -> Channel:
    if transform["bits"] < 2:
        raise ConfigError("defense quant:1 (a sign with an unknown scale): not modelled by the "
                          "defense-aware attack")
    levels = 2 ** transform["bits"] - 1

    def bounds(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the row's minimum and maximum are its own (round(0) = 0, round(levels) = levels), so
        # the step is their distance over the levels; float32 arithmetic pads each bound
        low, high = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
        step = (high - low) / levels
        pad = 4 * torch.finfo(torch.float32).eps * y.abs().amax(-1, keepdim=True)
        return (torch.maximum(y - step / 2, low) - pad, torch.minimum(y + step / 2, high) + pad)

    return Channel("quant", interval=bounds)


@CHANNELS.register("prune")
def prune_channel(transform: dict[str, Any]) -> Channel:
    def bounds(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kept = y != 0
        floor = torch.where(kept, y.abs(), torch.full_like(y, torch.inf)).amin(-1, keepdim=True)
        floor = torch.where(torch.isfinite(floor), floor, torch.zeros_like(floor))
        return torch.where(kept, y, -floor), torch.where(kept, y, floor)

    return Channel("prune", interval=bounds)


@CHANNELS.register("noise")
def noise_channel(transform: dict[str, Any]) -> Channel:
    return Channel("noise", sigma=float(transform["sigma"]))


@CHANNELS.register("dpsgd")
def dpsgd_channel(transform: dict[str, Any]) -> Channel:
    return Channel("dpsgd", sigma=float(transform["sigma"]) * float(transform["clip"]),
                   scale_free=True)


def channel_of(defense: tuple[dict[str, Any], ...]) -> Channel:
    """The channel of a declared chain; a ConfigError naming what it cannot model."""
    if not defense:
        return Channel("none")
    if len(defense) > 1:
        names = "+".join(str(t.get("name")) for t in defense)
        raise ConfigError(f"defense {names}: a chain of several "
                          "transforms is not modelled by the defense-aware attack (one "
                          "transform: cast, quant, prune, noise or dpsgd)")
    transform = defense[0]
    if transform.get("name") not in CHANNELS:
        raise ConfigError(f"defense {transform.get('name')}: not modelled by the defense-aware "
                          f"attack (it models {', '.join(CHANNELS)}; an aggregate of steps is "
                          "read only by the learned attackers)")
    try:
        return CHANNELS.get(transform["name"])(transform)
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"defense {transform['name']}: its declared parameters "
                          f"{transform!r:.120} are not the ones `gradleak defend` records") \
            from None


# -- 1. rank-one Linear layers -----------------------------------------------------------------
def top_pair(matrix: torch.Tensor, steps: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, m, n) → the leading singular pair as (N, m) u·σ and (N, n) unit v, by power
    iteration from the columns' norms (a rank-one gradient plus noise has a wide gap)."""
    v = matrix.pow(2).sum(1).sqrt()
    v = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    for _ in range(steps):
        u = torch.einsum("bmn,bn->bm", matrix, v)
        v = torch.einsum("bmn,bm->bn", matrix, u)
        v = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    return torch.einsum("bmn,bn->bm", matrix, v), v


def rank_one(observed: torch.Tensor, bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
             rounds: int = 30, slack: float = 1e-3) -> torch.Tensor:
    """(N, m, n) observed Linear-layer gradients (bias as the last column) → their rank-one
    fit: the top singular pair (the fit under Gaussian noise), or, given per-entry bounds, a
    weighted alternating least-squares fit u vᵀ in which an exact entry (a kept entry of a
    pruned row) and an entry whose fit leaves its interval weigh 1, pulled to the interval,
    and every other entry `slack` (it only keeps the rows and columns with no exact entry
    defined). A synthetic 512 × 3137 rank-one gradient pruned to 10% comes back to 2e-15 on
    its determined columns in 30 rounds (`tests/attacks/test_defense_aware.py`)."""
    u, v = top_pair(observed)
    if bounds is None:
        return torch.einsum("bm,bn->bmn", u, v)
    lower, upper = bounds
    exact = (upper - lower) <= 1e-12 * upper.abs().amax((1, 2), keepdim=True)
    one = torch.ones((), dtype=observed.dtype)
    for _ in range(rounds):
        fit = torch.einsum("bm,bn->bmn", u, v)
        target = torch.minimum(torch.maximum(fit, lower), upper)
        weight = torch.where(exact | (target != fit), one, one * slack)
        u = torch.einsum("bmn,bmn,bn->bm", weight, target, v) \
            / torch.einsum("bmn,bn->bm", weight, v * v).clamp_min(1e-300)
        v = torch.einsum("bmn,bmn,bm->bn", weight, target, u) \
            / torch.einsum("bmn,bm->bn", weight, u * u).clamp_min(1e-300)
    return torch.einsum("bm,bn->bmn", u, v)


def linear_blocks(observation: Observation, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each closed-form Linear layer's part of (N, d) rows as (N, out, in + 1): the weight
    gradient with the bias gradient as its last column."""
    by_name = {layer.name: layer for layer in observation.layers}
    blocks = {}
    for module in linear_layers(observation):
        weight, bias = by_name[f"{module}.weight"], by_name[f"{module}.bias"]
        blocks[module] = torch.cat(
            [rows[:, weight.offset:weight.offset + weight.size].reshape(len(rows), *weight.shape),
             rows[:, bias.offset:bias.offset + bias.size, None]], dim=-1)
    return blocks


def repair_linear(observation: Observation, channel: Channel) -> Observation:
    """The observation with every closed-form Linear layer replaced by its rank-one fit under
    the channel (the bounds of an interval channel are the whole row's: a pruned row's bound
    is its smallest kept magnitude)."""
    if channel.exact:
        return observation
    rows = torch.from_numpy(observation.gradients).double()
    lower, upper = ((linear_blocks(observation, part) for part in channel.interval(rows))
                    if channel.interval else ({}, {}))
    gradients = observation.gradients.copy()
    by_name = {layer.name: layer for layer in observation.layers}
    for module, block in linear_blocks(observation, rows).items():
        fit = rank_one(block, (lower[module], upper[module]) if lower else None)
        weight, bias = by_name[f"{module}.weight"], by_name[f"{module}.bias"]
        gradients[:, weight.offset:weight.offset + weight.size] = \
            fit[..., :-1].flatten(1).float().numpy()
        gradients[:, bias.offset:bias.offset + bias.size] = fit[..., -1].float().numpy()
    return replace(observation, gradients=gradients)


def noise_estimate(observation: Observation) -> np.ndarray:
    """(N,) σ per step from the residual of the largest Linear layer's rank-one fit: what is
    left off rank one is noise (m·n − m − n + 1 degrees of freedom)."""
    blocks = linear_blocks(observation, torch.from_numpy(observation.gradients).double())
    block = max(blocks.values(), key=lambda b: b[0].numel())
    u, v = top_pair(block)
    residual = block - torch.einsum("bm,bn->bmn", u, v)
    m, n = block.shape[1:]
    return (residual.pow(2).sum((1, 2)) / (m * n - m - n + 1)).sqrt().numpy()


# -- the attack -----------------------------------------------------------------------------------
@dataclass
class DefenseAwareConfig:
    """What this attack adds to the exact attack it starts from (whose settings stay
    `ExactConfig`'s: `DefenseAwareRun` pairs the two)."""

    iterations: int = 80  # L-BFGS iterations of each stage of a frame's finish (0: none)
    history: int = 30  # its memory
    # anisotropic total variation, times the square root of the frame's likelihood floor
    # (`Matcher.floor`): 0.3 is 3e-3 at quant:12's floor (1e-4) and 5e-2 at quant:8's (3e-2),
    tv: float = 0.3
    # and at least `tv_lost` times the square root of the share of the row's energy that the
    # channel leaves uncertain (`Matcher.lost`): a pruned row's floor is ~0 (its kept entries
    # are exact), yet its pruned entries hold what the prior must make up (prune:0.1: 0.15 of
    # the energy, weight 6e-3; prune:0.5: 1e-14)
    tv_lost: float = 0.015
    # A frame whose row the channel leaves all but exact (less than this share of its energy
    # uncertain: pruning half a per-step gradient drops entries that are ~0 already) keeps the
    # exact attack's frame, which handles it as an undefended one. Its likelihood is then so
    # sharp that descent from a frame a few grey levels off lands on farther frames that still
    # score better (docs/audit.md)
    exact_below: float = 1e-7
    # The finish's stages: each of the victim's ReLU modules as a softplus of this sharpness
    # (β = s / the median |input| of that ReLU over the start frames), sharper stage by stage.
    # The matching loss of a ReLU network reaches a frame only through its activations, never
    # through which units are on, so L-BFGS on it stalls where a unit would have to switch
    sharpness: list[float] = field(default_factory=lambda: [10.0, 30.0, 100.0, 300.0])
    # A frame's ladder begins at the softest stage whose network fits its start within this
    # factor of the ReLU network's likelihood: a start that the soft networks fit worse (a
    # precise channel, a start already near its frame) would be pulled off by them
    soften_limit: float = 1.25
    # A second start, each frame's own mean colour, for the frames whose finished likelihood
    # is above this many times the median frame's (every frame when there are fewer than
    # three; None: never): where the recursion failed far from any scene, the finish from the
    # flat colour is the far more likely
    restart_above: float | None = 3.0
    # and it replaces the frame only where its likelihood is this many times higher: two
    # distant frames' likelihoods say little about which is nearer the private one (an example
    # under bfloat16: docs/training-free.md)
    restart_gain: float = 3.0

    def check(self) -> None:
        if self.iterations < 0 or self.history < 1 or not (self.tv >= 0
                                                            and self.tv_lost >= 0):
            raise ConfigError("defense_aware: expected iterations >= 0, history >= 1, tv >= 0 "
                              "and tv_lost >= 0")
        if not all(s > 0 for s in self.sharpness):
            raise ConfigError(f"defense_aware.sharpness {self.sharpness}: expected each > 0")
        if not self.exact_below >= 0:
            raise ConfigError(f"defense_aware.exact_below {self.exact_below}: expected >= 0")
        if not self.soften_limit >= 1:
            raise ConfigError(f"defense_aware.soften_limit {self.soften_limit}: expected >= 1")
        if self.restart_above is not None and not self.restart_above >= 0:
            raise ConfigError(f"defense_aware.restart_above {self.restart_above}: expected "
                              ">= 0, or null for never")
        if not self.restart_gain >= 1:
            raise ConfigError(f"defense_aware.restart_gain {self.restart_gain}: expected >= 1")


@dataclass
class DefenseAwareRun:
    """The defense-aware attack as a baseline of an evaluation: its settings and the exact
    attack's it starts from."""

    exact: ExactConfig = field(default_factory=ExactConfig)
    aware: DefenseAwareConfig = field(default_factory=DefenseAwareConfig)

    def check(self) -> None:
        self.exact.check()
        self.aware.check()


class DefenseAwareAttack:
    """`prior`: the learned prior the training-free settings name (`exact.prior`), loaded by
    the caller: the start is the training-free attack's frame, prior and all."""

    name = NAME

    def __init__(self, observation: Observation, config: DefenseAwareConfig | None = None,
                 exact: ExactConfig | None = None, prior: FrameRefiner | None = None) -> None:
        self.config, self.exact = config or DefenseAwareConfig(), exact or ExactConfig()
        self.config.check()
        self.exact.check()
        self.observation, self.prior = observation, prior
        self.channel = check_applicable(observation)  # refuses what it cannot do, first

    def reconstruct(self) -> Reconstruction:
        start = time.perf_counter()
        if self.channel.exact:  # nothing to model: the exact attack as it is
            return ExactAttack(self.observation, self.exact, self.prior).reconstruct()
        closed = recover_analytically(repair_linear(self.observation, self.channel))
        started = ExactAttack(self.observation, self.exact, self.prior).reconstruct()
        matcher = Matcher(self.observation, self.channel, closed)
        images, likelihood, improved = matcher.finish(started.images, self.config)
        seconds = time.perf_counter() - start
        return Reconstruction(actions=closed.actions, images=images, extras={
            "advantages": closed.extras["advantages"], "returns": closed.extras["returns"],
            "negative_log_likelihood": likelihood, "finished": improved,
            "channel": self.channel.name, "seconds": seconds,
            "seconds_per_frame": seconds / max(1, len(self.observation))})


def refusal(observation: Observation) -> str | None:
    """Why the attack cannot start (the training-free attack's architecture), model the
    observation's defense or read what it needs, or None."""
    reason = not_applicable(observation.victim)
    if reason:
        return reason
    try:
        check_applicable(observation)
    except ConfigError as error:
        return str(error)
    return None


@single_step("defense-aware", DefenseAwareRun, kind="training-free",
             needs=("theta0", "loss", "every layer", "declared defense"),
             choices=lambda section: {"defense-aware": DefenseAwareRun(
                 section.training_free, section.defense_aware)},
             label=lambda choice, settings: NAME, refuses=refusal,
             prior=lambda settings: settings.exact.prior)
def defense_aware(observation: Observation, settings: DefenseAwareRun, context: Context
                  ) -> DefenseAwareAttack:
    return DefenseAwareAttack(observation, settings.aware, settings.exact, context.prior)


def check_applicable(observation: Observation) -> Channel:
    """The channel of the observation's defense, once everything the attack reads is known
    to be there (a ConfigError naming what is not): a defense it models, the closed form's
    heads, the declared loss and every layer's gradient for the likelihood."""
    channel = channel_of(observation.defense)
    if not channel.exact:
        check_supported(observation)
        coefficients_from(observation.hyperparameters)
        held = {layer.name for layer in observation.layers}
        missing = sorted({name for name, _ in victim_at_theta0(observation).named_parameters()}
                         - held)
        if missing:
            raise ConfigError(f"the defense-aware attack matches every parameter's gradient; "
                              f"the observation lacks {', '.join(missing[:4])} (capture every "
                              "component)")
    return channel


class Matcher:
    """The channel's negative log-likelihood of each observed row given a frame, with the
    action, A and R the closed form reads off the rank-one fits (the victim's exact loss at
    θ0), and L-BFGS on the frames against it."""

    def __init__(self, observation: Observation, channel: Channel, closed: Reconstruction
                 ) -> None:
        self.channel = channel
        self.dummy = DummyGradient(observation, MatchingConfig(distance="l2"))
        if [layer.name for layer in self.dummy.layers] != [l.name for l in observation.layers]:
            raise ConfigError("defense-aware matching needs every observed layer's gradient")
        observed = torch.from_numpy(observation.gradients)
        if channel.interval is None:
            self.centre, self.weight = observed.float(), torch.ones_like(observed)
            spread = torch.full_like(observed, channel.sigma ** 2, dtype=torch.float64)
        else:
            lower, upper = channel.interval(observed.double())
            # float32's own rounding: the floor under an entry's spread (a kept entry is exact)
            floor = 1e-6 * observed.double().abs().amax(1, keepdim=True).clamp_min(1e-30)
            self.centre = ((lower + upper) / 2).float()
            spread = (upper - lower).pow(2) / 12 + floor.pow(2)
            self.weight = (1.0 / spread).float()
        self.weight = self.weight / self.weight.mean(1, keepdim=True)
        # (N,) the private frame's expected `loss` (without TV): each entry's spread over the
        # row's weighted size. The finish's prior weighs with its square root: where the
        # channel leaves the likelihood flat (quant:8), the prior must decide more
        weight, centre = self.weight.double(), self.centre.double()
        self.floor = ((weight * spread).mean(1)
                      / (weight * centre * centre).mean(1).clamp_min(1e-30)).float()
        # (N,) the share of the row's energy the channel leaves uncertain, unweighted: what the
        # prior must make up where the floor is ~0 (the pruned entries beside exact kept ones)
        self.lost = (spread.mean(1) / (centre * centre).mean(1).clamp_min(1e-30)).float()
        self.actions = torch.from_numpy(closed.actions)
        self.advantages = torch.from_numpy(closed.extras["advantages"]).float()
        self.returns = torch.from_numpy(closed.extras["returns"]).float()
        self.shape = observation.roles.transform.frame_shape
        self.smooth = smoothable(self.dummy.victim)  # the matcher's own copy of the victim

    def loss(self, pixels: torch.Tensor, centre: torch.Tensor, weight: torch.Tensor,
             action: torch.Tensor, advantage: torch.Tensor, ret: torch.Tensor, tv: float
             ) -> torch.Tensor:
        """One frame's (flat, in [0, 1]) negative log-likelihood, per entry and relative to
        the observed row's own weighted size, plus `tv` times its total variation."""
        image = pixels.clamp(0.0, 1.0).view(self.shape)
        g = torch.cat([part.flatten() for part in self.dummy(image, action, advantage, ret)])
        if self.channel.scale_free:  # the clipping's unknown scale, fitted in closed form
            g = g * ((weight * g * centre).sum() / (weight * g * g).sum().clamp_min(1e-30)
                     ).clamp_min(0.0)
        size = (weight * centre * centre).mean().clamp_min(1e-30)
        return (weight * (g - centre).pow(2)).mean() / size + tv * total_variation(image)

    def finish(self, images: np.ndarray, config: DefenseAwareConfig
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each frame on its own (one L-BFGS per frame: a joint one shares its steps and
        curvature between frames and converges far slower) up its ladder of softplus stages,
        then from its mean colour where it stayed far less likely than the others (taken where
        that is clearly more likely still); each keeps the most likely of its start and every
        stage's frame, under the victim's own ReLUs (the attacker's own criterion). Returns
        the frames, their negative log-likelihood and which were changed."""
        out, scores = images.copy(), np.zeros(len(images))
        starts = torch.from_numpy(images).float().flatten(1) / 255.0
        ladder = self.ladder(starts, config) if config.iterations else []
        exact = (self.lost <= config.exact_below).numpy()
        for row in range(len(images)):
            out[row], scores[row] = self.descend(row, starts[row], [] if exact[row] else ladder,
                                                 config, fit_start=True)
        if config.iterations and config.restart_above is not None:
            far = scores > config.restart_above * np.median(scores) if len(images) >= 3 \
                else np.ones(len(images), dtype=bool)
            far &= ~exact
            for row in np.flatnonzero(far):
                first = torch.from_numpy(out[row]).float().flatten() / 255.0
                image, score = self.descend(row, mean_colour(first[None], self.shape)[0],
                                            ladder, config, fit_start=False)
                if score * config.restart_gain < scores[row]:
                    out[row], scores[row] = image, score
        changed = (out != images).reshape(len(images), -1).any(1)
        return out, scores, changed

    def descend(self, row: int, start: torch.Tensor, ladder: list[float | None],
                config: DefenseAwareConfig, fit_start: bool) -> tuple[np.ndarray, float]:
        """One frame from `start` up the ladder (from the softest stage that fits the start
        about as well as the ReLU network, if `fit_start`): the most likely of the start and
        each stage's frame, as stored (uint8), and its negative log-likelihood."""
        given = (self.centre[row], self.weight[row], self.actions[row], self.advantages[row],
                 self.returns[row])

        def likelihood(pixels: torch.Tensor, sharpness: float | None = None) -> float:
            self.sharpen(sharpness)
            with torch.no_grad():
                value = float(self.loss(pixels, *given, 0.0))
            self.sharpen(None)
            return value

        best, chosen = likelihood(start), start
        tv = max(config.tv * float(self.floor[row]) ** 0.5,
                 config.tv_lost * float(self.lost[row]) ** 0.5)
        if fit_start:
            fits = [s is None or likelihood(start, s) <= config.soften_limit * best
                    for s in ladder]
            ladder = ladder[fits.index(True):] if True in fits else []
        pixels = start.clone().requires_grad_(True)
        for sharpness in ladder:
            self.sharpen(sharpness)
            lbfgs(lambda: self.loss(pixels, *given, tv), pixels, config)
            self.sharpen(None)
            stored = (pixels.detach().clamp(0.0, 1.0) * 255).round() / 255
            score = likelihood(stored)
            if score < best:
                best, chosen = score, stored
        image = (chosen.view(self.shape) * 255).round().to(torch.uint8).numpy()
        return image, best

    def ladder(self, start: torch.Tensor, config: DefenseAwareConfig) -> list[float | None]:
        """The stages' sharpness, once each smooth ReLU's scale is set from the start frames;
        a victim without ReLU modules has one plain stage."""
        if not self.smooth or not config.sharpness:
            return [None]
        seen: list[list[torch.Tensor]] = [[] for _ in self.smooth]
        hooks = [unit.register_forward_pre_hook(
            lambda _, args, into=into: into.append(args[0].detach().abs().flatten()))
            for unit, into in zip(self.smooth, seen)]
        with torch.no_grad():
            self.dummy.victim(start.view(-1, *self.shape) * 255.0)
        for hook in hooks:
            hook.remove()
        for unit, values in zip(self.smooth, seen):
            size = torch.cat(values) if values else torch.ones(1)
            unit.scale = float(size.median()) or float(size.mean()) or 1.0
        return list(config.sharpness)

    def sharpen(self, sharpness: float | None) -> None:
        for unit in self.smooth:
            unit.sharpness = sharpness


def mean_colour(frames: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """(N, H·W·C) flat frames in [0, 1] → each one's mean colour, as flat frames."""
    images = frames.view(-1, *shape)
    return images.mean((1, 2), keepdim=True).expand_as(images).reshape(len(frames), -1)


def lbfgs(objective: Callable[[], torch.Tensor], pixels: torch.Tensor,
          config: DefenseAwareConfig) -> None:
    """`config.iterations` of L-BFGS with a strong-Wolfe line search on `objective`, scaled to
    1 at the start (L-BFGS's tolerances are absolute, and the likelihood is 1e-4 to 1e-1 per
    frame): no early stop but the line search's own."""
    with torch.no_grad():
        scale = float(objective()) or 1.0
    optimiser = torch.optim.LBFGS([pixels], lr=1.0, max_iter=config.iterations,
                                  history_size=config.history, line_search_fn="strong_wolfe",
                                  tolerance_grad=0.0, tolerance_change=0.0)

    def closure() -> torch.Tensor:
        optimiser.zero_grad()
        total = objective() / scale
        total.backward()
        return total

    optimiser.step(closure)


class SmoothReLU(nn.Module):
    """A ReLU the finish can soften to softplus(βx)/β, β = sharpness / scale (None: ReLU)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0
        self.sharpness: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sharpness is None:
            return torch.relu(x)
        return F.softplus(x, beta=self.sharpness / self.scale)


def smoothable(module: nn.Module) -> list[SmoothReLU]:
    """Each `nn.ReLU` submodule of `module` replaced, in place, by a `SmoothReLU` (a ReLU
    called as a function stays one)."""
    found = []
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.ReLU:
                smooth = SmoothReLU()
                setattr(parent, name, smooth)
                found.append(smooth)
    return found
