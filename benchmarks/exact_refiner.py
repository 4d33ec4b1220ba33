"""The training-free attack's learned prior (`gradleak train-prior`), measured on held-out maps.

For the paper's cnn at 84×84, random-init and trained with PPO or A2C, the attacker captures its own
--train-steps steps on training scenes against the victim's θ0 (it knows θ0 and the client's
loss), fits the prior on the training-free attack's frames of them (`training.refiner_fit`,
resumable), and attacks --frames evenly spaced steps of `benchmarks/exact_frames.py`'s
held-out capture (made here, identically, when it is missing): the attack alone, with the
prior, and with the prior but without projecting its guess back onto the equations; beside the
frames' own mean image. Writes benchmarks/results/exact_refiner.{json,md}; about 30 minutes
per victim on 2 cores.

    python benchmarks/exact_refiner.py [--work runs/exact-frames] [--train-steps 768]
        [--epochs 30] [--frames 16] [--ppo-cnn runs/victims/cnn84-ppo]
        [--a2c-cnn runs/victims/cnn84-a2c] [--only "cnn 84×84, A2C"]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradleak.attacks.exact import ExactConfig
from gradleak.attacks.frame_refiner import RefinerConfig
from gradleak.capture.plan import CaptureJob
from gradleak.capture.reader import CaptureFile
from gradleak.capture.run import run_capture
from gradleak.evaluation.analytic import image_scores
from gradleak.io import atomic_path
from gradleak.metrics.images import to_unit_tensor
from gradleak.presets import load_preset
from gradleak.report.tables import markdown_table
from gradleak.training.refiner_fit import RefinerFitConfig, exact_attack, fit_refiner

from host import machine
import exact_frames  # the sibling benchmark: its victims and held-out captures
from readme_results import solve_label  # the README's label of the same rows
from exact_frames import Case

RESULTS = Path(__file__).parent / "results" / "exact_refiner.json"


def all_cases(args: argparse.Namespace) -> list[Case]:
    """exact_frames.py's cnn 84×84 victims, whose held-out captures are scored here."""
    return [*exact_frames.paper_cases(args.ppo_cnn),
            Case("cnn 84×84, A2C", str(args.a2c_cnn), "paper", False)]


def cases(args: argparse.Namespace) -> list[Case]:
    return [case for case in all_cases(args) if not args.only or case.name in args.only]


def own_capture(victim: str, random_init: bool, steps: int, work: Path) -> Path:
    """The attacker's own steps on training scenes at the victim's θ0 (exact_frames.py's seed,
    so a random-init θ0 is the held-out capture's)."""
    tag = "random" if random_init else Path(victim).name
    out = work / f"attacker-train-{tag}-{steps}.h5"
    if not out.exists():
        preset = load_preset("paper")
        preset.capture.gradient_dtype = "float32"
        run_capture(CaptureJob(victim=victim, random_init=random_init, split="train",
                               steps=steps, out=out, preset=preset, progress=False, seed=11))
    return out


def attacked(path: Path, frames: int, config: ExactConfig) -> tuple[np.ndarray, float]:
    """Frames of `frames` evenly spaced steps, and the seconds per frame."""
    with CaptureFile(path) as capture:
        rows = np.linspace(0, len(capture) - 1, frames).astype(int)
        observation = capture.observation(rows)
    start = time.perf_counter()
    images = exact_attack(observation, config).reconstruct().images
    return images, (time.perf_counter() - start) / frames


