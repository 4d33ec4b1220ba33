"""The one training loop every learned attacker runs, top to bottom in `FitLoop.run`.

A kind of attacker (TRACE and LtI in `fit.py`, the feature decoder in `decoder_fit.py`) says
only what differs: the batches of an epoch, the loss of a batch, its validation and what its
checkpoint records beside the shared fields. The loop owns everything else, the same way for
all of them: the resume guard, the time budget (read before each epoch and after every
optimiser step), gradient accumulation and clipping, the warm-up-then-cosine schedule, the
epoch record, TensorBoard scalars, a resumable checkpoint every epoch with the best weights by
validation loss kept apart, and the summary a command prints.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from gradleak.errors import ConfigError
from gradleak.io import check_output, read_json, run_directory
from gradleak.training.checkpoint import (
    META,
    check_finite_loss,
    fingerprint_to_dict,
    load_attacker,
    resume_run,
    save_attacker,
    save_training_state,
)


@dataclass
class FitSchedule:
    """What every learned attacker's fit shares: the optimiser schedule, the budget, the
    validation split, the defense it trains under (an adaptive attacker) and the seed."""

    epochs: int = 50
    batch_size: int = 8
    accumulation: int = 1  # batches per optimiser step
    lr: float = 1e-4
    weight_decay: float = 1e-5
    warmup_epochs: float = 5.0
    min_lr: float = 1e-6
    grad_clip: float = 1.0
    validate_every: int = 1  # epochs (the last epoch is always validated)
    val_fraction: float = 0.05  # validation episodes of the training captures
    # stop at the optimiser step that passes it (a TRACE-dense epoch is 35 CPU-minutes: stopping at
    # the epoch's end would give equal limits unequal compute); the epoch is saved as partial
    time_limit_minutes: float | None = None
    time_limit_clock: str = "wall"  # or "cpu": this process's CPU time, all its threads
    seed: int = 0
    defense: str = "none"  # train under this defense (an adaptive attacker), e.g. "quant:4"
    defense_seed: int = 1  # differs from evaluation's default 0: other noise draws
    skip_nonfinite: bool = False  # leave out windows with NaN/Inf gradients (else: refuse)


def warmup_cosine(config: FitSchedule, steps_per_epoch: int,
                  time_progress: Callable[[], float] = lambda: 0.0) -> Callable[[int], float]:
    """The learning-rate factor per optimiser step: linear warm-up, then cosine to min_lr.
    The cosine runs on whichever is further along, the steps or `time_progress()` (the
    fraction of a time limit spent): a time-limited run decays to its budget, not to an epoch
    count it never reaches."""
    warmup = max(1, int(config.warmup_epochs * steps_per_epoch))
    total = max(warmup + 1, config.epochs * steps_per_epoch)
    floor = config.min_lr / config.lr

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, max((step - warmup) / (total - warmup), time_progress()))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


CLOCKS = ("wall", "cpu")


class Budget:
    """A training time limit on the wall clock or on this process's CPU time. With other jobs on
    the same cores equal wall minutes are unequal compute; equal CPU minutes are not."""

    def __init__(self, minutes: float | None, clock: str) -> None:
        if clock not in CLOCKS:
            raise ConfigError(f"time_limit_clock {clock!r}: expected one of {', '.join(CLOCKS)}")
        self.minutes, self.clock = minutes, clock
        self.started = self.now()

    def now(self) -> float:
        """Seconds on this budget's clock (from an arbitrary origin)."""
        return time.process_time() if self.clock == "cpu" else time.perf_counter()

    def minutes_left(self) -> float:
        return math.inf if self.minutes is None else \
            self.minutes - (self.now() - self.started) / 60

    def spent(self) -> bool:
        return self.minutes_left() <= 0

    def fraction_spent(self) -> float:
        """0 → 1 across the limit (0 without one)."""
        if self.minutes is None:
            return 0.0
        return min(1.0, (self.now() - self.started) / 60 / self.minutes)


@dataclass
class Epoch:
    """One epoch as its kind lays it out: the batches, how many, and its settings (recorded)."""

    batches: Iterable[Any]
    steps: int
    settings: dict[str, float] = field(default_factory=dict)


def refuse_overwrite(out: Path, resume: bool) -> None:
    if (out / META).exists() and not resume:
        raise ConfigError(f"{out} already holds an attacker: pass --resume to continue it or "
                          "choose another --out")


