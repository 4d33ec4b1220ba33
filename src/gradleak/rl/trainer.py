"""PPO and A2C training of a registry victim, CleanRL style: one update reads top to bottom.

BatchNorm: rollouts, the "old" log-probabilities and the minibatch updates all run the victim in
eval mode, so PPO's ratio is exactly 1 on the first minibatch; the running statistics are
refreshed once per update, after the optimiser steps, from that rollout's frames. Capture later
freezes θ0 in eval mode too, so the victim is always evaluated the way it was trained.
"""

from __future__ import annotations

import csv
import io
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from gradleak.envs.factory import make_env, num_actions, scene_names
from gradleak.errors import ConfigError
from gradleak.io import (
    atomic_path,
    check_output,
    load_tensors,
    load_victim,
    read_json,
    run_directory,
    save_tensors,
    save_victim,
    write_json,
)
from gradleak.rl.advantages import gae
from gradleak.rl.config import TrainingSetup
from gradleak.rl.losses import LossCoefficients, actor_critic_loss, log_probs_and_entropy
from gradleak.rl.rollout import Rollout, VectorRunner
from gradleak.victims.base import Victim, VictimConfig, create_victim

ALGORITHMS = ("ppo", "a2c")
TRAINER_STATE = "trainer.safetensors"
TRAINER_META = "trainer.json"
CURVE_CSV = "learning_curve.csv"
CURVE_PNG = "learning_curve.png"


@dataclass
class UpdateStats:
    update: int
    env_steps: int
    episodes: int
    mean_return: float
    success_rate: float
    mean_length: float
    policy_loss: float
    value_loss: float
    entropy: float
    approx_kl: float
    steps_per_second: float


def loss_coefficients(preset: TrainingSetup) -> LossCoefficients:
    t = preset.train
    return LossCoefficients(value=t.value_coef, entropy=t.entropy_coef, clip=t.clip)


def _minibatch_loss(victim: Victim, batch: dict[str, torch.Tensor], coefficients: LossCoefficients,
                    ppo: bool) -> tuple[torch.Tensor, dict[str, float]]:
    # a recurrent victim reads each step's recorded pre-step state as a detached input
    logits, values = victim(batch["images"], batch["goals"], batch.get("hidden"))
    advantages = batch["advantages"]
    advantages = (advantages - advantages.mean()) / (advantages.std(unbiased=False) + 1e-8)
    losses = actor_critic_loss(logits, values, batch["actions"], advantages, batch["returns"],
                               coefficients, batch["log_probs"] if ppo else None)
    with torch.no_grad():
        log_prob, entropy = log_probs_and_entropy(logits, batch["actions"])
        log_ratio = log_prob - batch["log_probs"]
        stats = {"value_loss": float(((values - batch["returns"]) ** 2).mean()),
                 "entropy": float(entropy.mean()),
                 "approx_kl": float(((log_ratio.exp() - 1) - log_ratio).mean())}
    stats["policy_loss"] = (float(losses.detach().mean())
                            - coefficients.value * stats["value_loss"]
                            + coefficients.entropy * stats["entropy"])
    return losses.mean(), stats


def _flatten_rollout(rollout: Rollout, advantages: np.ndarray) -> dict[str, torch.Tensor]:
    def flat(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a.reshape((-1,) + a.shape[2:])))

    returns = advantages + rollout.values
    data = {"images": flat(rollout.images), "goals": flat(rollout.goals),
            "actions": flat(rollout.actions), "log_probs": flat(rollout.log_probs),
            "advantages": flat(advantages.astype(np.float32)),
            "returns": flat(returns.astype(np.float32))}
    if rollout.hidden is not None:
        data["hidden"] = flat(rollout.hidden)
    return data


def _optimise(victim: Victim, optimiser: torch.optim.Optimizer, data: dict[str, torch.Tensor],
              preset: TrainingSetup, generator: torch.Generator) -> dict[str, float]:
    train = preset.train
    ppo = train.algo == "ppo"
    coefficients = loss_coefficients(preset)
    size = len(data["actions"])
    epochs, minibatch = (train.epochs, train.minibatch) if ppo else (1, size)
    totals: dict[str, list[float]] = {}
    for _ in range(epochs):
        order = torch.randperm(size, generator=generator)
        for start in range(0, size, minibatch):
            index = order[start:start + minibatch]
            loss, stats = _minibatch_loss(victim, {k: v[index] for k, v in data.items()},
                                          coefficients, ppo)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(victim.parameters(), train.max_grad_norm)
            optimiser.step()
            for key, value in stats.items():
                totals.setdefault(key, []).append(value)
    return {key: float(np.mean(values)) for key, values in totals.items()}


@torch.no_grad()
def refresh_batchnorm(victim: Victim, images: torch.Tensor, goals: torch.Tensor,
                      chunk: int = 256) -> None:
    victim.train()
    for start in range(0, len(images), chunk):
        victim(images[start:start + chunk], goals[start:start + chunk])
    victim.eval()


