"""A feasibility probe for issue 18's learned prior: a residual refiner on the training-free frames.

The attacker knows θ0, the architecture and the client's loss, so it can capture its own steps on
training scenes (`gradleak capture --split train` against the same θ0) and run the training-free
attack on them: pairs (its frame, the true frame) that need no victim data. A small residual
U-Net (x̂ ↦ clamp(x̂ + f(x̂))) trained on those pairs for a few CPU-minutes then refines the
held-out frames. It only fills what the equations leave free if it learns where that is; it is
scored on the same 16 held-out steps as `benchmarks/exact_frames.py`. The network lives here, not
in `src/`, until it earns its place (see docs/design.md, "A learned prior").
Writes benchmarks/results/exact_refiner.{json,md}.

    python benchmarks/exact_refiner.py [--work runs/exact-frames] [--train-steps 384]
        [--steps 1200] [--frames 16]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gradleak.attacks.exact import ExactAttack
from gradleak.capture.plan import CaptureJob
from gradleak.capture.reader import CaptureFile
from gradleak.capture.run import run_capture
from gradleak.io import atomic_path, load_tensors, save_tensors
from gradleak.metrics.images import psnr, ssim
from gradleak.metrics.lpips import installed_lpips
from gradleak.presets import load_preset
from gradleak.report.tables import markdown_table

RESULTS = Path(__file__).parent / "results" / "exact_refiner.json"
HELDOUT = "cnn-84x84-random-float32.h5"  # benchmarks/exact_frames.py's capture (seed 11)
VALIDATION = 64  # the attacker's own first frames, held back to watch the fit


class Refiner(nn.Module):
    """Two scales, a skip, and a residual output: it starts as the identity's neighbour."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fine = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1), nn.GELU(),
                                  nn.Conv2d(width, width, 3, 1, 1), nn.GELU())
        self.coarse = nn.Sequential(nn.Conv2d(width, 2 * width, 3, 2, 1), nn.GELU(),
                                    nn.Conv2d(2 * width, 2 * width, 3, 1, 1), nn.GELU())
        self.up = nn.ConvTranspose2d(2 * width, width, 2, 2)
        self.out = nn.Sequential(nn.Conv2d(2 * width, width, 3, 1, 1), nn.GELU(),
                                 nn.Conv2d(width, 3, 3, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fine = self.fine(x)
        up = self.up(self.coarse(fine))[..., :fine.shape[-2], :fine.shape[-1]]
        return (x + self.out(torch.cat([fine, up], 1))).clamp(0, 1)


def unit(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0


def exact_pairs(path: Path, rows: np.ndarray | None, cache: Path) -> tuple[torch.Tensor, ...]:
    """(the training-free frames, the true frames) of `rows`, cached as safetensors."""
    if cache.exists():
        pair = load_tensors(cache, "exact frames")
        return pair["exact"], pair["truth"], pair["seconds_per_frame"]
    with CaptureFile(path) as capture:
        index = slice(None) if rows is None else rows
        observation, target = capture.observation(index), capture.target(index)
    start = time.perf_counter()
    frames = ExactAttack(observation).reconstruct().images
    seconds = torch.tensor((time.perf_counter() - start) / len(frames))
    pair = {"exact": unit(frames), "truth": unit(target.images), "seconds_per_frame": seconds}
    save_tensors(cache, pair)
    return pair["exact"], pair["truth"], seconds


def scores(frames: torch.Tensor, truth: torch.Tensor) -> dict[str, float]:
    out = {"psnr": float(psnr(frames, truth).mean()), "ssim": float(ssim(frames, truth).mean())}
    metric = installed_lpips()
    if metric is not None:
        with torch.no_grad():
            out["lpips"] = float(metric(frames, truth).mean())
    return out


def fit(exact: torch.Tensor, truth: torch.Tensor, steps: int, seed: int
        ) -> tuple[Refiner, list[dict[str, float]]]:
    """A fixed number of seeded steps (not a time budget: the result must not depend on how
    busy the machine was)."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = Refiner()
    optimiser = torch.optim.AdamW(model.parameters(), 1e-3)
    held = slice(0, VALIDATION)
    curve = []
    for step in range(steps):
        rows = torch.randint(VALIDATION, len(exact), (16,), generator=generator)
        x, y = exact[rows], truth[rows]
        if step % 2:  # a mirrored corridor is still a corridor
            x, y = x.flip(-1), y.flip(-1)
        guess = model(x)
        loss = F.mse_loss(guess, y) + 0.1 * (guess - y).abs().mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if (step + 1) % 200 == 0:
            with torch.no_grad():
                curve.append({"step": step + 1, "validation_psnr": float(
                    psnr(model(exact[held]), truth[held]).mean())})
    return model.eval(), curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, default=Path("runs/exact-frames"))
    parser.add_argument("--train-steps", type=int, default=384)
    parser.add_argument("--steps", type=int, default=1200, help="refiner optimiser steps "
                        "(batches of 16; about 6 minutes on 2 cores)")
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    heldout = args.work / HELDOUT
    if not heldout.exists():
        raise SystemExit(f"{heldout} is missing: run benchmarks/exact_frames.py first")
    train = args.work / f"attacker-train-{args.train_steps}.h5"
    if not train.exists():  # the attacker's own steps on training scenes, at the same θ0
        run_capture(CaptureJob(victim="cnn", random_init=True, split="train",
                               steps=args.train_steps, out=train, preset=load_preset("paper"),
                               progress=False, seed=11))
    own, own_truth, _ = exact_pairs(train, None, train.with_suffix(".exact.safetensors"))
    with CaptureFile(heldout) as capture:
        rows = np.linspace(0, len(capture) - 1, args.frames).astype(int)
    frames, truth, seconds = exact_pairs(heldout, rows,
                                         heldout.with_suffix(f".exact{args.frames}.safetensors"))
    start = time.perf_counter()
    model, curve = fit(own, own_truth, args.steps, args.seed)
    with torch.no_grad():
        refined = model(frames)
    result = {"benchmark": "exact_refiner", "victim": "cnn 84×84, random init",
              "held_out_frames": args.frames, "attacker_frames": len(own),
              "validation_frames": VALIDATION, "fit_steps": args.steps,
              "fit_minutes": (time.perf_counter() - start) / 60,
              "parameters": sum(p.numel() for p in model.parameters()),
              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch "
                         f"{torch.__version__}, no GPU",
              "exact": {**scores(frames, truth), "ms_per_frame": 1000 * float(seconds)},
              "refined": scores(refined, truth), "curve": curve}
    print(json.dumps(result, indent=2))
    with atomic_path(args.results) as temporary:
        temporary.write_text(json.dumps(result, indent=2) + "\n")
    table = [{"frames": name, **{k: f"{v:.3f}" if k != "psnr" else f"{v:.2f}"
                                 for k, v in result[name].items() if k != "ms_per_frame"}}
             for name in ("exact", "refined")]
    with atomic_path(args.results.with_suffix(".md")) as temporary:
        temporary.write_text(
            "# A residual refiner on the training-free frames (`benchmarks/exact_refiner.py`)\n\n"
            f"{result['victim']}, {args.frames} held-out steps; the refiner "
            f"({result['parameters']:,} parameters) fitted {args.steps} steps of 16 "
            f"({result['fit_minutes']:.1f} min) on the "
            f"attacker's own {len(own) - VALIDATION} training-scene frames (exact attack on its "
            f"own capture at the same θ0); {result['machine']}.\n\n"
            + markdown_table(table, list(table[0])) + "\n")


if __name__ == "__main__":
    main()
