"""DLG and Inverting Gradients with the victim's exact loss vs the public code's probe loss,
beside TRACE and LtI on the same held-out frames; and what batching buys.

Quality: the first --windows windows (T = 8, so 32 frames by default) of the cpu-bench held-out
capture, every method scored on exactly those frames by `evaluate` (PSNR, SSIM, action
accuracy, seconds per frame). Speed: frames x iterations per second solving --frames frames
together vs one at a time, medians over --repeats, measured side by side in this run.

    python benchmarks/optim_baselines.py [--work runs/bench-attack] [--preset cpu-bench]

Needs the captures and attackers of benchmarks/trace_vs_lti.py in --work.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from gradleak.attacks.optim.config import baseline_config
from gradleak.attacks.optim.solve import GradientMatchingAttack
from gradleak.capture.reader import CaptureFile
from gradleak.evaluation.reconstructions import evaluate
from gradleak.io import atomic_path
from gradleak.presets import load_preset

RESULTS = Path(__file__).parent / "results" / "optim_baselines.json"
METHODS = {"DLG": "dlg", "DLG (probe loss)": "dlg-probe", "IG": "ig",
           "IG (probe loss)": "ig-probe"}


def frames_per_second(observation, name: str, families, batch: int, frames: int,
                      iterations: int, repeats: int) -> float:
    """Frame-iterations per second: `frames` frames, `batch` of them solved together."""
    config = baseline_config(name, families, iterations=iterations, batch=batch)
    attack = GradientMatchingAttack(observation, config)
    attack.reconstruct(np.arange(min(batch, frames)))  # warm-up: vmap tracing, allocations
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        attack.reconstruct(np.arange(frames))
        times.append(time.perf_counter() - start)
    return frames * iterations / statistics.median(times)


def batching(heldout: Path, families, frames: int, iterations: int, repeats: int) -> dict:
    with CaptureFile(heldout) as capture:
        observation = capture.observation(slice(0, frames))
    result = {}
    for name in ("ig", "dlg"):
        batched = frames_per_second(observation, name, families, frames, frames, iterations,
                                    repeats)
        single = frames_per_second(observation, name, families, 1, frames, iterations, repeats)
        result[name] = {"frame_iterations_per_s_batched": batched,
                        "frame_iterations_per_s_one_at_a_time": single,
                        "speed-up": batched / single, "frames": frames,
                        "iterations": iterations}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, default=Path("runs/bench-attack"))
    parser.add_argument("--preset", default="cpu-bench")
    parser.add_argument("--windows", type=int, default=4, help="T = 8 windows: 4 → 32 frames")
    parser.add_argument("--speed-frames", type=int, default=16)
    parser.add_argument("--speed-iterations", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=None, help="override the preset's budgets")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    preset = load_preset(args.preset)
    families = {"ig": preset.attack.ig, "dlg": preset.attack.dlg}
    heldout = args.work / "heldout.h5"
    attackers = {name: str(args.work / folder) for name, folder in
                 (("TRACE (T=8)", "TRACE-T=8"), ("LtI", "LtI")) if (args.work / folder).exists()}
    baselines = {label: baseline_config(name, families, iterations=args.iters)
                 for label, name in METHODS.items()}
    speed = batching(heldout, families, args.speed_frames, args.speed_iterations, args.repeats)
    quality = evaluate([heldout], attackers, args.work / "eval-optim", max_windows=args.windows,
                       baselines=baselines, baseline_windows=args.windows, progress=True)
    summary = {"preset": args.preset, "machine": f"{platform.machine()}, "
               f"{torch.get_num_threads()} torch threads", "frames": quality["methods"]["IG"]
               ["frames"], "quality": quality, "batching": speed}
    text = json.dumps(summary, indent=2)
    print(text)
    with atomic_path(args.results) as tmp:
        tmp.write_text(text + "\n")
    with atomic_path(args.results.with_suffix(".md")) as tmp:
        tmp.write_text((args.work / "eval-optim" / "metrics.md").read_text())


if __name__ == "__main__":
    main()
