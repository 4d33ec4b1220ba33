"""The training-free attack: every step's frame and action from its gradient and θ0 alone.

The action, A and R come from the closed form on the heads (`attacks.analytic`); the frame from
the first route of `attacks.frame_inverse` the victim allows: a ViT's patch embedding in closed
form (`attacks.patch_embedding`), or the recursion down the conv stack
(`inversion.conv_recovery`) and then the first conv's own equations (`inversion.first_conv`).
Nothing is learned and nothing but the observation is read, so it is a method like DLG or IG:
`gradleak attack training-free`, `evaluate --baselines training-free`. On the conv stack,
neighbouring steps that saw the same frame are solved together (an attacker keeps the stream,
so a frame may use the next step's gradient): a chunk's last such run waits for the next chunk,
so only a run longer than a chunk is split. `same_frame_tolerance=0` solves each step from its
own gradient alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from gradleak.attacks import patch_embedding as _patch_embedding  # noqa: F401 (its route)
from gradleak.attacks.analytic import recover_analytically
from gradleak.attacks.conv_inputs import observed_conv_inputs
from gradleak.attacks.frame_inverse import (
    FRAME_INVERSES,
    FrameInverse,
    frame_inverse_for,
    register_frame_inverse,
)
from gradleak.attacks.frame_refiner import FrameRefiner
from gradleak.attacks.single_step import Context, single_step
from gradleak.errors import ConfigError
from gradleak.inversion.conv_blocks import ConvBlock, conv_blocks, deepest_inputs
from gradleak.inversion.conv_recovery import ConvInputs
from gradleak.inversion.first_conv import (
    FIRST_BLOCK_MARGIN,
    GRADIENT_TOLERANCE,
    NOISE_REFERENCE,
    NoiseModel,
    first_conv_equations,
)
from gradleak.inversion.frame_solve import (
    SAME_FRAME_TOLERANCE,
    FrameSolve,
    Tie,
    project_frames,
    same_frames,
    solve_frames,
)
from gradleak.names import TRAINING_FREE, WITH_PRIOR
from gradleak.threat import Observation, Reconstruction
from gradleak.victims.base import Victim, VictimConfig, create_victim, victim_at_theta0


@dataclass
class ExactConfig:
    # a first-block unit counts as on this many noise deviations above 0
    threshold: float = FIRST_BLOCK_MARGIN
    # the frame from the first conv's equations: the smoothness weight, CG iterations of the
    # quadratic solve, then reweighting rounds (edges as total variation, the off-units and the
    # input range as inequalities), the colour weighting and the arithmetic
    solve: FrameSolve = field(default_factory=FrameSolve)
    weight_gradient: bool = True  # use the first conv's weight-gradient equations
    # neighbouring steps of an episode whose recovered first-block maps differ by at most this
    # (relative) saw one frame and are solved as one (frame_solve.same_frames); 0: every step
    # from its own gradient alone
    same_frame_tolerance: float = SAME_FRAME_TOLERANCE
    chunk: int = 16  # steps solved together
    # weigh the equations by how exact they are (first_conv.NoiseModel); off: as if exact
    noise_aware: bool = True
    gradient_tolerance: float = GRADIENT_TOLERANCE  # ∇b₁ check at which ∇W₁ counts half
    noise_reference: float = NOISE_REFERENCE  # on-unit noise above which smoothness grows
    # a learned prior: the directory of a refiner fitted by `gradleak train-prior` on the
    # attacker's own captures at the same θ0 ("": none); its frame goes back through the
    # equations for `prior_projection` CG iterations (0: taken as it is)
    prior: str = ""
    prior_projection: int = 30

    def check(self) -> None:
        self.solve.check()
        if self.chunk < 1:
            raise ConfigError(f"chunk {self.chunk}: expected >= 1")
        if not self.threshold >= 0:
            raise ConfigError("threshold must be non-negative")
        if not (self.gradient_tolerance > 0 and self.noise_reference > 0):
            raise ConfigError("gradient_tolerance and noise_reference must be positive")
        if not self.same_frame_tolerance >= 0:
            raise ConfigError(f"same_frame_tolerance {self.same_frame_tolerance}: expected >= 0 "
                              "(0: off)")
        if self.prior_projection < 0:
            raise ConfigError(f"prior_projection {self.prior_projection}: expected >= 0")

    def noise_model(self) -> NoiseModel | None:
        return NoiseModel(self.gradient_tolerance, self.noise_reference) \
            if self.noise_aware else None


NAME = TRAINING_FREE


class ExactAttack:
    """`prior`: the refiner `config.prior` names, loaded by the caller (a fitted model is read
    from its checkpoint by `training.refiner_fit.exact_attack`, which checks its θ0). The
    frame comes from the first route of `attacks.frame_inverse` the victim's architecture
    allows (`route`: its name)."""

    name = NAME

    def __init__(self, observation: Observation, config: ExactConfig | None = None,
                 prior: FrameRefiner | None = None) -> None:
        self.observation, self.config = observation, config or ExactConfig()
        self.config.check()
        if bool(self.config.prior) != (prior is not None):
            raise ConfigError(f"attack.training_free.prior={self.config.prior!r}: the learned "
                              "prior it names must be loaded and passed with it "
                              "(training.refiner_fit.exact_attack does both)")
        if prior is not None:
            self.name = WITH_PRIOR
        self.victim = victim_at_theta0(observation).double()
        inverse = frame_inverse_for(self.victim)
        self.route = next(name for name in FRAME_INVERSES if FRAME_INVERSES.get(name) is inverse)
        self.inverse = inverse(self.victim, self.config, prior)
        held = {layer.name for layer in observation.layers}
        missing = [name for name in self.inverse.layers() if name not in held]
        if missing:
            raise ConfigError(f"the training-free attack's {self.route} route reads the "
                              f"gradient of {', '.join(missing)}, which this capture left out: "
                              "capture every component (the default)")

    def reconstruct(self) -> Reconstruction:
        start = time.perf_counter()
        closed = recover_analytically(self.observation)
        frames, diagnostics = self.inverse.frames(self.observation)
        images = frames.clamp(0, 255).round().to(torch.uint8).numpy()
        return Reconstruction(actions=closed.actions, images=images, extras={
            "advantages": closed.extras["advantages"], "returns": closed.extras["returns"],
            "route": self.route,
            "residuals": {key: value.numpy() for key, value in diagnostics.items()},
            "seconds": time.perf_counter() - start,
            "seconds_per_frame": (time.perf_counter() - start) / max(1, len(self.observation))})


@register_frame_inverse("conv stack")
class ConvStackFrames(FrameInverse):
    """Down the conv stack by the recursion, then the first conv's own equations. Neighbouring
    steps that saw the same frame are solved together: a chunk's last such run waits for the
    next chunk, so only a run longer than a chunk is split."""

    priority = 20

    def __init__(self, victim: Victim, config: ExactConfig, prior: FrameRefiner | None = None
                 ) -> None:
        super().__init__(victim, config, prior)
        self.first = first_block(victim)
        self.second = conv_blocks(victim)[1].name  # the recursion walks down to its input

    @classmethod
    def check(cls, victim: Victim) -> None:
        first_block(victim)

    def frames(self, observation: Observation) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        frames, residuals = [], []
        count, held = len(observation), np.empty(0, dtype=np.int64)
        for begin in range(0, count, self.config.chunk):
            rows = np.concatenate([held, np.arange(begin, min(begin + self.config.chunk, count))])
            found, tie = self._recover(observation, rows)
            solved = len(rows) if begin + self.config.chunk >= count else self._ready(tie)
            held = rows[solved:]
            if solved:
                images, fit = self._frames(observation, rows[:solved],
                                           found.steps(torch.arange(solved)),
                                           Tie.of(tie.group[:solved]))
                frames.append(images)
                residuals.append(fit)
        return torch.cat(frames), {key: torch.cat([r[key] for r in residuals])
                                   for key in residuals[0]}

    def _recover(self, observation: Observation, rows: np.ndarray) -> tuple[ConvInputs, Tie]:
        """The recursion on these steps, and which of them saw one frame."""
        part = observation.steps(rows)
        found = observed_conv_inputs(part, down_to=self.second)
        return found, same_frames(list(found.inputs.values())[-1], part.episode_ids,
                                  part.step_in_episode, self.config.same_frame_tolerance)

    def _ready(self, tie: Tie) -> int:
        """How many of a chunk's steps to solve now: all but its last run of one frame, which
        the next chunk may continue, unless that run is already longer than a chunk."""
        last = int((tie.group == tie.group[-1]).nonzero()[0])
        return len(tie.group) if len(tie.group) - last > self.config.chunk else last

    def _frames(self, observation: Observation, rows: np.ndarray, found: ConvInputs, tie: Tie
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        part = observation.steps(rows)
        deepest = list(found.inputs)[-1]
        gradient = self.first.weight_gradient(
            torch.from_numpy(part.block(f"{self.first.name}.weight").astype(np.float64)))
        equations = first_conv_equations(self.victim, found.inputs[deepest],
                                         found.noise[deepest], found.upstream[deepest],
                                         gradient, self.config.threshold,
                                         bias_gradient(part, self.first))
        if not self.config.weight_gradient:  # its mean colour still starts the solve
            equations = replace(equations, weight_gradient=None)
        transform, noise = self.victim.roles().transform, self.config.noise_model()
        frames, residuals = solve_frames(equations, transform, self.config.solve, noise,
                                         tie)
        if self.prior is None:
            return frames, residuals
        with torch.no_grad():  # the refiner saw the attack's stored (rounded) frames
            stored = frames.clamp(0, 255).round().permute(0, 3, 1, 2).float() / 255
            refined = self.prior(stored).permute(0, 2, 3, 1).double() * 255
        return project_frames(equations, transform, refined, self.config.prior_projection,
                              self.config.solve, noise, tie)


def first_block(victim: Victim) -> ConvBlock:
    """The first conv block, when the recursion reaches its output; a ConfigError naming why
    not otherwise (no conv stack, or one the gradient does not determine)."""
    blocks = conv_blocks(victim)  # refuses a victim without a conv stack
    reached = deepest_inputs(victim)
    if len(blocks) < 2 or blocks[1].name not in reached:
        raise ConfigError(f"victim {victim.config.name}: the recursion reaches the input of "
                          f"{reached[-1]} only; the first conv's equations need the first "
                          "block's output (the second conv's input)")
    if blocks[0].group_norm is not None:
        raise ConfigError(f"victim {victim.config.name}: its first conv block normalises "
                          "each step by its own GroupNorm statistics, which the frame solve "
                          "does not read yet (the blocks above it are walked)")
    return blocks[0]


@single_step(TRAINING_FREE, ExactConfig, kind="training-free", needs=("theta0",),
             choices=lambda section: {TRAINING_FREE: section.training_free},
             label=lambda choice, settings: WITH_PRIOR if settings.prior else TRAINING_FREE,
             refuses=lambda observation: not_applicable(observation.victim),
             prior=lambda settings: settings.prior)
def training_free(observation: Observation, settings: ExactConfig, context: Context
                  ) -> ExactAttack:
    return ExactAttack(observation, settings, context.prior)


def not_applicable(config: VictimConfig) -> str | None:
    """Why the training-free attack cannot run on this victim (None: it can), read from its
    architecture alone, before any gradient: every route's reason."""
    try:
        frame_inverse_for(create_victim(config))
    except ConfigError as error:
        return str(error)
    return None


def bias_gradient(observation: Observation, first: ConvBlock) -> torch.Tensor | None:
    """(N, O) the first conv's observed bias gradient (its folded BatchNorm's β's where it has
    one before its ReLU): it checks δ₁. None where there is none or the capture left it out
    (the solve then weighs ∇W₁'s equations as exact)."""
    if first.bias_source is None or first.bias_source[0] not in {
            layer.name for layer in observation.layers}:
        return None
    return first.bias_gradient(torch.from_numpy(
        observation.block(first.bias_source[0]).astype(np.float64)))
