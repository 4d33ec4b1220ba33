"""Fitting TRACE or LtI on auxiliary captures; one epoch reads top to bottom in `_epoch`.

AdamW with a linear warm-up then a cosine decay (per optimiser step), gradient accumulation,
gradient clipping, bf16 autocast on CUDA, a checkpoint every epoch (resumable), the best
weights by validation loss kept apart, TensorBoard scalars and sample grids. Runs unchanged
under `torchrun --nproc_per_node=N`: DistributedDataParallel over gloo (CPU) or NCCL (GPU),
with a distributed sampler; rank 0 writes everything.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Sampler
from tqdm import tqdm

from gradleak.defenses import parse_defense
from gradleak.errors import ConfigError
from gradleak.io import check_output, run_directory
from gradleak.metrics.images import psnr
from gradleak.registry import Registry
from gradleak.training.checkpoint import (
    META,
    build_model,
    check_finite_loss,
    fingerprint_from_dict,
    fingerprint_to_dict,
    load_attacker,
    resume_run,
    save_attacker,
    save_training_state,
)
from gradleak.training.data import WindowBatch, WindowDataset, collate
from gradleak.training.objectives import LossWeights, LtiObjective, Perceptual, TraceObjective


@dataclass(frozen=True)
class FitKind:
    """What a learned attacker's fit needs to know of its kind, in one registry entry."""

    objective: Callable[..., nn.Module]  # (model, weights, perceptual, rollout_steps)
    window: Callable[[Any], int]  # the steps one training window holds, from the model config
    strided: bool  # windows start every `stride` steps (else at every step)
    scheduled_sampling: bool  # teacher forcing annealed over epochs (a recurrent decoder)
    adaptive_windows: int  # windows per fine-tuning epoch under a defense


FIT_KINDS: Registry[FitKind] = Registry("learned attacker kind")
FIT_KINDS.register("trace")(FitKind(
    lambda model, weights, perceptual, rollout: TraceObjective(model, weights, perceptual,
                                                               rollout),
    window=lambda config: config.window, strided=True, scheduled_sampling=True,
    adaptive_windows=400))
FIT_KINDS.register("lti")(FitKind(
    lambda model, weights, perceptual, rollout: LtiObjective(model, weights, perceptual),
    window=lambda config: 1, strided=False, scheduled_sampling=False, adaptive_windows=4000))


@dataclass
class FitSchedule:
    """What every learned attacker's fit shares: the optimiser schedule, the budget, the
    validation split, the defense it trains under (an adaptive attacker) and the seed."""

    epochs: int = 50
    batch_size: int = 8
    lr: float = 1e-4
    weight_decay: float = 1e-5
    warmup_epochs: float = 5.0
    min_lr: float = 1e-6
    grad_clip: float = 1.0
    val_fraction: float = 0.05  # validation episodes of the training captures
    # stop at the optimiser step that passes it (a TRACE-dense epoch is 35 CPU-minutes: stopping at
    # the epoch's end would give equal limits unequal compute); the epoch is saved as partial
    time_limit_minutes: float | None = None
    time_limit_clock: str = "wall"  # or "cpu": this process's CPU time, all its threads
    seed: int = 0
    defense: str = "none"  # train under this defense (an adaptive attacker), e.g. "quant:4"
    defense_seed: int = 1  # differs from evaluation's default 0: other noise draws
    skip_nonfinite: bool = False  # leave out windows with NaN/Inf gradients (else: refuse)


@dataclass
class FitConfig(FitSchedule):
    """TRACE's and LtI's fit on gradient windows."""

    accumulation: int = 2
    teacher_forcing_epochs: int = 5  # τ
    beta_start: float = 0.1  # scheduled sampling after τ, rising linearly to beta_end
    beta_end: float = 0.8
    rollout_steps: int = 3
    weights: LossWeights = field(default_factory=LossWeights)
    stride: int = 2
    validate_every: int = 1
    max_train_windows: int | None = None  # per epoch; bounds CPU presets
    max_val_windows: int = 64
    normaliser_rows: int = 2048
    workers: int = 1
    lpips_weights: str | None = None
    init_from: str | None = None  # start from this attacker's weights (fine-tuning)


def scheduled_sampling_beta(config: FitConfig, epoch: int) -> float:
    """0 during teacher forcing (epochs < τ), then linear from beta_start to beta_end."""
    if epoch < config.teacher_forcing_epochs:
        return 0.0
    span = max(1, config.epochs - config.teacher_forcing_epochs - 1)
    progress = min(1.0, (epoch - config.teacher_forcing_epochs) / span)
    return config.beta_start + progress * (config.beta_end - config.beta_start)