def measure(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """The attack alone, with the prior and without its projection, on the held-out capture
    (exact_frames.py's, made here when it is missing: same seed, same file)."""
    heldout = exact_frames.capture(case, "float32", args.steps, args.work)
    train = own_capture(case.victim, case.random_init, args.train_steps, args.work)
    prior = args.work / f"prior-{train.stem}"
    fit = fit_refiner(RefinerConfig(), RefinerFitConfig(epochs=args.epochs, seed=args.seed),
                      ExactConfig(), [str(train)], prior, resume=True, progress=True)
    with CaptureFile(heldout) as capture:
        rows = np.linspace(0, len(capture) - 1, args.frames).astype(int)
        truth = to_unit_tensor(capture.target(rows).images)
    row: dict[str, Any] = {"victim": case.name, "chroma": ExactConfig().solve.chroma,
                           "colour_power": ExactConfig().solve.colour_power,
                           "attacker_frames": fit["train_frames"],
                           "fit_minutes": fit["minutes"], "parameters": fit["parameters"],
                           "validation": fit["last"]}
    settings = {"exact": ExactConfig(),
                "exact + prior": ExactConfig(prior=str(prior)),
                "exact + prior, unprojected": ExactConfig(prior=str(prior), prior_projection=0)}
    for method, config in settings.items():
        images, seconds = attacked(heldout, args.frames, config)
        row[method] = {**image_scores(to_unit_tensor(images), truth),
                       "ms_per_frame": 1000 * seconds}
    mean = truth.mean(0, keepdim=True).expand_as(truth)
    row["mean image"] = image_scores(mean, truth)
    print(json.dumps(row), flush=True)
    return row


def markdown(result: dict[str, Any]) -> str:
    methods = ("exact", "exact + prior", "exact + prior, unprojected", "mean image")
    table = [{"victim": row["victim"], "solve": solve_label(row),
              "frames": method,
              **{key: (f"{value:.2f}" if key in ("psnr", "ms_per_frame") else f"{value:.3f}")
                 for key, value in row[method].items()}}
             for row in result["rows"] for method in methods]
    fits = "; ".join(f"{row['victim']}: {row['attacker_frames']:,} frames, "
                     f"{row['fit_minutes']:.1f} min, validation (training scenes) "
                     f"{row['validation'].get('val_psnr_attack', float('nan')):.2f} → "
                     f"{row['validation'].get('val_psnr', float('nan')):.2f} dB"
                     for row in result["rows"])
    return ("# The training-free attack's learned prior (`benchmarks/exact_refiner.py`)\n\n"
            f"{result['frames']} evenly spaced held-out steps of `exact_frames.py`'s float32 "
            "captures, each solved from its own gradient (no two are neighbours, so none is "
            "solved with another that saw its frame); the prior "
            f"({result['rows'][0]['parameters']:,} parameters) fitted "
            f"{result['epochs']} epochs on the training-free attack's frames of the attacker's "
            f"own {result['train_steps']} training-scene steps at the same θ0 ({fits}); "
            "`exact + prior` projects the prior's guess back onto the equations (30 CG "
            "iterations), `unprojected` takes it as it is; ms per frame include the attack; "
            "`solve` is the frame solve's colour weighting the attack and the prior's training "
            "frames used: `FrameSolve.chroma`, and the power of the rounds' colour axes "
            "(`colour_power`; no `axes`: a row kept from a run before them, chroma 1: one "
            "from before the colour weight). "
            f"{result['machine']}.\n\n"
            + markdown_table(table, ["victim", "solve", "frames", "psnr", "ssim", "lpips",
                                     "ms_per_frame"]) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, default=Path("runs/exact-frames"))
    parser.add_argument("--train-steps", type=int, default=768)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ppo-cnn", type=Path, default=Path("runs/victims/cnn84-ppo"))
    parser.add_argument("--a2c-cnn", type=Path, default=Path("runs/victims/cnn84-a2c"))
    parser.add_argument("--steps", type=int, default=64,
                        help="held-out capture length (exact_frames.py's --steps)")
    parser.add_argument("--only", action="append", default=[],
                        help="one victim's row, keeping the other's from --results")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    chosen = checked_cases(parser, args)
    rows = [measure(case, args) for case in chosen]
    if args.only and args.results.exists():  # keep the other victim's row
        earlier = json.loads(args.results.read_text())["rows"]
        kept = {row["victim"]: row for row in earlier}
        kept.update({row["victim"]: row for row in rows})
        rows = [kept[case.name] for case in all_cases(args) if case.name in kept]
    write({"benchmark": "exact_refiner", "frames": args.frames, "steps": args.steps,
           "train_steps": args.train_steps, "epochs": args.epochs, "machine": machine(),
           "rows": rows}, args.results, markdown)


def checked_cases(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Case]:
    """The victims --only names (all by default), each trained checkpoint present, and the
    results folder there, checked before any work."""
    if not args.results.parent.is_dir():
        parser.error(f"--results {args.results}: its folder does not exist")
    chosen = cases(args)
    if not chosen:
        parser.error("--only: the victims are "
                     + "; ".join(case.name for case in all_cases(args)))
    for case in chosen:
        if not case.random_init and not Path(case.victim).is_dir():
            parser.error(f"{case.name}: {case.victim} is not a victim checkpoint directory: "
                         "train it first (see benchmarks/exact_frames.py)")
    return chosen


def write(result: dict[str, Any], path: Path, markdown: Callable[[dict[str, Any]], str]
          ) -> None:
    """The results JSON and its Markdown table beside it, each written atomically."""
    with atomic_path(path) as temporary:
        temporary.write_text(json.dumps(result, indent=2) + "\n")
    with atomic_path(path.with_suffix(".md")) as temporary:
        temporary.write_text(markdown(result))


if __name__ == "__main__":
    main()
