"""The capture job: episodes at θ0 → per-step gradients → one HDF5 file per shard."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from gradleak.capture.background import BackgroundWrites, InlineWrites
from gradleak.capture.config import CaptureConfig
from gradleak.capture.episodes import episode_targets, run_episode
from gradleak.capture.grads import FactoredRows, StepBatch, StepGradients
from gradleak.capture.lock import capture_lock
from gradleak.capture.plan import CaptureJob, CapturePlan, plan_capture
from gradleak.capture.producer import EpisodeProducer, Produced
from gradleak.capture.schema import SIDECAR_SUFFIX, step_columns
from gradleak.capture.writer import CaptureWriter, partial_path, refuse_unless_capture
from gradleak.envs.factory import make_env
from gradleak.errors import CaptureFileError, DiskFullError, GradleakError
from gradleak.io import (
    created_directories,
    write_json,
)
from gradleak.rl.rollout import channels_last_convolutions, single_threaded_torch
from gradleak.threads import torch_threads

FLOAT16_MAX = 65504.0


def episode_seed(seed: int, shard: int, episode: int) -> int:
    return int(np.random.SeedSequence([seed, shard, episode]).generate_state(1)[0])


def run_capture(job: CaptureJob) -> dict[str, Any]:
    plan = plan_capture(job)
    if job.overwrite:
        refuse_unless_capture(plan.out)  # before the engine starts
    with created_directories(plan.out.parent), capture_lock(plan.out, partial_path(plan.out)):
        result = _run_locked(plan, job)
    if result["status"] == "complete":
        write_json(plan.out.with_name(plan.out.name + SIDECAR_SUFFIX),
                   {"command": "capture", "victim": job.victim, "random_init": job.random_init,
                    "split": job.split, "steps": job.steps, "shard": list(job.shard),
                    "seed": plan.seed, "preset": job.preset.to_dict(), "result": result})
    return result


def _run_locked(plan: CapturePlan, job: CaptureJob) -> dict[str, Any]:
    # The engine starts before the HDF5 file is opened: its process would otherwise inherit
    # the file's descriptor and lock, and outlive a killed capture holding both.
    source = _EpisodeSource(plan, job)
    try:
        victim = plan.victim
        theta0 = {k: v.detach().numpy() for k, v in victim.state_dict().items()}
        columns = step_columns(victim.input_transform.frame_shape, victim.config.num_actions,
                               victim.hidden_size)
        writer = CaptureWriter(plan.out, plan.attrs, columns, plan.attrs["gradient_dim"],
                               theta0, job.resume, job.overwrite,
                               gradient_dtype=job.preset.capture.gradient_dtype,
                               steps=plan.steps, compression=job.preset.capture.compression)
        if writer.already_complete:
            return {"out": str(plan.out), "status": "already complete"}
        try:
            timings = _capture_loop(plan, source, writer, job)
        except DiskFullError:
            raise  # the partial file stays whole: it resumes once there is room
        except GradleakError:
            writer.discard()  # a deterministic failure: resuming would only repeat it
            raise
        finally:
            writer.close()  # after a crash or Ctrl-C the partial file stays, resumable
    finally:
        source.close()
    writer.finish()
    return {"out": str(plan.out), "status": "complete", "steps": plan.steps,
            "episodes": _count_episodes(plan.out), **timings}


class _EpisodeSource:
    """The plan's episodes in order: rolled out in a child process one episode ahead
    (capture.overlap, the default), or here, one at a time."""

    def __init__(self, plan: CapturePlan, job: CaptureJob) -> None:
        self.plan, self.job = plan, job
        self.env: Any = None
        self.producer: EpisodeProducer | None = None
        if job.preset.capture.overlap:
            self.producer = EpisodeProducer(self._started_rollout_process, self._rollout)
        else:
            self.env = self._started_env()

    def _started_rollout_process(self) -> Any:
        """The forked rollout process's start: its victim is its own copy, laid out for batch-1
        forward passes (a capture of the paper cnn 0.955x the time, median of 10 alternating
        pairs at 512 steps)."""
        # one thread: a forked child inherits the parent's OpenMP pool in a state it cannot
        # use, and the weights' multi-threaded copy hung there
        with single_threaded_torch():
            channels_last_convolutions(self.plan.victim)
        return self._started_env()

    def _started_env(self) -> Any:
        # the plan's catalog: a forked child has the WAD read and hashed; it loads a map's
        # geometry when an episode first goes there
        env = make_env(self.job.preset.env, self.plan.scenes, self.job.preset.env.doomnav.max_steps,
                       catalog=self.plan.catalog)
        # the engine starts on a fresh capture's first scene's map, whose episode then only
        # restarts it (from a random scene, another map was loaded first, then this one:
        # 0.30-0.36 s to here and 0.08-0.09 s for the episode's reset, against 0.26-0.29 and
        # 0.04-0.05 s; starting on the scene's map rather than the WAD's first: 229-247 →
        # 203-227 ms to here, medians over four maps in alternating processes)
        env.reset(seed=self.plan.seed, options={"scene": self.plan.scenes[0]})
        return env

    def _rollout(self, env: Any, index: int, remaining: int) -> tuple[str, Any, float]:
        plan = self.plan
        scene = plan.scenes[index % len(plan.scenes)]
        seed = episode_seed(plan.seed, plan.shard_index, index)
        episode, bootstrap = run_episode(env, plan.victim, seed, scene,
                                         min(self.job.preset.env.doomnav.max_steps, remaining),
                                         torch.Generator().manual_seed(seed))
        return scene, episode, bootstrap

    def episodes(self, first: int, remaining: int) -> Iterator[Produced]:
        if self.producer is not None:
            # the rollout holds a core: torch's threads here get the others (oversubscribed,
            # every parallel region waits for a thread the engine preempted: 13x slower)
            with torch_threads(max(1, torch.get_num_threads() - 1)):
                yield from self.producer.start(first, remaining)
            return
        index = first
        while remaining > 0:
            tick = time.perf_counter()
            scene, episode, bootstrap = self._rollout(self.env, index, remaining)
            yield Produced(index, scene, episode, bootstrap, time.perf_counter() - tick)
            remaining -= len(episode)
            index += 1

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
        if self.env is not None:
            self.env.close()


def _capture_loop(plan: CapturePlan, source: _EpisodeSource, writer: CaptureWriter,
                  job: CaptureJob) -> dict[str, float]:
    """episode_s: the rollouts' own time (in the child when they overlap); wait_s: this process
    waiting for the next episode; gradient_s: this process's work on the gradients; write_s:
    the writes' own time (in a thread when they run in the background); write_wait_s: this
    process waiting for a background write to end (0 when they are in line)."""
    timings = {"episode_s": 0.0, "wait_s": 0.0, "gradient_s": 0.0}
    config = job.preset.capture
    writes = (BackgroundWrites if config.background_write else InlineWrites)(
        writer.append_episode)
    # a buffer per episode in flight: rows stay untouched while they are written
    methods = [StepGradients(config.gradient_method, config.chunk, plan.factored)
               for _ in range(writes.buffers)]
    longest = min(job.preset.env.doomnav.max_steps, plan.steps - writer.num_rows)
    for method in methods:  # while the rollout process starts its engine and first episode
        method.reserve(plan.victim, plan.layers, longest)
    try:
        with tqdm(total=plan.steps, initial=min(writer.num_rows, plan.steps), unit="step",
                  disable=not job.progress, desc=f"capture {job.split}") as bar:
            tick = time.perf_counter()
            for produced in source.episodes(writer.num_episodes, plan.steps - writer.num_rows):
                episode = produced.episode
                tock = time.perf_counter()
                targets = episode_targets(episode, produced.bootstrap, plan.gamma, plan.lam,
                                          job.advantage_norm)
                gradients = _gradients(plan, episode, targets, config, produced.index,
                                       methods[produced.index % len(methods)])
                tack = time.perf_counter()
                writes.submit(_rows(episode, targets, produced.index,
                                    plan.all_scenes.index(produced.scene)), *gradients)
                timings["episode_s"] += produced.seconds
                timings["wait_s"] += tock - tick
                timings["gradient_s"] += tack - tock
                tick = time.perf_counter()
                bar.update(len(episode))
            writes.wait()
    finally:
        writes.close()
    timings["write_s"], timings["write_wait_s"] = writes.seconds, writes.waited
    return {key: round(value, 3) for key, value in timings.items()}


def _gradients(plan: CapturePlan, episode: Any, targets: dict[str, np.ndarray],
               config: CaptureConfig, episode_index: int, method: StepGradients
               ) -> tuple[np.ndarray, np.ndarray | None]:
    """The episode's per-step gradients in the stored dtype, and the factors of the weights
    stored factored (float32 rows are `method`'s buffers: valid until its next call, which
    comes after they are written)."""
    batch = StepBatch(images=torch.from_numpy(episode.images),
                      actions=torch.from_numpy(episode.actions),
                      advantages=torch.from_numpy(targets["advantages"]),
                      returns=torch.from_numpy(targets["returns"]),
                      old_log_probs=torch.from_numpy(episode.log_probs),
                      goals=torch.from_numpy(episode.goals),
                      hidden=None if episode.hidden is None else torch.from_numpy(episode.hidden))
    gradients = method(plan.victim, batch, plan.coefficients, plan.layers,
                       ppo=plan.algorithm == "ppo")
    rows, factors = (gradients.dense, gradients.packed) \
        if isinstance(gradients, FactoredRows) else (gradients, None)
    peak = max(_peak(part) for part in [rows] + ([] if factors is None else [factors]))
    if not math.isfinite(peak):
        raise CaptureFileError(f"{plan.out}: episode {episode_index} produced non-finite "
                               "gradients; the victim checkpoint θ0 is probably diverged")
    if config.gradient_dtype == "float32":
        return rows.numpy(), None if factors is None else factors.numpy()
    if peak > FLOAT16_MAX:
        raise CaptureFileError(f"{plan.out}: episode {episode_index} has a gradient entry of "
                               f"{peak:.3g}, beyond float16's range")
    return rows.to(torch.float16).numpy(), None  # torch's cast is ~5x faster than numpy's


def _peak(values: torch.Tensor) -> float:
    """max |v| in one pass, no |v| temporary (a copy of every row would cost as much as forming
    them); NaN propagates, ±Inf shows in one of the two ends."""
    if not values.numel():
        return 0.0
    low, high = torch.aminmax(values)
    return max(float(high), -float(low))


def _rows(episode: Any, targets: dict[str, np.ndarray], episode_index: int, scene_id: int
          ) -> dict[str, np.ndarray]:
    n = len(episode)
    dones = np.zeros(n, bool)
    dones[-1] = True
    terminated = np.zeros(n, bool)
    terminated[-1] = episode.terminated
    recurrent = {} if episode.hidden is None else {"hidden_states": episode.hidden}
    return {**recurrent, "images": episode.images, "goals": episode.goals,
            "actions": episode.actions,
            "rewards": episode.rewards, "values": episode.values,
            "log_probs": episode.log_probs, "probs": episode.probs, **targets,
            "dones": dones, "terminated": terminated,
            "episode_ids": np.full(n, episode_index, np.int64),
            "scene_ids": np.full(n, scene_id, np.int32),
            "step_in_episode": np.arange(n, dtype=np.int32)}


def _count_episodes(path: Path) -> int:
    import h5py

    with h5py.File(path, "r") as handle:
        return int(handle.attrs["num_episodes"])
