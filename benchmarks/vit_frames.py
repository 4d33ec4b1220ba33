"""The ViT's frames in closed form, from its patch embedding and learned position embedding.

Per victim (the paper's `vit-tiny` at 84×84 under the `paper` preset, `vit-tiny-small` at
64×64 under `cpu-quick`), random-init and trained briefly with PPO on DoomNav's training maps
(--updates), --steps held-out steps are captured (float32, the wire format) and every one is
attacked by the training-free attack (`exact`), which takes the patch-embedding route
(`attacks.patch_embedding`). Each row: PSNR / SSIM / LPIPS, the largest pixel error (of 255),
action accuracy, the rank of Δ against its tokens, its condition number, ms per frame, beside
the mean of the held-out frames and each frame's own mean colour. The same attack on the same
steps under a few defenses the audit grids use (told nothing about them) says how much of the
exactness survives. Two ViTs whose Δ cannot have full rank (more tokens than the width − 1) say
what the frame keeps then: the minimum-norm solve beside the smoothest frame that fits. Writes
benchmarks/results/vit_frames.{json,md,png}; the PNG shows each capture's first six frames
(which the undefended attack returns pixel for pixel) and the attack's frames under
cast:bfloat16 and noise:1e-4.

    python benchmarks/vit_frames.py [--work runs/vit-frames] [--updates 6] [--steps 64]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gradleak.attacks.exact import ExactAttack
from gradleak.attacks.patch_embedding import find_patch_embedding, solve_patches
from gradleak.capture.grads import StepBatch, per_step_gradients
from gradleak.capture.reader import CaptureFile
from gradleak.capture.run import CaptureJob, run_capture
from gradleak.defenses.base import row_keys
from gradleak.io import atomic_path
from gradleak.presets import load_preset
from gradleak.report.tables import fixed, markdown_table
from gradleak.rl.losses import LossCoefficients
from gradleak.rl.trainer import train_victim
from gradleak.threat import Observation
from gradleak.victims import VictimConfig, layer_table
from gradleak.victims.vit import SmallViT

from defense_aware import defended, plot, references, scores
from host import machine

RESULTS = Path(__file__).parent / "results" / "vit_frames.json"
DEFENSES = "cast:float16;cast:bfloat16;noise:1e-05;noise:0.0001;prune:0.5"
PICTURED = ("cast:bfloat16", "noise:0.0001")  # the defenses whose frames the PNG shows


@dataclass(frozen=True)
class Case:
    victim: str
    preset: str
    size: int
    trained: bool

    @property
    def name(self) -> str:
        return f"{self.victim} {self.size}×{self.size}, {'PPO' if self.trained else 'random init'}"

    @property
    def slug(self) -> str:
        return f"{self.victim}-{self.size}-{'ppo' if self.trained else 'random'}"


class SquareGrid(SmallViT):
    """8×8 patches of a 64×64 frame and a width of 64: 64 tokens, Δ's rank at most 63."""

    patch, dim, mlp = 8, 64, 128


class WideGrid(SmallViT):
    """8×8 patches and a width of 32: 64 tokens, Δ's rank at most 31."""

    patch, dim, mlp = 8, 32, 64


CASES = [Case("vit-tiny", "paper", 84, False), Case("vit-tiny", "paper", 84, True),
         Case("vit-tiny-small", "cpu-quick", 64, False),
         Case("vit-tiny-small", "cpu-quick", 64, True)]


def capture(case: Case, work: Path, updates: int, steps: int) -> tuple[Path, dict[str, Any]]:
    preset = load_preset(case.preset, [f"train.victim={case.victim}", f"train.updates={updates}",
                                       "capture.gradient_dtype=float32"])
    training: dict[str, Any] = {}
    victim = case.victim
    if case.trained:
        out = work / f"{case.victim}-{case.size}-victim"
        summary = train_victim(preset, out, resume=out.exists(), progress=False)
        training = {"updates": summary["updates"], "env_steps": summary["env_steps"]}
        victim = str(out)
    path = work / f"{case.slug}.h5"
    if not path.exists():
        run_capture(CaptureJob(victim=victim, random_init=not case.trained, split="heldout",
                               steps=steps, out=path, preset=preset, progress=False, seed=11))
    return path, training