class FitLoop:
    """One training run of one attacker in one run directory. A subclass sets `kind`, `config`,
    `out`, `model`, `model_config`, `optimiser`, `scheduler`, `fingerprint`, `train_files`
    and `mean_image` (or restores them with `start(resume=True)`), and lays out its epochs."""

    kind: str
    config: FitSchedule
    out: Path
    model: nn.Module
    model_config: Any
    optimiser: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    fingerprint: Any
    train_files: list[str]
    mean_image: torch.Tensor | None = None
    summary_fields: tuple[str, ...] = ()  # what the summary copies from the checkpoint record
    progress: bool = True
    rank, world = 0, 1

    # -- what a kind provides ---------------------------------------------------------------------
    def prepare(self) -> None:
        """Before the first epoch of a fresh run: normalisers, fixed tensors, the mean image."""

    def epoch(self) -> Epoch:
        raise NotImplementedError

    def objective(self, batch: Any, settings: dict[str, float]) -> tuple[torch.Tensor, dict]:
        """(the loss to minimise, its named parts) for one batch."""
        raise NotImplementedError

    def validate(self, writer: Any) -> dict[str, float]:
        raise NotImplementedError

    def record_fields(self) -> dict[str, Any]:
        """What this kind's checkpoint records beside the shared fields."""
        return {}

    def saved(self) -> None:
        """After each checkpoint (rank 0)."""

    def out_of_time(self, budget: Budget) -> bool:
        return budget.spent()

    def time_progress(self) -> float:
        """How much of this session's time limit is spent (the schedule decays to it)."""
        budget = getattr(self, "_budget", None)
        return budget.fraction_spent() if budget is not None else 0.0

    # -- helpers for kinds that fit on frames ----------------------------------------------------
    def shuffled_epoch(self, count: int, batch: Callable[[np.ndarray, np.random.Generator], Any]
                       ) -> Epoch:
        """Batches over a seeded permutation of `count` items, one generator per epoch (which
        `batch` may draw from too, to mirror): the same epoch on a resumed run."""
        size, steps = self.config.batch_size, max(1, count // self.config.batch_size)
        generator = np.random.default_rng([self.config.seed, self.epochs_done])
        order = generator.permutation(count)
        return Epoch((batch(order[step * size:(step + 1) * size], generator)
                      for step in range(steps)), steps)

    def set_optimiser(self, parameters: Iterable[nn.Parameter], items: int) -> None:
        """AdamW with the warm-up-then-cosine schedule over epochs of `items` frames."""
        config = self.config
        self.optimiser = torch.optim.AdamW(parameters, lr=config.lr,
                                           weight_decay=config.weight_decay)
        steps = max(1, math.ceil(max(1, items // config.batch_size) / config.accumulation))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimiser, warmup_cosine(config, steps, self.time_progress))

    def set_mean_image(self, frames: np.ndarray) -> None:
        """The mean of uint8 (N, H, W, C) frames as the (C, H, W) reference image."""
        mean = frames.mean(axis=0, dtype=np.float64) / 255.0  # no float copy of the frames
        self.mean_image = torch.from_numpy(mean).permute(2, 0, 1).float()

    # -- the loop ---------------------------------------------------------------------------------
    def start(self, resume: bool) -> None:
        self.epochs_done, self.best, self.history = 0, math.inf, []
        if resume and (self.out / META).exists():
            self.epochs_done, self.best, self.history, self.mean_image = resume_run(
                self.out, self.kind, self.model, self.optimiser, self.scheduler,
                self.model_config.frame_size, self.fingerprint, asdict(self.model_config))
        else:
            self.prepare()

    def run(self, session_epochs: int | None = None) -> list[dict[str, Any]]:
        """Train up to the configured epochs, or `session_epochs` more in this session."""
        config = self.config
        last = config.epochs if session_epochs is None else min(
            config.epochs, self.epochs_done + session_epochs)
        budget = self._budget = Budget(config.time_limit_minutes, config.time_limit_clock)
        writer = self._tensorboard()
        try:
            while self.epochs_done < last and not self.out_of_time(budget):
                record = self.train_epoch(budget)
                if (self.epochs_done + 1) % config.validate_every == 0 or \
                        self.epochs_done + 1 == config.epochs:
                    record.update(self.validate(writer))
                self.epochs_done += 1
                self.history.append(record)
                if writer is not None:
                    for key, value in record.items():
                        writer.add_scalar(key, value, self.epochs_done)
                self.save(record)
                if record["time_limit_reached"]:
                    break
        finally:
            if writer is not None:
                writer.close()
        return self.history

    def train_epoch(self, budget: Budget) -> dict[str, Any]:
        """One pass over the epoch's batches, cut short at the optimiser step where the time
        limit is spent; the record says which fraction of the epoch ran."""
        config, start, cpu_start = self.config, time.perf_counter(), time.process_time()
        epoch = self.epoch()
        self.model.train()
        totals: dict[str, float] = {}
        batches = tqdm(epoch.batches, total=epoch.steps, disable=not self.progress, leave=False,
                       desc=f"{self.kind} epoch {self.epochs_done + 1}/{config.epochs}")
        done, stopped, waited = 0, False, 0.0
        fetched = time.perf_counter()
        for step, batch in enumerate(batches):
            waited += time.perf_counter() - fetched  # the loader's batch was not ready yet
            loss, parts = self.objective(batch, epoch.settings)
            check_finite_loss(loss, self.out, self.epochs_done, step)
            (loss / config.accumulation).backward()
            done = step + 1
            for key, value in {"loss": loss, **parts}.items():
                totals[key] = totals.get(key, 0.0) + float(value.detach())
            batches.set_postfix(loss=f"{float(loss.detach()):.4f}")
            if done % config.accumulation == 0 or done == epoch.steps:
                nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip)
                self.optimiser.step()
                self.scheduler.step()
                self.optimiser.zero_grad(set_to_none=True)
                stopped = self.out_of_time(budget)
                if stopped:
                    break
            fetched = time.perf_counter()
        batches.close()
        seconds = time.perf_counter() - start
        return {"epoch": self.epochs_done + 1, **epoch.settings,
                "lr": self.scheduler.get_last_lr()[0],
                "train_minutes": seconds / 60,
                # the share of the epoch spent waiting for the data loader (starved if large)
                "data_wait_fraction": waited / max(seconds, 1e-9),
                "train_cpu_minutes": (time.process_time() - cpu_start) / 60,
                "epoch_fraction": done / max(1, epoch.steps), "time_limit_reached": stopped,
                **{f"train_{k}": v / max(1, done) for k, v in totals.items()}}

    # -- persistence ------------------------------------------------------------------------------
    def _tensorboard(self) -> Any:
        if self.rank != 0:
            return None
        from torch.utils.tensorboard import SummaryWriter  # tensorboard is slow to import

        return SummaryWriter(str(self.out / "tensorboard"))

    def describe(self, record: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint record, less the optimiser state."""
        return {"kind": self.kind, "model": asdict(self.model_config),
                "fit": asdict(self.config), "epoch": self.epochs_done,
                "best_val_loss": self.best, "history": self.history,
                "fingerprint": fingerprint_to_dict(self.fingerprint),
                "train_files": self.train_files, **self.record_fields(), "last": record}

    def save(self, record: dict[str, Any], count_best: bool = True) -> None:
        if self.rank != 0:
            return
        val = record.get("val_loss", math.inf)
        improved = count_best and val < self.best
        self.best = min(self.best, val)
        meta = self.describe(record)
        meta["training_state"] = save_training_state(self.out, self.optimiser, self.scheduler)
        meta["mean_image"] = self.mean_image.flatten().tolist()
        save_attacker(self.out, self.model, meta,
                      best=improved or (count_best and self.epochs_done == 1))
        self.saved()

    def summary(self) -> dict[str, Any]:
        return summarise(self.out, self.model, self.describe(self.history[-1] if self.history
                                                             else {}), self.summary_fields)


def summarise(out: Path, model: nn.Module, meta: dict[str, Any], extra: Iterable[str]
              ) -> dict[str, Any]:
    """What a fit command prints, from its checkpoint record (a finished run's, read back, gives
    the same)."""
    history = meta["history"]
    return {"out": str(out), "kind": meta["kind"], "epochs": meta["epoch"],
            "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            **training_minutes(history), "last": history[-1] if history else {},
            **{key: meta[key] for key in extra}}


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


def run_fit(build: Callable[[], FitLoop], out: Path, epochs: int, resume: bool,
            summary_fields: tuple[str, ...]) -> dict[str, Any]:
    """Build a fit in its run directory and train it: a finished run (`--resume` at its last
    epoch) answers with its summary without reading a capture; a failed fresh run leaves no
    directory behind."""
    out = Path(out)
    if resume and (out / META).exists():
        meta = read_json(out / META, "attacker config")
        if int(meta.get("epoch", 0)) >= epochs:
            model, _ = load_attacker(out)
            return {**summarise(out, model, meta, summary_fields), "session_minutes": 0.0}
    check_output(out, "--out", directory=True)
    start = time.perf_counter()
    with run_directory(out, keep=lambda d: (d / META).is_file()):
        fit = build()
        fit.run()
    return {**fit.summary(), "session_minutes": (time.perf_counter() - start) / 60}
