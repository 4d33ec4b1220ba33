"""How long the training-free attack takes per frame, and where the time goes.

On `benchmarks/exact_frames.py`'s float32 held-out captures of the paper's cnn at 84×84
(random init and PPO; made here, identically, when missing), --frames evenly spaced steps are
attacked --repeats times; medians of the whole attack and of its two parts (the recursion
through the conv stack, the frame solve). Writes benchmarks/results/exact_speed.{json,md}.

Beside the recursion, in the same run, every mask rule walked on every step (what it costs
without the shortcut that walks the others only where the first is inconsistent).

    python benchmarks/exact_speed.py [--work runs/exact-frames] [--frames 16] [--repeats 3]
        [--ppo-cnn runs/victims/cnn84-ppo]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import exact_frames  # the sibling benchmark: its victims and held-out captures
import numpy as np
import torch
from exact_frames import Case
from host import machine

import gradleak.attacks.exact as exact
from gradleak.attacks.exact import ExactAttack, ExactConfig
from gradleak.capture.reader import CaptureFile
from gradleak.inversion.conv_recovery import MASK_RULES, walk_down
from gradleak.io import atomic_path
from gradleak.report.tables import markdown_table
from gradleak.victims.base import victim_at_theta0

RESULTS = Path(__file__).parent / "results" / "exact_speed.json"
PARTS = ("observed_conv_inputs", "solve_frames")  # the recursion, the frame solve


def timed_parts(seconds: dict[str, float]) -> None:
    """Wrap the attack's two parts so each call adds its time to `seconds`."""
    for name in PARTS:
        function = getattr(exact, name)

        def wrapper(*args: Any, _function=function, _name=name, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = _function(*args, **kwargs)
            seconds[_name] += time.perf_counter() - start
            return result
        setattr(exact, name, wrapper)


def measure(case: Case, args: argparse.Namespace, seconds: dict[str, float]) -> dict[str, Any]:
    path = exact_frames.capture(case, "float32", args.steps, args.work)
    with CaptureFile(path) as capture:
        observation = capture.observation(
            np.linspace(0, len(capture) - 1, args.frames).astype(int))
    runs: dict[str, list[float]] = {"total": [], **{name: [] for name in PARTS},
                                    "every_walk": []}
    for _ in range(args.repeats):
        seconds.update({name: 0.0 for name in PARTS})
        start = time.perf_counter()
        ExactAttack(observation, ExactConfig()).reconstruct()
        runs["total"].append(time.perf_counter() - start)
        for name in PARTS:
            runs[name].append(seconds[name])
        runs["every_walk"].append(every_walk_seconds(observation))
    row = {"victim": case.name, **{f"{name}_ms_per_frame": 1000 * statistics.median(values)
                                   / args.frames for name, values in runs.items()}}
    print(json.dumps(row), flush=True)
    return row


def every_walk_seconds(observation: Any) -> float:
    """The recursion as it was before a consistent first walk let the others be skipped: every
    mask rule walked on every step (side by side with the default, same process)."""
    victim = victim_at_theta0(observation).double()

    def gradient_of(name: str) -> torch.Tensor:
        return torch.from_numpy(observation.block(name).astype(np.float64))

    start = time.perf_counter()
    with torch.no_grad():
        for rule in MASK_RULES:
            walk_down(gradient_of, victim, None, rule)
    return time.perf_counter() - start


def speed_up(row: dict[str, Any]) -> float:
    return row["every_walk_ms_per_frame"] / row["observed_conv_inputs_ms_per_frame"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, default=Path("runs/exact-frames"))
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ppo-cnn", type=Path, default=Path("runs/victims/cnn84-ppo"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not args.results.parent.is_dir():
        parser.error(f"--results {args.results}: its folder does not exist")
    if not args.ppo_cnn.is_dir():
        parser.error(f"--ppo-cnn {args.ppo_cnn} is not a victim checkpoint directory: train it "
                     "first (see benchmarks/exact_frames.py)")
    torch.set_num_threads(2)
    seconds: dict[str, float] = {}
    timed_parts(seconds)
    rows = [measure(case, args, seconds) for case in exact_frames.paper_cases(args.ppo_cnn)]
    result = {"benchmark": "exact_speed", "frames": args.frames, "repeats": args.repeats,
              "machine": machine(), "rows": rows}
    table = [{"victim": row["victim"], "attack ms/frame": f"{row['total_ms_per_frame']:.0f}",
              "recursion": f"{row['observed_conv_inputs_ms_per_frame']:.0f}",
              "frame solve": f"{row['solve_frames_ms_per_frame']:.0f}",
              "recursion, every walk on every step": f"{row['every_walk_ms_per_frame']:.0f}",
              "speed-up": f"{speed_up(row):.1f}×"}
             for row in rows]
    with atomic_path(args.results) as temporary:
        temporary.write_text(json.dumps(result, indent=2) + "\n")
    with atomic_path(args.results.with_suffix(".md")) as temporary:
        temporary.write_text(
            "# The training-free attack's time per frame (`benchmarks/exact_speed.py`)\n\n"
            f"{args.frames} held-out steps of the paper's cnn at 84×84 (float32), medians of "
            f"{args.repeats} runs, {result['machine']}; the rest of the attack (closed-form "
            "recovery, the first conv's equations) is the difference. The recursion walks the "
            "noise-aware rule first and the margin rules only on the steps it leaves "
            "inconsistent; beside it, in the same run, every rule walked on every step (the "
            "cost without that shortcut).\n\n"
            + markdown_table(table, list(table[0]))
            + "\n")


if __name__ == "__main__":
    main()