def warmup_cosine(config: FitSchedule, steps_per_epoch: int) -> Callable[[int], float]:
    warmup = max(1, int(config.warmup_epochs * steps_per_epoch))
    total = max(warmup + 1, config.epochs * steps_per_epoch)
    floor = config.min_lr / config.lr

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / (total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class EpochSampler(Sampler[int]):
    """A seeded permutation per epoch, optionally cut short (CPU presets)."""

    def __init__(self, size: int, seed: int, limit: int | None) -> None:
        self.size, self.seed, self.limit, self.epoch = size, seed, limit, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.size)
        return iter(order[: self.limit].tolist())

    def __len__(self) -> int:
        return min(self.size, self.limit) if self.limit else self.size


def _distributed() -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return rank, world, device


CLOCKS = ("wall", "cpu")


class Budget:
    """A training time limit on the wall clock or on this process's CPU time. With other jobs on
    the same cores equal wall minutes are unequal compute; equal CPU minutes are not."""

    def __init__(self, minutes: float | None, clock: str) -> None:
        if clock not in CLOCKS:
            raise ConfigError(f"time_limit_clock {clock!r}: expected one of {', '.join(CLOCKS)}")
        self.minutes, self.clock = minutes, clock
        self.started = self._now()

    def _now(self) -> float:
        return time.process_time() if self.clock == "cpu" else time.perf_counter()

    def spent(self) -> bool:
        return self.minutes is not None and (self._now() - self.started) / 60 >= self.minutes


