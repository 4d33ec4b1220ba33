"""Capture throughput: environment, per-step gradients (vmap vs loop), the whole capture.

Prints JSON and writes benchmarks/results/capture.json. Every figure is a median over repeats,
and every ratio is taken between timings measured side by side in this one run.

    python benchmarks/capture.py [--repeats 3] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gradleak.capture.grads import StepBatch, batch_gradient, loop_gradients, per_step_gradients
from gradleak.capture.run import CaptureJob, run_capture
from gradleak.envs.factory import make_env, scene_names
from gradleak.io import atomic_path
from gradleak.presets import load_preset
from gradleak.rl.losses import LossCoefficients
from gradleak.rl.rollout import single_threaded_torch
from gradleak.victims import create_victim, layer_table

RESULTS = Path(__file__).parent / "results" / "capture.json"


def median_seconds(run, repeats: int) -> float:
    run()  # warm-up: vmap tracing, oneDNN primitives, the engine's first map load
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def environment_rate(frame_size: int, steps: int, repeats: int) -> tuple[float, np.ndarray]:
    preset = load_preset("cpu-bench", [f"env.doomnav.frame_size={frame_size}"])
    env = make_env(preset.env, scene_names(preset.env, "train"))
    rng = np.random.default_rng(0)
    frames = []

    def run() -> None:
        env.reset(seed=int(rng.integers(1 << 30)))
        for _ in range(steps):
            observation, _, terminated, truncated, _ = env.step(int(rng.integers(5)))
            frames.append(observation["image"])
            if terminated or truncated:
                env.reset()

    seconds = median_seconds(run, repeats)
    env.close()
    return steps / seconds, np.stack(frames[-steps:])


def gradient_rates(victim_name: str, frames: np.ndarray, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    size = frames.shape[1]
    victim = create_victim(victim_name, frame_size=size).eval()
    n = len(frames)
    g = torch.Generator().manual_seed(0)
    batch = StepBatch(torch.from_numpy(frames), torch.randint(0, 5, (n,), generator=g),
                      torch.randn(n, generator=g), torch.randn(n, generator=g),
                      -torch.rand(n, generator=g) - 1)
    layers, coefficients = layer_table(victim), LossCoefficients()
    vmap_s = median_seconds(lambda: per_step_gradients(victim, batch, coefficients, layers,
                                                       chunk=32), repeats)
    loop_s = median_seconds(lambda: loop_gradients(victim, batch, coefficients, layers), repeats)
    batched_s = median_seconds(lambda: batch_gradient(victim, batch, coefficients, layers),
                               repeats)
    return {"victim": victim_name, "frame_size": size, "steps": n,
            "parameters": sum(layer.size for layer in layers),
            "vmap_ms_per_step": 1e3 * vmap_s / n, "loop_ms_per_step": 1e3 * loop_s / n,
            "batched_forward_backward_ms_per_step": 1e3 * batched_s / n,
            "vmap_speedup_over_loop": loop_s / vmap_s,
            "vmap_cost_vs_one_batched_backward": vmap_s / batched_s,
            "loop_cost_vs_one_batched_backward": loop_s / batched_s}


def capture_rates(steps: int, repeats: int) -> dict[str, float]:
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in ("vmap", "loop"):
            preset = load_preset("cpu-bench", [f"capture.gradient_method={method}"])

            def run(method: str = method, preset=preset) -> None:
                run_capture(CaptureJob(victim="cnn-small", random_init=True, split="train",
                                       steps=steps, out=Path(tmp) / f"{method}.h5",
                                       preset=preset, progress=False, overwrite=True))

            rates[f"capture_steps_per_s_{method}"] = steps / median_seconds(run, repeats)
    rates["capture_vmap_over_loop"] = (rates["capture_steps_per_s_vmap"]
                                       / rates["capture_steps_per_s_loop"])
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=256)
    args = parser.parse_args()
    results = {"machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
                          f"{platform.processor() or 'cpu'}",
               "torch": torch.__version__, "repeats": args.repeats, "statistic": "median"}
    with single_threaded_torch():  # the environment alone, as capture runs it
        rate64, frames64 = environment_rate(64, args.steps, args.repeats)
        rate84, frames84 = environment_rate(84, args.steps, args.repeats)
    results["env_steps_per_s"] = {"64x64": rate64, "84x84": rate84}
    time.sleep(2.0)  # let the engine processes exit before timing torch alone
    results["gradients"] = [gradient_rates("cnn-small", frames64, args.repeats),
                            gradient_rates("cnn", frames84[:128], args.repeats)]
    results.update(capture_rates(args.steps * 2, args.repeats))
    # The whole capture (engine, sampling, per-step gradients, HDF5) against what a trainer
    # spends on the same steps: one batched forward+backward of the mean loss.
    batched_ms = results["gradients"][0]["batched_forward_backward_ms_per_step"]
    for method in ("vmap", "loop"):
        capture_ms = 1e3 / results[f"capture_steps_per_s_{method}"]
        results[f"capture_{method}_cost_vs_one_batched_backward"] = capture_ms / batched_ms
    text = json.dumps(results, indent=2)
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(RESULTS) as tmp:
        tmp.write_text(text + "\n")


if __name__ == "__main__":
    main()