def attack(observation: Any, actions: np.ndarray, truth: np.ndarray
           ) -> tuple[dict[str, Any], np.ndarray]:
    start = time.perf_counter()
    result = ExactAttack(observation).reconstruct()
    seconds = time.perf_counter() - start
    diagnostics = result.extras["residuals"]
    return {**scores(result.images, truth),
            "max_pixel_error": int(np.abs(result.images.astype(int) - truth.astype(int)).max()),
            "action_accuracy": float((result.actions == actions).mean()),
            "route": result.extras["route"],
            "rank_min": int(diagnostics["rank"].min()), "tokens": int(diagnostics["tokens"][0]),
            "condition_median": float(np.median(diagnostics["condition"])),
            "condition_max": float(diagnostics["condition"].max()),
            "ms_per_frame": 1e3 * seconds / len(truth)}, result.images


def run_case(path: Path, defenses: list[str]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    with CaptureFile(path) as file:
        rows = np.arange(file.num_rows)
        clean, target = file.observation(rows), file.target(rows)
        keys = row_keys(dict(file.attrs), 0, file.num_rows)
    truth = target.images
    result: dict[str, Any] = {"capture": str(path), "steps": len(rows),
                              "references": references(path, rows, truth), "defenses": {}}
    shown = {}
    for spec in ["none", *defenses]:
        observation, cosine, _ = defended(clean, keys, spec)
        row, images = attack(observation, target.actions, truth)
        result["defenses"][spec] = {"update_cosine": cosine, **row}
        if spec == "none":  # the undefended frames are the truth, pixel for pixel
            shown = {"ground truth (= undefended)": truth[:6]}
        elif spec in PICTURED:
            shown[spec] = images[:6]
        print(f"{path.name} {spec}: cos {cosine:.4f} psnr {row['psnr']:.2f} "
              f"max error {row['max_pixel_error']}", flush=True)
    return result, shown


def rank_deficient(path: Path, count: int = 16) -> dict[str, Any]:
    """ViTs whose Δ cannot have full rank (random init, unregistered), on the first `count`
    frames of a capture with its actions, A and R: the minimum-norm frame beside the smoothest
    of those that fit, and the mean of those frames."""
    with CaptureFile(path) as file:
        target = file.target(np.arange(count))
    images = torch.from_numpy(target.images)
    truth = target.images
    mean = np.broadcast_to(truth.astype(np.float64).mean(0).round().astype(np.uint8), truth.shape)
    out: dict[str, Any] = {"frames": count, "mean image": scores(np.ascontiguousarray(mean),
                                                                  truth)}
    for variant in (SquareGrid, WideGrid):
        torch.manual_seed(0)
        victim = variant(VictimConfig("vit-tiny-small")).eval()
        coefficients = LossCoefficients()
        with torch.no_grad():
            logits = victim(images)[0]
        actions = torch.from_numpy(target.actions)
        batch = StepBatch(images, actions, torch.from_numpy(target.advantages).float(),
                          torch.from_numpy(target.returns).float(),
                          torch.log_softmax(logits, -1).gather(-1, actions[:, None])[:, 0])
        layers = layer_table(victim)
        observation = Observation(
            gradients=per_step_gradients(victim, batch, coefficients, layers).numpy(),
            layers=tuple(layers), victim=victim.config,
            hyperparameters={"algorithm": "ppo", **coefficients.to_dict()},
            episode_ids=np.zeros(count, np.int64), step_in_episode=np.arange(count),
            theta0={k: v.numpy() for k, v in victim.state_dict().items()})
        embedding = find_patch_embedding(victim)
        row: dict[str, Any] = {}
        for label, smoothest in (("minimum norm", False), ("smoothest", True)):
            solved = solve_patches(observation, embedding, smoothest)
            frames = observation.roles.transform.invert(solved.inputs).clamp(0, 255).round()
            row[label] = scores(frames.to(torch.uint8).numpy(), truth)
        row.update(rank=int(solved.rank.max()), tokens=solved.tokens, width=victim.dim)
        out[variant.__name__] = row
    return out


def markdown(results: dict[str, Any]) -> str:
    parts = [f"# The ViT's frames from its patch embedding, training-free ({results['machine']})"
             "\n", f"Every one of {results['steps']} held-out steps per victim (float32 wire). "
             "PSNR (dB) / SSIM / LPIPS (lower is closer), the largest pixel error (of 255), "
             "action accuracy, rank of Δ (the position embedding's gradient over the patch "
             "tokens) against its tokens, its condition number (median / max), ms per frame. "
             "Defenses: the same attack told nothing of them.\n"]
    for name, case in results["victims"].items():
        refs = case["references"]
        training = case.get("training") or {}
        parts.append(f"## {name}\n\n" + (
            f"Trained {training['updates']} PPO updates ({training['env_steps']:,} steps). "
            if training else "") + "References: " + "; ".join(
            f"{ref} {r['psnr']:.2f} / {r['ssim']:.3f} / {fixed(r.get('lpips'), 3)}"
            for ref, r in refs.items()) + ".\n")
        table = [{"defense": spec, "update cosine": f"{row['update_cosine']:.6f}",
                  "frames": f"{row['psnr']:.2f} / {row['ssim']:.4f} / "
                            f"{fixed(row.get('lpips'), 4)}",
                  "max pixel error": row["max_pixel_error"],
                  "actions": f"{row['action_accuracy']:.2f}",
                  "rank / tokens": f"{row['rank_min']} / {row['tokens']}",
                  "condition": f"{row['condition_median']:.0f} / {row['condition_max']:.0f}",
                  "ms / frame": f"{row['ms_per_frame']:.1f}"}
                 for spec, row in case["defenses"].items()]
        parts.append(markdown_table(table, list(table[0])) + "\n")
    short = results.get("rank_deficient")
    if short:
        parts.append(f"## When Δ cannot have full rank\n\nEvery δ_t leaves a LayerNorm's backward "
                     "and sums to 0 over the width, so Δ's rank is at most the width − 1. Two "
                     "random-init ViTs (unregistered) with more tokens than that, on the first "
                     f"{short['frames']} frames of {results['rank_deficient_capture']} (their "
                     f"actions, A and R): PSNR / SSIM / LPIPS. Mean of those frames "
                     f"{short['mean image']['psnr']:.2f} / {short['mean image']['ssim']:.3f} / "
                     f"{fixed(short['mean image'].get('lpips'), 3)}.\n")
        table = [{"variant": name, "tokens / width / rank":
                  f"{row['tokens']} / {row['width']} / {row['rank']}",
                  **{label: f"{row[label]['psnr']:.2f} / {row[label]['ssim']:.3f} / "
                            f"{fixed(row[label].get('lpips'), 3)}"
                     for label in ("minimum norm", "smoothest")}}
                 for name, row in short.items() if isinstance(row, dict) and "rank" in row]
        parts.append(markdown_table(table, list(table[0])) + "\n")
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, default=Path("runs/vit-frames"))
    parser.add_argument("--updates", type=int, default=6)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--defenses", default=DEFENSES)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"machine": machine(), "steps": args.steps, "victims": {}}
    shown: dict[str, np.ndarray] = {}
    for case in CASES:
        path, training = capture(case, args.work, args.updates, args.steps)
        row, pictures = run_case(path, [d for d in args.defenses.split(";") if d])
        results["victims"][case.name] = {"training": training, **row}
        shown.update({f"{case.name}: {label}": images for label, images in pictures.items()})
    small = args.work / f"{CASES[-1].slug}.h5"
    results["rank_deficient_capture"] = small.name
    results["rank_deficient"] = rank_deficient(small)
    with atomic_path(args.results) as temporary:
        temporary.write_text(json.dumps(results, indent=2) + "\n")
    with atomic_path(args.results.with_suffix(".md")) as temporary:
        temporary.write_text(markdown(results))
    plot(shown, args.results.with_suffix(".png"))


if __name__ == "__main__":
    main()
