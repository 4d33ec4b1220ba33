"""Capture throughput: environment, per-step gradients (gradleak's einsum rules, torch.func
vmap, the autograd loop, Opacus' GradSampleModule, BackPACK's BatchGrad), the HDF5 filters,
the whole capture (with and without the rollout overlapped in a child process).

Prints JSON and writes benchmarks/results/capture.json. Every figure is a median over repeats,
and every ratio is taken round by round between timings measured side by side in this one run
(each round runs every method or capture variant once). BackPACK is measured when
`backpack-for-pytorch` is installed (it is not a dependency).

    python benchmarks/capture.py [--repeats 5] [--steps 256]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

import h5py

from gradleak.capture.grads import (
    StepBatch,
    StepGradients,
    batch_gradient,
    factorable_weights,
    loop_gradients,
    per_step_gradients,
)
from gradleak.capture.layout import read_gradients
from gradleak.capture.storage import COMPRESSIONS, compression_options
from gradleak.capture.run import CaptureJob, run_capture
from gradleak.envs import frames as frames_module
from gradleak.envs.factory import make_env, scene_names
from gradleak.io import atomic_path
from gradleak.presets import load_preset
from gradleak.rl.losses import LossCoefficients, actor_critic_loss
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


def round_robin_seconds(runs: dict[str, Any], repeats: int,
                        untimed: dict[str, Callable[[], None]] | None = None
                        ) -> dict[str, list[float]]:
    """Each run's seconds over `repeats` rounds, every run once a round (after a warm-up
    round in the given order): the host's drift over minutes falls on all of them alike, so a
    ratio is taken round by round. Each round starts one run further along the order, so no
    run always follows the same one (in a fixed order the default capture, always first after
    the engine alone, came out slower than its own variants: cnn-small 0.68× the engine
    against 0.77× with every weight dense and 0.79× with the writes in line, 5 rounds).
    `untimed[name]`, if any, runs after that run, outside its time."""
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for round_ in range(repeats + 1):
        shift = (round_ - 1) % len(names) if round_ else 0
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            runs[name]()
            if round_:
                seconds[name].append(time.perf_counter() - start)
            (untimed or {}).get(name, lambda: None)()
    return seconds


@contextlib.contextmanager
def engine(frame_size: int) -> Iterator[Any]:
    """The environment alone on cpu-bench's training scenes, kept open across timed runs."""
    preset = load_preset("cpu-bench", [f"env.doomnav.frame_size={frame_size}"])
    env = make_env(preset.env, scene_names(preset.env, "train"))
    try:
        yield env
    finally:
        env.close()


def random_steps(env: Any, steps: int, rng: np.random.Generator) -> list[np.ndarray]:
    """That many random actions from a fresh episode (a new one where one ends); the frames."""
    env.reset(seed=int(rng.integers(1 << 30)))
    frames = []
    for _ in range(steps):
        observation, _, terminated, truncated, _ = env.step(int(rng.integers(5)))
        frames.append(observation["image"])
        if terminated or truncated:
            env.reset()
    return frames


def environment_rate(frame_size: int, steps: int, repeats: int
                     ) -> tuple[float, float, np.ndarray]:
    """Steps per second of the environment alone, the cores this process used meanwhile (the
    engine's own process apart), and the frames it rendered."""
    frames: list[np.ndarray] = []
    rng = np.random.default_rng(0)
    with engine(frame_size) as env:
        cpu, wall = time.process_time(), time.perf_counter()
        seconds = median_seconds(lambda: frames.extend(random_steps(env, steps, rng)), repeats)
        cores = (time.process_time() - cpu) / (time.perf_counter() - wall)
    return steps / seconds, cores, np.stack(frames[-steps:])