class VictimTrainer:
    """Owns the victim, optimiser, environments and the run directory of one training run."""

    def __init__(self, preset: TrainingSetup, out: Path, resume: bool = False) -> None:
        if preset.train.algo not in ALGORITHMS:
            raise ConfigError(f"train.algo={preset.train.algo!r}: expected one of "
                              f"{', '.join(ALGORITHMS)}")
        self.preset, self.out = preset, Path(out)
        torch.manual_seed(preset.train.seed)
        self.generator = torch.Generator().manual_seed(preset.train.seed)
        config = VictimConfig(preset.train.victim, preset.env.doomnav.frame_size,
                              num_actions(preset.env))
        self.victim = create_victim(config).eval()
        self.optimiser = torch.optim.Adam(self.victim.parameters(), lr=preset.train.lr, eps=1e-5)
        self.update, self.env_steps, self.history = 0, 0, []
        if resume and (self.out / TRAINER_META).exists():
            self._load()
        elif (self.out / TRAINER_META).exists():
            raise ConfigError(f"{self.out} already holds a training run: pass --resume to continue "
                              "it or choose another --out")

    def run(self, progress: bool = True) -> list[UpdateStats]:
        train = self.preset.train
        scenes = scene_names(self.preset.env, "train")
        envs = [make_env(self.preset.env, scenes, train.max_episode_steps)
                for _ in range(train.num_envs)]
        runner = VectorRunner(envs, seed=train.seed * 100_003 + self.update * 1_009)
        bar = tqdm(total=train.updates, initial=self.update, disable=not progress,
                   desc=f"train {train.algo}", unit="update")
        try:
            while self.update < train.updates:
                stats = self._one_update(runner)
                self.history.append(stats)
                self._save()
                bar.update(1)
                bar.set_postfix(ret=f"{stats.mean_return:.2f}", succ=f"{stats.success_rate:.2f}")
        finally:
            bar.close()
            runner.close()
        return self.history

    def _one_update(self, runner: VectorRunner) -> UpdateStats:
        train, start = self.preset.train, time.perf_counter()
        rollout = runner.collect(self.victim, train.rollout_steps, self.generator)
        advantages = gae(rollout.rewards, rollout.values, rollout.next_values, rollout.continues,
                         train.gamma, train.lam)
        data = _flatten_rollout(rollout, advantages)
        losses = _optimise(self.victim, self.optimiser, data, self.preset, self.generator)
        refresh_batchnorm(self.victim, data["images"], data["goals"])
        self.update += 1
        self.env_steps += len(data["actions"])
        episodes = len(rollout.episode_returns)
        return UpdateStats(
            update=self.update, env_steps=self.env_steps, episodes=episodes,
            mean_return=float(np.mean(rollout.episode_returns)) if episodes else float("nan"),
            success_rate=float(np.mean(rollout.episode_successes)) if episodes else float("nan"),
            mean_length=float(np.mean(rollout.episode_lengths)) if episodes else float("nan"),
            steps_per_second=len(data["actions"]) / (time.perf_counter() - start), **losses)

    # -- persistence ---------------------------------------------------------------------------
    def _save(self) -> None:
        save_victim(self.out, self.victim, {"algorithm": self.preset.train.algo,
                                            "update": self.update, "env_steps": self.env_steps,
                                            "preset": self.preset.to_dict()})
        state = self.optimiser.state_dict()
        tensors = {f"optimiser.{index}.{key}": value
                   for index, slots in state["state"].items() for key, value in slots.items()}
        tensors["generator"] = self.generator.get_state()
        save_tensors(self.out / TRAINER_STATE, tensors)
        write_json(self.out / TRAINER_META, {
            "update": self.update, "env_steps": self.env_steps,
            "param_groups": state["param_groups"], "preset": self.preset.to_dict(),
            "history": [asdict(h) for h in self.history]})
        write_learning_curve(self.out, self.history)

    def _load(self) -> None:
        meta = read_json(self.out / TRAINER_META, "trainer state")
        if meta.get("preset", {}).get("train", {}).get("victim") != self.preset.train.victim:
            raise ConfigError(f"{self.out / TRAINER_META} was written for victim "
                              f"{meta.get('preset', {}).get('train', {}).get('victim')!r}, not "
                              f"{self.preset.train.victim!r}")
        victim, _ = load_victim(self.out)
        self.victim.load_state_dict(victim.state_dict())
        tensors = load_tensors(self.out / TRAINER_STATE, "trainer state")
        slots: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith("optimiser."):
                _, index, name = key.split(".", 2)
                slots.setdefault(int(index), {})[name] = value
        self.optimiser.load_state_dict({"state": slots, "param_groups": meta["param_groups"]})
        self.generator.set_state(tensors["generator"])
        self.update, self.env_steps = int(meta["update"]), int(meta["env_steps"])
        self.history = [UpdateStats(**h) for h in meta.get("history", [])]


def write_learning_curve(out: Path, history: list[UpdateStats]) -> None:
    buffer = io.StringIO()
    fields = list(UpdateStats.__dataclass_fields__)
    writer = csv.DictWriter(buffer, fieldnames=fields)
    writer.writeheader()
    for stats in history:
        writer.writerow({k: (round(v, 6) if isinstance(v, float) else v)
                         for k, v in asdict(stats).items()})
    with atomic_path(out / CURVE_CSV) as tmp:
        tmp.write_text(buffer.getvalue())
    from gradleak.report.plots import plot_learning_curve  # matplotlib is slow to import

    plot_learning_curve(history, out / CURVE_PNG)


def train_victim(preset: TrainingSetup, out: Path, resume: bool = False, progress: bool = True
                 ) -> dict[str, Any]:
    preset.validate()
    check_output(out, "--out", directory=True)
    with run_directory(out, keep=lambda d: (d / TRAINER_META).is_file()):
        trainer = VictimTrainer(preset, out, resume)
        history = trainer.run(progress)
    tail = [h for h in history[-max(1, len(history) // 5):] if h.episodes]
    return {"out": str(out), "updates": trainer.update, "env_steps": trainer.env_steps,
            "final_success_rate": float(np.mean([h.success_rate for h in tail])) if tail
            else float("nan"),
            "final_mean_return": float(np.mean([h.mean_return for h in tail])) if tail
            else float("nan")}
