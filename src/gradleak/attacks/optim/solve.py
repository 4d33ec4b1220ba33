"""DLG and Inverting Gradients on per-step actor-critic gradients, many frames at once.

Per frame the unknowns are the image, the advantage A_t and the return R_t (the server sees
neither; both are optimised jointly with the image), and the action: IG reads it off the
policy-head gradient in closed form, DLG optimises a soft action distribution (the paper's
variant). Frames are independent problems; one vmapped value-and-grad solves a batch of them,
and restarts are extra rows of the same batch, picked afterwards by the matching loss alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.func import grad_and_value, vmap
from tqdm import tqdm

from gradleak.attacks.action_rules import recover_actions
from gradleak.attacks.optim.config import BASELINES, OptimConfig, baseline_config
from gradleak.attacks.optim.lbfgs import BatchedLBFGS
from gradleak.attacks.optim.matching import (
    DummyGradient,
    gradient_distance,
    observed_columns,
    total_variation,
)
from gradleak.attacks.single_step import Context, single_step
from gradleak.threat import Observation, Reconstruction


@dataclass
class Problems:
    """The unknowns of B problems as one flat (B, n) tensor, and how to read it."""

    frames: torch.Tensor  # (B,) which observed row each problem inverts
    restarts: torch.Tensor  # (B,)
    x: torch.Tensor  # (B, n): image pixels, A and R, K soft-action logits, then the goal and
    # the pre-step state of a victim that reads them
    shape: tuple[int, int, int]
    num_actions: int

    @property
    def pixels(self) -> int:
        return int(np.prod(self.shape))


class GradientMatchingAttack:
    def __init__(self, observation: Observation, config: OptimConfig,
                 progress: bool = False) -> None:
        config.check()
        self.observation, self.config, self.progress = observation, config, progress
        self.dummy = DummyGradient(observation, config.matching)
        self.targets = torch.from_numpy(observed_columns(observation, self.dummy.layers))
        self.shape = observation.roles.transform.frame_shape
        self.num_actions = observation.victim.num_actions
        rule = recover_actions(observation, "odd-sign")
        self.rule_actions = torch.from_numpy(rule.actions)
        # σ_a = A ‖h‖₁ (π_a − 1): the taken action's row sum has the opposite sign of A, which
        # gives A its starting sign (DLG and IG alike; R starts at zero).
        sigma = rule.extras["sigma"]
        taken = sigma[np.arange(len(sigma)), rule.actions]
        self.advantage_sign = torch.from_numpy(-np.sign(taken)).float()

    # -- the per-problem objective ---------------------------------------------------------------
    def image(self, flat_pixels: torch.Tensor) -> torch.Tensor:
        image = flat_pixels.view(self.shape)
        return torch.sigmoid(image) if self.config.matching.box == "sigmoid" else image

    def _objective(self, x: torch.Tensor, observed: torch.Tensor, action: torch.Tensor
                   ) -> torch.Tensor:
        n = int(np.prod(self.shape))
        image = self.image(x[:n])
        advantage, ret = x[n], x[n + 1]
        k = n + 2 + self.num_actions
        if self.config.action == "soft":
            action = torch.softmax(x[n + 2:k], dim=0)
        goal_size = self.dummy.extra_sizes["goal"]
        goal = x[k:k + goal_size] if goal_size else None
        hidden = x[k + goal_size:] if self.dummy.extra_sizes["hidden"] else None
        dummy = self.dummy(image, action, advantage, ret, goal, hidden)
        loss = gradient_distance(dummy, self.dummy.split(observed), self.dummy.weights,
                                 self.config.matching.distance)
        if self.config.matching.tv:
            loss = loss + self.config.matching.tv * total_variation(image)
        return loss

    def loss_and_grad(self, problems: Problems) -> tuple[torch.Tensor, torch.Tensor]:
        value_and_grad = vmap(grad_and_value(self._objective), in_dims=(0, 0, 0))
        gradient, loss = value_and_grad(problems.x, self.targets[problems.frames],
                                        self.rule_actions[problems.frames])
        return loss.detach(), gradient.detach()

    # -- set-up ----------------------------------------------------------------------------------
    def problems(self, frames: np.ndarray) -> Problems:
        """Each (frame, restart) starts from its own seeded Gaussian, whatever batch holds it."""
        rows, frame_ids, restart_ids = [], [], []
        for frame in frames:
            for restart in range(self.config.restarts):
                generator = torch.Generator().manual_seed(
                    int(np.random.SeedSequence([self.config.seed, int(frame), restart])
                        .generate_state(1)[0]))
                pixels = torch.randn(int(np.prod(self.shape)), generator=generator)
                unknowns = torch.stack([self.advantage_sign[frame], torch.tensor(0.0)])
                logits = torch.randn(self.num_actions, generator=generator)
                extras = torch.zeros(sum(self.dummy.extra_sizes.values()))  # goal, state: 0
                rows.append(torch.cat([pixels, unknowns, logits, extras]))
                frame_ids.append(int(frame))
                restart_ids.append(restart)
        return Problems(torch.tensor(frame_ids), torch.tensor(restart_ids), torch.stack(rows),
                        self.shape, self.num_actions)

    # -- solving ---------------------------------------------------------------------------------
    def solve(self, problems: Problems) -> dict[str, Any]:
        config = self.config
        history = np.zeros((config.iterations, len(problems.x)), np.float32)
        snapshots: list[tuple[int, np.ndarray]] = []
        marks = set(np.linspace(0, config.iterations - 1, config.snapshots).astype(int)) \
            if config.snapshots else set()
        step = self._adam(problems) if config.optimiser == "adam" else self._lbfgs(problems)
        start = time.perf_counter()
        bar = tqdm(range(config.iterations), disable=not self.progress, unit="it",
                   desc=f"{config.optimiser} x{len(problems.x)}", leave=False)
        done = 0
        for iteration in bar:
            loss = step()
            history[iteration] = loss.numpy()
            done = iteration + 1
            if iteration in marks:
                snapshots.append((iteration, self._images(problems.x)))
            bar.set_postfix(match=f"{float(loss.mean()):.4g}")
            if config.time_limit_s is not None and time.perf_counter() - start > \
                    config.time_limit_s:
                break
        final, _ = self.loss_and_grad(problems)
        return {"loss": final.numpy(), "history": history[:done], "iterations": done,
                "seconds": time.perf_counter() - start, "snapshots": snapshots}

    def _adam(self, problems: Problems) -> Callable[[], torch.Tensor]:
        config = self.config
        x = problems.x.requires_grad_(False)
        optimiser = torch.optim.Adam([x], lr=config.lr)
        milestones = [int(config.iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)]
        schedule = torch.optim.lr_scheduler.MultiStepLR(
            optimiser, milestones if config.lr_decay else [], gamma=0.1)
        n = problems.pixels

        def step() -> torch.Tensor:
            loss, gradient = self.loss_and_grad(problems)
            x.grad = gradient.sign() if config.signed else gradient
            optimiser.step()
            schedule.step()
            if config.matching.box == "clamp":
                with torch.no_grad():
                    x[:, :n].clamp_(0.0, 1.0)
            return loss

        return step

    def _lbfgs(self, problems: Problems) -> Callable[[], torch.Tensor]:
        optimiser = BatchedLBFGS(len(problems.x), problems.x.shape[1], lr=self.config.lr,
                                 history=self.config.history)
        n = problems.pixels

        def step() -> torch.Tensor:
            loss, gradient = self.loss_and_grad(problems)
            problems.x = optimiser.step(problems.x, loss, gradient)
            if self.config.matching.box == "clamp":
                problems.x[:, :n].clamp_(0.0, 1.0)
            return loss

        return step

    def _images(self, x: torch.Tensor) -> np.ndarray:
        n = int(np.prod(self.shape))
        images = torch.stack([self.image(row[:n]) for row in x])
        images = torch.nan_to_num(images, nan=0.0)  # a diverged L-BFGS run scores as black
        return (images.clamp(0, 1) * 255).round().to(torch.uint8).numpy()

    # -- the attack ------------------------------------------------------------------------------
    def reconstruct(self, frames: np.ndarray | None = None) -> Reconstruction:
        """Invert the chosen observed rows (all by default), `config.batch` problems at a time.

        The restart kept for each frame is the one with the lowest final matching loss: the
        attacker's own objective, never a comparison with the private frame.
        """
        frames = np.arange(len(self.observation)) if frames is None else np.asarray(frames)
        per_batch = max(1, self.config.batch // self.config.restarts)
        results = []
        for start in range(0, len(frames), per_batch):
            problems = self.problems(frames[start:start + per_batch])
            solved = self.solve(problems)
            results.append((problems, solved))
        return self._assemble(frames, results)

    def _assemble(self, frames: np.ndarray, results: list[tuple[Problems, dict[str, Any]]]
                  ) -> Reconstruction:
        restarts, n = self.config.restarts, int(np.prod(self.shape))
        images, actions, advantages, returns, losses, chosen = [], [], [], [], [], []
        goals: list[np.ndarray] = []
        # each chosen run's loss after its first step (the first step also projects the random
        # start into the box, so later progress is the optimisation's own)
        first: list[np.ndarray] = []
        seconds, iterations = 0.0, []
        for problems, solved in results:
            loss = solved["loss"].reshape(-1, restarts)
            best = pick_restarts(loss)
            rows = np.arange(len(best)) * restarts + best
            x = problems.x[rows]
            images.append(self._images(x))
            if self.config.action == "soft":
                actions.append(x[:, n + 2:n + 2 + self.num_actions].argmax(1).numpy())
            else:
                actions.append(self.rule_actions[problems.frames[rows]].numpy())
            goal_start = n + 2 + self.num_actions
            goals.append(x[:, goal_start:goal_start + self.dummy.extra_sizes["goal"]].numpy())
            advantages.append(x[:, n].numpy())
            returns.append(x[:, n + 1].numpy())
            losses.append(loss[np.arange(len(best)), best])
            history = solved["history"]
            first.append(history[min(1, len(history) - 1)][rows] if len(history)
                         else losses[-1])
            chosen.append(best)
            seconds += solved["seconds"]
            iterations.append(solved["iterations"])
        history, snapshots = merge_histories([solved for _, solved in results])
        return Reconstruction(
            actions=np.concatenate(actions).astype(np.int64),
            images=np.concatenate(images),
            extras={"frames": frames, "matching_loss": np.concatenate(losses),
                    "matching_loss_after_first_step": np.concatenate(first),
                    "restart": np.concatenate(chosen), "advantages": np.concatenate(advantages),
                    "returns": np.concatenate(returns), "seconds": seconds,
                    "goals": np.concatenate(goals),  # (N, 0) for a victim without a goal
                    "seconds_per_frame": seconds / max(len(frames), 1),
                    "iterations": iterations, "history": history, "snapshots": snapshots})


def pick_restarts(losses: np.ndarray) -> np.ndarray:
    """(F, R) final matching losses → the restart to keep per frame (NaN never wins)."""
    return np.nan_to_num(losses, nan=np.inf).argmin(axis=1)


def merge_histories(batches: list[dict[str, Any]]) -> tuple[np.ndarray, list[tuple[int, Any]]]:
    """Loss curves of all problems side by side (NaN after a batch stopped early), and the
    snapshots every batch reached."""
    if not batches:
        return np.zeros((0, 0), np.float32), []
    longest = max(len(b["history"]) for b in batches)
    curves = [np.pad(b["history"], ((0, longest - len(b["history"])), (0, 0)),
                     constant_values=np.nan) for b in batches]
    common = set.intersection(*({i for i, _ in b["snapshots"]} for b in batches))
    snapshots = [(i, np.concatenate([dict(b["snapshots"])[i] for b in batches]))
                 for i in sorted(common)]
    return np.concatenate(curves, axis=1), snapshots


def optimisation_label(choice: str) -> str:
    """A baseline's row name: DLG, IG, DLG (probe loss), IG (probe loss)."""
    return choice.upper().replace("-PROBE", " (probe loss)")


@single_step("gradient matching", OptimConfig, kind="optimisation", needs=("theta0", "loss"),
             choices=lambda section: {name: baseline_config(
                 name, {"ig": section.ig, "dlg": section.dlg}) for name in BASELINES},
             label=lambda choice, settings: optimisation_label(choice))
def gradient_matching(observation: Observation, settings: OptimConfig, context: Context
                      ) -> GradientMatchingAttack:
    return GradientMatchingAttack(observation, settings, context.progress)