class _ThreadedBlas:
    """The frame resize on BLAS's default threads, as before it was kept to one."""

    def limit(self, limits: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


@contextlib.contextmanager
def resize_on_default_blas_threads():
    original = frames_module.blas_controller
    frames_module.blas_controller = lambda: _ThreadedBlas()
    try:
        yield
    finally:
        frames_module.blas_controller = original


def gradient_rates(victim_name: str, frames: np.ndarray, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    size = frames.shape[1]
    victim = create_victim(victim_name, frame_size=size).eval()
    n = len(frames)
    g = torch.Generator().manual_seed(0)
    batch = StepBatch(torch.from_numpy(frames), torch.randint(0, 5, (n,), generator=g),
                      torch.randn(n, generator=g), torch.randn(n, generator=g),
                      -torch.rand(n, generator=g) - 1)
    layers, coefficients = layer_table(victim), LossCoefficients()
    einsum = StepGradients("einsum", chunk=64)  # its buffer reused, as the capture keeps it
    factored = StepGradients("einsum", chunk=64, factored=factorable_weights(
        victim, layers, batch.slice(0, 2)))
    runs = {
        "batched": lambda: batch_gradient(victim, batch, coefficients, layers),
        "einsum": lambda: einsum(victim, batch, coefficients, layers),
        # the Linear weights as their factors, as a capture stores them by default
        "einsum_factored": lambda: factored(victim, batch, coefficients, layers),
        "einsum_fresh_buffer": lambda: StepGradients("einsum", 64)(victim, batch, coefficients,
                                                                   layers),
        "vmap": lambda: per_step_gradients(victim, batch, coefficients, layers, chunk=32),
        "loop": lambda: loop_gradients(victim, batch, coefficients, layers)}
    timed = round_robin_seconds(runs, repeats)
    result: dict[str, Any] = {"victim": victim_name, "frame_size": size, "steps": n,
                              "parameters": sum(layer.size for layer in layers),
                              "batched_forward_backward_ms_per_step":
                                  1e3 * statistics.median(timed["batched"]) / n,
                              "opacus": _opacus_refusal(victim)}
    for name, values in timed.items():
        if name == "batched":
            continue
        result[f"{name}_ms_per_step"] = 1e3 * statistics.median(values) / n
        result[f"{name}_cost_vs_one_batched_backward"] = statistics.median(
            value / batched for value, batched in zip(values, timed["batched"], strict=True))
    backpack = _backpack_seconds(victim, batch, coefficients, layers, repeats)
    if isinstance(backpack, str):
        result["backpack_note"] = backpack
    else:
        result["backpack_ms_per_step"] = 1e3 * backpack / n
        result["backpack_cost_vs_one_batched_backward"] = backpack / statistics.median(
            timed["batched"])
    seconds = {name: statistics.median(values) for name, values in timed.items()}
    result["einsum_speedup_over_vmap"] = seconds["vmap"] / seconds["einsum"]
    return result


def _opacus_refusal(victim: torch.nn.Module) -> str:
    """Opacus' GradSampleModule on the victim: what it says (it refuses BatchNorm, whose
    buffers it cannot account for in training, although at θ0 in eval mode they are fixed)."""
    from opacus import GradSampleModule

    try:
        GradSampleModule(victim, batch_first=True, loss_reduction="sum", strict=False)._close()
    except NotImplementedError as error:
        return f"refused: {error}"
    return "accepted"


def _backpack_seconds(victim: torch.nn.Module, batch: StepBatch,
                      coefficients: LossCoefficients, layers: list[Any], repeats: int
                      ) -> float | str:
    try:
        from backpack import backpack, extend
        from backpack.extensions import BatchGrad
    except ImportError:
        return "backpack-for-pytorch not installed"
    model = extend(victim)
    named = dict(victim.named_parameters())

    def run() -> torch.Tensor:
        rows = []
        for start in range(0, len(batch), 64):
            part = batch.slice(start, start + 64)
            logits, values = model(part.images, part.goals, part.hidden)
            loss = actor_critic_loss(logits, values, part.actions, part.advantages,
                                     part.returns, coefficients, part.old_log_probs).sum()
            model.zero_grad()
            with backpack(BatchGrad()):
                loss.backward()
            rows.append(torch.cat([named[layer.name].grad_batch.reshape(len(part), -1)
                                   for layer in layers], 1))
        return torch.cat(rows)

    reference = loop_gradients(victim, batch.slice(0, 4), coefficients, layers)
    error = float(((run()[:4] - reference).abs().amax(1) / reference.abs().amax(1)).max())
    if error > 1e-5:
        return f"disagrees with autograd (relative error {error:.1e})"
    return median_seconds(run, repeats)


def filter_rates(capture: Path, rows: int, repeats: int) -> list[dict[str, Any]]:
    """Each HDF5 filter on the first `rows` gradient rows of a capture (float32 and float16):
    bytes per step, write and read MB/s, one step per chunk as captures store them."""
    with h5py.File(capture, "r") as handle:  # full rows, as a dense capture stores them
        data32 = read_gradients(handle, slice(0, rows)).astype(np.float32)
    results = []
    for dtype in ("float32", "float16"):
        data = data32.astype(dtype)
        for name in COMPRESSIONS:
            writes, reads, size = [], [], 0
            for _ in range(repeats):
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / "rows.h5"
                    start = time.perf_counter()
                    with h5py.File(path, "w") as handle:
                        out = handle.create_dataset("g", shape=data.shape, dtype=dtype,
                                                    chunks=(1, data.shape[1]),
                                                    **compression_options(name))
                        for first in range(0, rows, 64):
                            out[first:first + 64] = data[first:first + 64]
                    writes.append(time.perf_counter() - start)
                    size = path.stat().st_size
                    start = time.perf_counter()
                    with h5py.File(path, "r") as handle:
                        handle["g"][()]
                    reads.append(time.perf_counter() - start)
            megabytes = data.nbytes / 1e6
            results.append({"filter": name, "dtype": dtype, "bytes_per_step": size / rows,
                            "ratio": data.nbytes / size,
                            "write_mb_per_s": megabytes / statistics.median(writes),
                            "read_mb_per_s": megabytes / statistics.median(reads)})
    return results


LONG = 4  # the long capture's steps, in multiples of the short one's
CAPTURE_VARIANTS = {  # name → overrides: the default first, then what each part adds
    "overlapped": [],
    "overlapped_dense": ["capture.factor_linear=False"],
    "overlapped_inline_write": ["capture.background_write=False"],
    "in_process": ["capture.overlap=False", "capture.background_write=False"],
}


def replay(capture: Path) -> Callable[[Any], None]:
    """A run that steps an open engine through `capture`'s own episodes (each reset to the
    episode's scene and seed, then its stored actions): the engine's own pace on the very
    steps the capture took, its maps and its policy's mix of moves and turns (a move costs the
    engine ~10x a turn, and maps differ by up to 2x), which random actions on random scenes
    do not share. The run checks that each episode's first frame is the stored one."""
    from gradleak.capture.run import episode_seed

    with h5py.File(capture, "r") as handle:
        scenes = json.loads(handle.attrs["all_scenes"])
        seed, shard = int(handle.attrs["seed"]), int(str(handle.attrs["shard"]).split("/")[0])
        ids, actions = handle["episode_ids"][()], handle["actions"][()]
        starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
        scene_ids, first_frames = handle["scene_ids"][()], handle["images"][starts]
    episodes = [(int(ids[i]), scenes[int(scene_ids[i])], actions[i:j], frame)
                for i, j, frame in zip(starts, np.r_[starts[1:], len(ids)], first_frames,
                                       strict=True)]

    def run(env: Any) -> None:
        for index, scene, moves, frame in episodes:
            observation, _ = env.reset(seed=episode_seed(seed, shard, index),
                                       options={"scene": scene})
            if not np.array_equal(observation["image"], frame):
                raise RuntimeError(f"replay of episode {index} ({scene}) left the capture")
            for action in moves:
                env.step(int(action))
    return run


def capture_rates(victim: str, frame_size: int, steps: int, repeats: int,
                  engine_steps: int) -> dict[str, Any]:
    """The whole capture of `victim` (float32, LZ4) as it runs by default (the rollout in a
    child process, writes in a thread, Linear weights factored), with every weight dense, with
    the writes in line, and all in this process; the file's bytes per step. Round-robin with
    the engine alone as one more run (`round_robin_seconds`): the host's drift (its engine made
    308 to 575 steps/s at 64×64 across runs, and a variant's blocks of repeats once differed by
    1.3× from the same settings run minutes later) falls on all of them alike, and each ratio to
    the engine is the median over rounds of that round's ratio.

    A capture of `steps` pays its start (the engine's launch and first map in the child, the
    victim, the file) once; a capture of the paper's size (108,000 steps) does not notice it.
    So each round also times the default capture at LONG× the steps: the steady pace is the
    extra steps over the extra seconds, set against the engine replaying the long capture's
    own episodes (`replay`) in the same round."""
    rates: dict[str, Any] = {"victim": victim, "frame_size": frame_size, "steps": steps,
                             "long_steps": steps * LONG}
    presets = {key: load_preset("cpu-bench", [f"env.doomnav.frame_size={frame_size}",
                                              *overrides])
               for key, overrides in CAPTURE_VARIANTS.items()}
    timings: dict[str, list[dict[str, float]]] = {key: [] for key in presets}
    sizes: dict[str, int] = {}
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp, engine(frame_size) as env:
        def capture(key: str, length: int, name: str) -> Callable[[], None]:
            def run() -> None:
                result = run_capture(CaptureJob(victim=victim, random_init=True, split="train",
                                                steps=length, out=Path(tmp) / f"{name}.h5",
                                                preset=presets[key], progress=False))
                timings.setdefault(name, []).append(
                    {k: v for k, v in result.items() if k.endswith("_s")})
            return run

        episodes: list[Callable[[Any], None]] = []  # the long capture's, to replay

        # Each capture writes a new file, as a user's does: replacing the last round's (an
        # --overwrite) would free its blocks inside the timing, 0.06-0.08 s for 150 MB.
        def discard(name: str) -> Callable[[], None]:
            def run() -> None:
                path = Path(tmp) / f"{name}.h5"
                if name == "long" and not episodes:  # the replay's episodes, read once
                    episodes.append(replay(path))
                sizes[name] = path.stat().st_size
                path.unlink()
            return run

        def alone() -> None:
            with single_threaded_torch():  # as capture runs it
                random_steps(env, engine_steps, rng)

        def replayed() -> None:  # the long capture's episodes, the same every round
            with single_threaded_torch():
                episodes[0](env)

        runs = {"engine": alone, **{key: capture(key, steps, key) for key in presets},
                "long": capture("overlapped", steps * LONG, "long"), "replay": replayed}
        seconds = round_robin_seconds(runs, repeats,
                                      {name: discard(name) for name in [*presets, "long"]})
        for key in presets:
            parts = timings[key][1:]  # the warm-up round's apart
            rates[f"steps_per_s_{key}"] = steps / statistics.median(seconds[key])
            rates[f"bytes_per_step_{key}"] = sizes[key] / steps
            rates[f"ms_per_step_{key}"] = {
                part: 1e3 * statistics.median(t[part] for t in parts) / steps
                for part in parts[0]}
            rates[f"{key}_vs_engine"] = statistics.median(
                (steps / took) / (engine_steps / alone_took)
                for took, alone_took in zip(seconds[key], seconds["engine"], strict=True))
    rates["engine_steps_per_s"] = engine_steps / statistics.median(seconds["engine"])
    rates.update(steady_rates(seconds, steps, engine_steps))
    return rates


def steady_rates(seconds: dict[str, list[float]], steps: int, engine_steps: int
                 ) -> dict[str, float]:
    """The default capture's steady pace (`capture_rates`), per round: its extra steps over
    its extra seconds, the start that leaves, and its ratios to the engine on random actions
    and to the engine replaying the long capture's episodes; medians over rounds."""
    extra = steps * (LONG - 1)
    steady = [extra / (long - short)
              for short, long in zip(seconds["overlapped"], seconds["long"], strict=True)]
    replayed = [steps * LONG / took for took in seconds["replay"]]
    return {"steady_steps_per_s": statistics.median(steady),
            "start_s": statistics.median(short - steps / rate for short, rate
                                         in zip(seconds["overlapped"], steady, strict=True)),
            "replay_steps_per_s": statistics.median(replayed),
            "steady_vs_engine": statistics.median(
                rate * took / engine_steps
                for rate, took in zip(steady, seconds["engine"], strict=True)),
            "steady_vs_replay": statistics.median(
                rate / engine for rate, engine in zip(steady, replayed, strict=True)),
            "long_vs_engine": statistics.median(
                steps * LONG / long / (engine_steps / took)
                for long, took in zip(seconds["long"], seconds["engine"], strict=True)),
            "long_vs_replay": statistics.median(
                steps * LONG / long / engine
                for long, engine in zip(seconds["long"], replayed, strict=True))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=256)
    args = parser.parse_args()
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
                   f"{platform.processor() or 'cpu'}",
        "torch": torch.__version__, "repeats": args.repeats, "statistic": "median"}
    with single_threaded_torch():  # the environment alone, as capture runs it
        rate64, cores64, frames64 = environment_rate(64, args.steps, args.repeats)
        rate84, cores84, frames84 = environment_rate(84, args.steps, args.repeats)
        with resize_on_default_blas_threads():  # side by side: what one BLAS thread changes
            threaded64, threaded_cores64, _ = environment_rate(64, args.steps, args.repeats)
    results["env_steps_per_s"] = {"64x64": rate64, "84x84": rate84}
    # this process's cores while the environment steps (the engine's own process apart): a
    # threaded resize leaves OpenBLAS's worker spinning between frames
    results["env_process_cores"] = {"64x64": cores64, "84x84": cores84}
    results["env_resize_on_default_blas_threads"] = {
        "64x64_steps_per_s": threaded64, "64x64_process_cores": threaded_cores64}
    time.sleep(2.0)  # let the engine processes exit before timing torch alone
    results["gradients"] = [gradient_rates("cnn-small", frames64, args.repeats),
                            gradient_rates("cnn", frames84[:128], args.repeats)]
    captures = [capture_rates("cnn-small", 64, args.steps * 4, args.repeats, args.steps),
                capture_rates("cnn", 84, args.steps * 2, args.repeats, args.steps)]
    results["captures"] = captures
    with tempfile.TemporaryDirectory() as tmp:  # filters on real rows: a cnn-small capture's
        path = Path(tmp) / "rows.h5"
        run_capture(CaptureJob(victim="cnn-small", random_init=True, split="train", steps=256,
                               out=path, preset=load_preset("cpu-bench", []), progress=False))
        results["filters"] = filter_rates(path, 256, args.repeats)
        with h5py.File(path, "r") as handle:
            results["filter_rows_zero_fraction"] = float((read_gradients(handle) == 0).mean())
    text = json.dumps(results, indent=2)
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(RESULTS) as tmp_path:
        tmp_path.write_text(text + "\n")


if __name__ == "__main__":
    main()
