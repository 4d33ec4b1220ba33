"""Are the frame solve's settings what limits the training-free frames? Chosen on training scenes.

For the paper's cnn at 84×84 (random init, PPO, A2C), the frame solve (`FrameSolve`: the
smoothness weight, the total-variation rounds and their ε, the colour weight) is run at each
setting of a small grid around the default on --frames evenly spaced steps of the attacker's
own training-scene capture (`exact_refiner.py`'s, made here when missing) and of
`exact_frames.py`'s held-out capture. The setting an attacker would pick is the best on its own
training scenes (it never sees the held-out frames); the table shows what that pick gives on
the held-out ones beside the default, and the held-out spread over the whole grid (an upper
bound on what tuning could ever buy). Writes benchmarks/results/exact_solve_sweep.{json,md}.

    python benchmarks/exact_solve_sweep.py [--work runs/exact-frames] [--frames 16]
        [--train-steps 768] [--ppo-cnn runs/victims/cnn84-ppo] [--a2c-cnn runs/victims/cnn84-a2c]
        [--only "cnn 84×84, A2C"]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import exact_frames
import exact_refiner
import numpy as np
import torch
from host import machine

from gradleak.attacks.exact import ExactAttack, ExactConfig
from gradleak.capture.reader import CaptureFile
from gradleak.evaluation.analytic import image_scores
from gradleak.inversion.frame_solve import FrameSolve
from gradleak.metrics.images import to_unit_tensor
from gradleak.report.tables import markdown_table

RESULTS = Path(__file__).parent / "results" / "exact_solve_sweep.json"
# one field changed from the default at a time (with the rounds' CG budget doubled once)
GRID: dict[str, dict[str, Any]] = {
    "default": {},
    "smoothness 3e-4": {"smoothness": 3e-4}, "smoothness 3e-3": {"smoothness": 3e-3},
    "rounds 8": {"rounds": 8}, "rounds 8, 200 iterations": {"rounds": 8,
                                                            "round_iterations": 200},
    "edge ε 0.003": {"edge_scale": 0.003}, "edge ε 0.03": {"edge_scale": 0.03},
    "chroma 2.5": {"chroma": 2.5}, "chroma 10": {"chroma": 10.0},
    # the rounds' colour axes: off (the chroma weighting throughout, the default until then)
    "colour axes off": {"colour_power": 0.0},
    "colour power 0.25": {"colour_power": 0.25}, "colour power 0.75": {"colour_power": 0.75},
}


def scored(path: Path, frames: int) -> dict[str, dict[str, float]]:
    """Every setting of the grid on `frames` evenly spaced steps of the capture."""
    with CaptureFile(path) as capture:
        rows = np.linspace(0, len(capture) - 1, frames).astype(int)
        observation, truth = capture.observation(rows), to_unit_tensor(
            capture.target(rows).images)
    return {label: image_scores(to_unit_tensor(ExactAttack(
        observation, ExactConfig(solve=FrameSolve(**changes))).reconstruct().images), truth)
        for label, changes in GRID.items()}


def measure(case: exact_frames.Case, args: argparse.Namespace) -> dict[str, Any]:
    heldout = exact_frames.capture(case, "float32", args.steps, args.work)
    train = exact_refiner.own_capture(case.victim, case.random_init, args.train_steps,
                                      args.work)
    on_train, on_heldout = scored(train, args.frames), scored(heldout, args.frames)
    picked = max(on_train, key=lambda label: on_train[label]["psnr"])
    row = {"victim": case.name, "train": on_train, "heldout": on_heldout, "picked": picked,
           "best_heldout": max(on_heldout, key=lambda label: on_heldout[label]["psnr"])}
    print(json.dumps(row), flush=True)
    return row


def markdown(result: dict[str, Any]) -> str:
    table = [{"victim": row["victim"], "setting": label,
              "picked": "yes" if label == row["picked"] else "",
              "train_psnr": f"{row['train'][label]['psnr']:.2f}",
              "train_ssim": f"{row['train'][label]['ssim']:.4f}",
              "heldout_psnr": f"{row['heldout'][label]['psnr']:.2f}",
              "heldout_ssim": f"{row['heldout'][label]['ssim']:.4f}"}
             for row in result["rows"] for label in GRID]
    summary = "; ".join(
        f"{row['victim']}: picked {row['picked']!r}, held out "
        f"{row['heldout'][row['picked']]['psnr']:.2f} dB / "
        f"{row['heldout'][row['picked']]['ssim']:.4f} against the default's "
        f"{row['heldout']['default']['psnr']:.2f} / {row['heldout']['default']['ssim']:.4f} "
        f"(best held-out setting {row['best_heldout']!r}: "
        f"{row['heldout'][row['best_heldout']]['psnr']:.2f} / "
        f"{row['heldout'][row['best_heldout']]['ssim']:.4f})"
        for row in result["rows"])
    return ("# The frame solve's settings, chosen on training scenes "
            "(`benchmarks/exact_solve_sweep.py`)\n\n"
            f"{result['frames']} evenly spaced steps of the attacker's own "
            f"{result['train_steps']}-step training-scene capture (`train_*`) and of "
            "`exact_frames.py`'s held-out capture (`heldout_*`), float32, each setting one "
            "change from the default `FrameSolve`; `picked`: the best on training scenes by "
            f"PSNR, what an attacker would choose. {summary}. {result['machine']}.\n\n"
            + markdown_table(table, ["victim", "setting", "picked", "train_psnr", "train_ssim",
                                     "heldout_psnr", "heldout_ssim"]) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, default=Path("runs/exact-frames"))
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--steps", type=int, default=64, help="the held-out capture's steps")
    parser.add_argument("--train-steps", type=int, default=768)
    parser.add_argument("--ppo-cnn", type=Path, default=Path("runs/victims/cnn84-ppo"))
    parser.add_argument("--a2c-cnn", type=Path, default=Path("runs/victims/cnn84-a2c"))
    parser.add_argument("--only", action="append", default=[],
                        help="a victim's name (repeatable)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.frames < 1:
        parser.error(f"--frames {args.frames}: expected >= 1")
    chosen = exact_refiner.checked_cases(parser, args)
    exact_refiner.write({"benchmark": "exact_solve_sweep", "frames": args.frames,
                         "train_steps": args.train_steps, "grid": GRID,
                         "machine": machine(),
                         "rows": [measure(case, args) for case in chosen]},
                        args.results, markdown)


if __name__ == "__main__":
    main()