class AttackerFit:
    """One training run of one learned attacker, in one run directory."""

    def __init__(self, kind: str, model_config: Any, config: FitConfig, train_paths: list[str],
                 out: Path, resume: bool = False, progress: bool = True) -> None:
        self.fit_kind = FIT_KINDS.get(kind)
        self.kind, self.config, self.out = kind, config, Path(out)
        self.rank, self.world, self.device = _distributed()
        self.progress = progress and self.rank == 0
        if (self.out / META).exists() and not resume:
            raise ConfigError(f"{self.out} already holds an attacker: pass --resume to continue "
                              "it or choose another --out")
        window = self.fit_kind.window(model_config)
        common = dict(window=window, stride=config.stride if self.fit_kind.strided else 1,
                      val_fraction=config.val_fraction, seed=config.seed, expect_split="train",
                      defense=parse_defense(config.defense, config.defense_seed),
                      skip_nonfinite=config.skip_nonfinite)
        self.train_data = WindowDataset(train_paths, part="train", **common)
        self.val_data = WindowDataset(train_paths, part="val", **common)
        victim = self.train_data.fingerprint.victim
        self.model_config = replace(model_config, gradient_dim=self.train_data.gradient_dim,
                                    frame_size=victim.frame_size, num_actions=victim.num_actions)
        if hasattr(self.model_config, "layer_table"):  # the structured projection reads it
            self.model_config = replace(self.model_config,
                                        layer_table=self.train_data.fingerprint.layer_table)
        self.model = self._build_model().to(self.device)
        self.perceptual = Perceptual(config.lpips_weights).to(self.device)
        self.objective = self._objective()
        self.optimiser = torch.optim.AdamW(self.model.parameters(), lr=config.lr,
                                           weight_decay=config.weight_decay)
        self.sampler = self._sampler()
        self.loader = DataLoader(self.train_data, batch_size=config.batch_size,
                                 sampler=self.sampler, collate_fn=collate,
                                 num_workers=config.workers,
                                 persistent_workers=config.workers > 0)
        steps = max(1, math.ceil(len(self.loader) / config.accumulation))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimiser,
                                                           warmup_cosine(config, steps))
        self.epoch, self.best, self.history = 0, math.inf, []
        self.mean_image = None
        if resume and (self.out / META).exists():
            self._resume()
        else:
            self._prepare()
        self.engine = (DistributedDataParallel(self.objective) if self.world > 1
                       else self.objective)

    def _build_model(self) -> nn.Module:
        """A fresh model, or (init_from) a trained attacker's: same kind, victim and θ0."""
        torch.manual_seed(self.config.seed)
        source = self.config.init_from
        if not source:
            return build_model(self.kind, asdict(self.model_config))
        model, meta = load_attacker(source, best=True)
        if meta["kind"] != self.kind:
            raise ConfigError(f"init_from {source} is a {meta['kind']} attacker, not {self.kind}")
        fingerprint_from_dict(meta["fingerprint"]).check(self.train_data.fingerprint,
                                                         f"init_from {source}")
        known = {f.name for f in fields(self.model_config)}
        self.model_config = replace(self.model_config, **{k: v for k, v in meta["model"].items()
                                                          if k in known})
        if model.window != self.train_data.window:
            raise ConfigError(f"init_from {source} reads windows of {model.window} steps, this "
                              f"fit {self.train_data.window}")
        return model.train()

    def _objective(self) -> nn.Module:
        return self.fit_kind.objective(self.model, self.config.weights, self.perceptual,
                                       self.config.rollout_steps)

    def _sampler(self) -> Sampler[int]:
        if self.world > 1:
            return DistributedSampler(self.train_data, shuffle=True, seed=self.config.seed)
        return EpochSampler(len(self.train_data), self.config.seed, self.config.max_train_windows)

    def _prepare(self) -> None:
        """Normaliser statistics and the mean training image, from training windows only."""
        self.model.gradient_input.fit(self.train_data.gradient_rows(self.config.normaliser_rows,
                                                         self.config.seed))
        self.mean_image = self.train_data.mean_image(seed=self.config.seed)

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        writer = self._tensorboard()
        budget = Budget(self.config.time_limit_minutes, self.config.time_limit_clock)
        try:
            while self.epoch < self.config.epochs and not self._out_of_time(budget):
                record = self._epoch(self.epoch, budget)
                if (self.epoch + 1) % self.config.validate_every == 0 or \
                        self.epoch + 1 == self.config.epochs:
                    record.update(self._validate(writer))
                self.epoch += 1
                self.history.append(record)
                if writer is not None:
                    for key, value in record.items():
                        writer.add_scalar(key, value, self.epoch)
                self._save(record)
                if record["time_limit_reached"]:
                    break
        finally:
            if writer is not None:
                writer.close()
        if self.world > 1:
            self.history[-1]["replica_spread"] = self._replica_spread()
            self._save(self.history[-1], count_best=False)
        return self.history

    def _out_of_time(self, budget: Budget) -> bool:
        out = budget.spent()
        if self.world > 1:  # every rank must stop at the same epoch
            flag = torch.tensor([float(out)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            out = bool(flag.item())
        return out

    @torch.no_grad()
    def _replica_spread(self) -> float:
        """max |θ_rank − θ_other| over all ranks and parameters: 0 unless DDP desynchronised."""
        flat = torch.cat([p.detach().flatten().float() for p in self.model.parameters()])
        high, low = flat.clone(), flat.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        return float((high - low).max())

    def _epoch(self, epoch: int, budget: Budget) -> dict[str, Any]:
        """One pass over the sampled windows, cut short at the optimiser step where the time
        limit is spent; the record says which fraction of the epoch ran."""
        config, start, cpu_start = self.config, time.perf_counter(), time.process_time()
        beta = scheduled_sampling_beta(config, epoch) if self.fit_kind.scheduled_sampling \
            else 0.0
        self.sampler.set_epoch(epoch)
        self.model.train()
        totals: dict[str, float] = {}
        batches = tqdm(self.loader, disable=not self.progress, leave=False,
                       desc=f"{self.kind} epoch {epoch + 1}/{config.epochs}")
        done, stopped = 0, False
        for step, batch in enumerate(batches):
            loss, parts = self._forward(batch, beta)
            check_finite_loss(loss, self.out, epoch, step)
            (loss / config.accumulation).backward()
            done = step + 1
            for key, value in {"loss": loss, **parts}.items():
                totals[key] = totals.get(key, 0.0) + float(value.detach())
            batches.set_postfix(loss=f"{float(loss.detach()):.4f}")
            if done % config.accumulation == 0 or done == len(self.loader):
                nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip)
                self.optimiser.step()
                self.scheduler.step()
                self.optimiser.zero_grad(set_to_none=True)
                stopped = self._out_of_time(budget)
                if stopped:
                    break
        batches.close()
        count = max(1, done)
        return {"epoch": epoch + 1, "beta": beta, "lr": self.scheduler.get_last_lr()[0],
                "train_minutes": (time.perf_counter() - start) / 60,
                "train_cpu_minutes": (time.process_time() - cpu_start) / 60,
                "epoch_fraction": done / max(1, len(self.loader)), "time_limit_reached": stopped,
                **{f"train_{k}": v / count for k, v in totals.items()}}

    def _forward(self, batch: WindowBatch, beta: float) -> tuple[torch.Tensor, dict]:
        gradients = batch.observed.gradients.to(self.device)
        images, actions = batch.images.to(self.device), batch.actions.to(self.device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            return self.engine(gradients, images, actions, beta)

    @torch.no_grad()
    def _validate(self, writer: Any) -> dict[str, float]:
        """Teacher-forced validation loss, and PSNR of the attack itself (no ground truth in)."""
        self.model.eval()
        losses, scores, sample = [], [], None
        count = min(len(self.val_data), self.config.max_val_windows)
        for start in range(0, count, self.config.batch_size):
            batch = collate([self.val_data[i] for i in range(start, min(start + self.config
                                                                        .batch_size, count))])
            losses.append(float(self.objective(batch.observed.gradients.to(self.device),
                                               batch.images.to(self.device),
                                               batch.actions.to(self.device), 0.0)[0]))
            frames = self._attack(batch.observed.gradients.to(self.device))
            truth = batch.images.to(self.device)
            scores.append(psnr(frames.flatten(0, 1), truth.flatten(0, 1)).cpu())
            sample = sample if sample is not None else (truth[:4], frames[:4])
        if writer is not None and sample is not None:
            grid = torch.cat([sample[0].flatten(0, 1), sample[1].flatten(0, 1)])
            writer.add_images("validation/truth_then_reconstruction", grid, self.epoch + 1)
        return {"val_loss": float(np.mean(losses)), "val_psnr": float(torch.cat(scores).mean())}

    def _attack(self, gradients: torch.Tensor) -> torch.Tensor:
        return self.model.attack(gradients)[0]

    # -- persistence ------------------------------------------------------------------------------
    def _tensorboard(self) -> Any:
        if self.rank != 0:
            return None
        from torch.utils.tensorboard import SummaryWriter  # tensorboard is slow to import

        return SummaryWriter(str(self.out / "tensorboard"))

    def _meta(self, record: dict[str, Any]) -> dict[str, Any]:
        return {"kind": self.kind, "model": asdict(self.model_config),
                "fit": asdict(self.config), "epoch": self.epoch, "best_val_loss": self.best,
                "history": self.history, "perceptual": self.perceptual.name,
                "perceptual_note": self.perceptual.reason,
                "fingerprint": fingerprint_to_dict(self.train_data.fingerprint),
                "train_files": self.train_data.paths, "train_windows": len(self.train_data),
                "val_windows": len(self.val_data), "world_size": self.world,
                "skipped_nonfinite_rows": self.train_data.skipped_rows,
                "last": record}

    def _save(self, record: dict[str, Any], count_best: bool = True) -> None:
        if self.rank != 0:
            return
        val = record.get("val_loss", math.inf)
        improved = count_best and val < self.best
        self.best = min(self.best, val)
        meta = self._meta(record)
        meta["training_state"] = save_training_state(self.out, self.optimiser, self.scheduler)
        meta["mean_image"] = self.mean_image.flatten().tolist()
        save_attacker(self.out, self.model, meta, best=improved or (count_best and
                                                                     self.epoch == 1))

    def _resume(self) -> None:
        self.epoch, self.best, self.history, self.mean_image = resume_run(
            self.out, self.kind, self.model, self.optimiser, self.scheduler,
            self.model_config.frame_size,
            self.train_data.fingerprint, asdict(self.model_config))


def fit_attacker(kind: str, model_config: Any, config: FitConfig, train_paths: list[str],
                 out: Path, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    check_output(out, "--out", directory=True)
    with run_directory(out, keep=lambda d: (d / META).is_file()):
        fit = AttackerFit(kind, model_config, config, train_paths, out, resume, progress)
        start = time.perf_counter()
        history = fit.run()
    parameters = sum(p.numel() for p in fit.model.parameters())
    return {"out": str(out), "kind": kind, "epochs": fit.epoch, "parameters": parameters,
            **training_minutes(history, time.perf_counter() - start),
            "last": history[-1] if history else {},
            "perceptual": fit.perceptual.name,
            "skipped_nonfinite_rows": fit.train_data.skipped_rows}


def training_minutes(history: list[dict[str, Any]], session_seconds: float | None = None
                     ) -> dict[str, float]:
    """What every fit reports as its time: `minutes` and `cpu_minutes` sum the epochs' training
    time over every session of the run (resumed ones too), `session_minutes` this invocation's
    wall time."""
    out = {"minutes": sum(record.get("train_minutes", 0.0) for record in history),
           "cpu_minutes": sum(record.get("train_cpu_minutes", 0.0) for record in history)}
    if session_seconds is not None:
        out["session_minutes"] = session_seconds / 60
    return out


def fine_tune_under_defense(kind: str, model_config: Any, config: FitConfig, clean: Path,
                            spec: str, minutes: float, train_paths: list[str], out: Path,
                            clock: str = "wall", progress: bool = True) -> dict[str, Any]:
    """An adaptive attacker: the clean one at `clean`, fine-tuned for `minutes` on gradients
    under the defense `spec` (its own noise draws: defense_seed 1, evaluation uses 0). Short
    epochs with a third of the clean learning rate and no teacher-forcing phase, so the budget
    covers several of them. The architecture comes from `clean`; `model_config` only fills the
    fields it lacks."""
    config = replace(config, defense=spec, init_from=str(clean), epochs=max(1, round(minutes)),
                     max_train_windows=FIT_KINDS.get(kind).adaptive_windows, warmup_epochs=0.1,
                     teacher_forcing_epochs=0, lr=config.lr / 3, time_limit_minutes=minutes,
                     time_limit_clock=clock)
    return fit_attacker(kind, model_config, config, train_paths, out,
                        resume=(Path(out) / META).exists(), progress=progress)
