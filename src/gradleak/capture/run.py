"""The capture job: episodes at θ0 → per-step gradients → one HDF5 file per shard."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from gradleak import __version__
from gradleak.capture.config import CaptureConfig, CaptureSetup
from gradleak.capture.episodes import episode_targets, run_episode
from gradleak.capture.grads import StepBatch, loop_gradients, per_step_gradients
from gradleak.capture.lock import capture_lock
from gradleak.capture.schema import FORMAT, FORMAT_VERSION, layers_to_json, step_columns
from gradleak.capture.writer import CaptureWriter, partial_path
from gradleak.envs.factory import make_env, num_actions, scene_names
from gradleak.errors import CaptureFileError, CheckpointError, ConfigError, GradleakError
from gradleak.io import (
    check_output,
    created_directories,
    load_victim,
    theta_sha256,
    victim_directory,
    write_json,
)
from gradleak.rl.losses import LOSS_KEYS, LossCoefficients, advantage_text, parse_advantage_norm
from gradleak.rl.trainer import ALGORITHMS
from gradleak.victims.base import (
    COMPONENTS,
    VICTIMS,
    Victim,
    VictimConfig,
    create_victim,
    layer_table,
)

SPLITS = ("train", "heldout")
GRADIENT_METHODS = ("vmap", "loop")
GRADIENT_DTYPES = ("float16", "float32")
FLOAT16_MAX = 65504.0


@dataclass
class CaptureJob:
    victim: str  # a checkpoint directory, or a registry name with random_init
    split: str
    steps: int
    out: Path
    preset: CaptureSetup
    random_init: bool = False
    algorithm: str = "ppo"  # used with random_init; a checkpoint carries its own
    shard: tuple[int, int] = (0, 1)
    resume: bool = False
    overwrite: bool = False
    progress: bool = True
    seed: int | None = None  # None: the preset's capture seed
    # The loss the client really used (`--loss`): keys of rl.losses.LOSS_KEYS. A checkpoint's
    # own declaration (its preset's train section) fills the keys not given; a checkpoint
    # without one must be given all of them.
    loss: dict[str, float] | None = None
    advantage_norm: str = "episode"  # rl.losses.ADVANTAGE_NORMS


def parse_shard(text: str) -> tuple[int, int]:
    index, sep, count = text.partition("/")
    if not (sep and index.isdigit() and count.isdigit()) or not 0 <= int(index) < int(count):
        raise ConfigError(f"--shard {text!r}: expected i/n with 0 <= i < n, e.g. 0/4")
    return int(index), int(count)


def shard_output(out: Path, shard: tuple[int, int]) -> Path:
    if shard[1] == 1:
        return out
    return out.with_name(f"{out.stem}.shard-{shard[0]}-of-{shard[1]}{out.suffix}")


def _victim_and_rule(job: CaptureJob) -> tuple[Victim, str, LossCoefficients, float, float]:
    preset = job.preset
    if parse_advantage_norm(job.advantage_norm)[0] == "rollout":
        raise ConfigError("--advantage-norm rollout: a capture records episode by episode and "
                          "has no rollout to normalise over; record the client's own rollouts "
                          "with gradleak.capture.record(..., advantage_norm='rollout')")
    if job.random_init:
        if job.victim not in VICTIMS:
            raise ConfigError(f"--random-init needs a victim name ({', '.join(VICTIMS.names())}), "
                              f"got {job.victim!r}")
        if job.algorithm not in ALGORITHMS:
            raise ConfigError(f"--algo {job.algorithm!r}: expected one of {', '.join(ALGORITHMS)}")
        torch.manual_seed(job.seed if job.seed is not None else preset.capture.seed)
        config = VictimConfig(job.victim, preset.env.doomnav.frame_size, num_actions(preset.env))
        victim = create_victim(config).eval()
        t = preset.train  # the preset declares the rule of a model it creates
        declared = {"value": t.value_coef, "entropy": t.entropy_coef, "clip": t.clip,
                    "gamma": t.gamma, "lam": t.lam}
        return (victim, job.algorithm, *_rule({**declared, **(job.loss or {})}))
    victim, meta = load_victim(job.victim)
    for name, tensor in victim.state_dict().items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"victim checkpoint {job.victim}: tensor {name} holds NaN/Inf "
                                  "values (a diverged training run?)")
    if victim.config.frame_size != preset.env.doomnav.frame_size:
        raise ConfigError(f"victim {job.victim} takes {victim.config.frame_size}x"
                          f"{victim.config.frame_size} frames but the preset renders "
                          f"{preset.env.doomnav.frame_size}x{preset.env.doomnav.frame_size}")
    if victim.config.num_actions != num_actions(preset.env):
        raise ConfigError(f"victim {job.victim} has {victim.config.num_actions} actions but the "
                          f"environment has {num_actions(preset.env)}")
    declared = {**_checkpoint_rule(job.victim, meta), **(job.loss or {})}
    missing = [key for key in LOSS_KEYS if key not in declared]
    if missing:
        raise ConfigError(f"victim config {victim_directory(job.victim) / 'victim.json'} "
                          "declares no learning rule (no 'preset'): declare the loss the client "
                          f"used, --loss {','.join(f'{k}=...' for k in LOSS_KEYS)} (missing "
                          f"{', '.join(missing)})")
    return (victim, meta.get("algorithm", "ppo"), *_rule(declared))


def _rule(declared: dict[str, float]) -> tuple[LossCoefficients, float, float]:
    return (LossCoefficients(value=declared["value"], entropy=declared["entropy"],
                             clip=declared["clip"]), declared["gamma"], declared["lam"])


# a checkpoint's preset names the rule's parts as the trainer's config does
TRAIN_FIELDS = {"value": "value_coef", "entropy": "entropy_coef", "clip": "clip",
                "gamma": "gamma", "lam": "lam"}


def _checkpoint_rule(source: str, meta: dict[str, Any]) -> dict[str, float]:
    """The learning rule a checkpoint declares (its preset's `train` section), or {} when it
    declares none; a malformed declaration is named."""
    where = f"victim config {victim_directory(source) / 'victim.json'}"
    if "preset" not in meta:
        return {}
    preset = meta["preset"]
    train = preset.get("train", {}) if isinstance(preset, dict) else None
    if not isinstance(train, dict):
        raise CheckpointError(f"{where}: field 'preset' is malformed (expected an object with "
                              "a 'train' object)")
    rule = {}
    for key, field in TRAIN_FIELDS.items():
        if field not in train:
            continue  # --loss must give it, or the capture is refused
        value = train[field]
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise CheckpointError(f"{where}: field 'preset.train.{field}' is {value!r}, "
                                  "expected a finite number")
        rule[key] = float(value)
    return rule


def _shard_scenes(scenes: list[str], shard: tuple[int, int]) -> list[str]:
    index, count = shard
    # Fewer scenes than shards (one generic environment): every shard uses all of them and
    # differs only in its seeds.
    return scenes[index::count] if len(scenes) >= count else scenes


def episode_seed(seed: int, shard: int, episode: int) -> int:
    return int(np.random.SeedSequence([seed, shard, episode]).generate_state(1)[0])


@dataclass
class _Plan:
    """Everything a capture decides before touching the environment or the file."""

    victim: Victim
    algorithm: str
    coefficients: LossCoefficients
    gamma: float
    lam: float
    layers: list[Any]
    scenes: list[str]  # this shard's scenes
    all_scenes: list[str]  # the split's scenes: scene_ids index into these
    steps: int  # this shard's steps
    seed: int
    shard_index: int
    out: Path
    attrs: dict[str, Any]


def _check_job(job: CaptureJob) -> None:
    """Every argument, before the victim is loaded or the disk touched."""
    if job.split not in SPLITS:
        raise ConfigError(f"--scenes {job.split!r}: expected one of {', '.join(SPLITS)}")
    if job.steps <= 0:
        raise ConfigError(f"--steps {job.steps}: expected a positive number of steps")
    if job.seed is not None and job.seed < 0:
        raise ConfigError(f"--seed {job.seed}: expected a non-negative integer")
    job.preset.validate()
    if shard_steps(job.steps, job.shard) == 0:
        index, count = job.shard
        raise ConfigError(f"--shard {index}/{count} gets none of the {job.steps} steps (--steps "
                          f"must be at least the number of shards, {count})")
    if not job.preset.capture.components:
        raise ConfigError("--components: expected some of " + ",".join(COMPONENTS))
    out = shard_output(job.out, job.shard)
    check_output(out, "--out")
    check_output(partial_path(out), "--out")


def shard_steps(steps: int, shard: tuple[int, int]) -> int:
    """This shard's part of `steps`: the first `steps % n` shards take one more."""
    index, count = shard
    return steps // count + (1 if index < steps % count else 0)


def _plan(job: CaptureJob) -> _Plan:
    _check_job(job)
    if job.preset.capture.gradient_method not in GRADIENT_METHODS:
        raise ConfigError(f"capture.gradient_method={job.preset.capture.gradient_method!r}: "
                          f"expected one of {', '.join(GRADIENT_METHODS)}")
    dtype = job.preset.capture.gradient_dtype
    if dtype not in GRADIENT_DTYPES:
        raise ConfigError(f"capture.gradient_dtype={dtype!r}: expected one of "
                          f"{', '.join(GRADIENT_DTYPES)}")
    preset, (shard_index, shard_count) = job.preset, job.shard
    victim, algorithm, coefficients, gamma, lam = _victim_and_rule(job)
    layers = layer_table(victim, tuple(preset.capture.components))
    all_scenes = scene_names(preset.env, job.split)
    scenes = _shard_scenes(all_scenes, job.shard)
    seed = job.seed if job.seed is not None else preset.capture.seed
    settings = {"theta0_sha256": theta_sha256(victim), "victim_config": victim.config.to_dict(),
                "algorithm": algorithm, "loss": coefficients.to_dict(), "gamma": gamma,
                "lam": lam, "split": job.split, "scenes": scenes,
                "components": list(preset.capture.components), "seed": seed,
                "shard": [shard_index, shard_count], "env": _env_settings(preset)}
    if dtype != "float16":  # only when set, so captures made before the option still resume
        settings["gradient_dtype"] = dtype
    if job.advantage_norm != "episode":  # likewise
        settings["advantage_norm"] = job.advantage_norm
    attrs = capture_attributes(victim, layers, algorithm, coefficients, gamma, lam,
                               job.advantage_norm, settings, all_scenes, str(job.victim))
    steps = shard_steps(job.steps, job.shard)
    return _Plan(victim, algorithm, coefficients, gamma, lam, layers, scenes, all_scenes, steps,
                 seed, shard_index, shard_output(job.out, job.shard), attrs)


def capture_attributes(victim: Victim, layers: list[Any], algorithm: str,
                       coefficients: LossCoefficients, gamma: float, lam: float,
                       advantage_norm: str, settings: dict[str, Any], all_scenes: list[str],
                       source: str) -> dict[str, Any]:
    """The file's attributes (docs/data-format.md) from what a capture decided; `settings`
    holds the split, scenes, components, seed, shard and environment, and is what a resume
    must match."""
    index, count = settings["shard"]
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "victim": victim.config.name,
            "victim_config": json.dumps(victim.config.to_dict()),
            "theta0_sha256": settings["theta0_sha256"], "algorithm": algorithm,
            "loss": json.dumps({**coefficients.to_dict(), "gamma": gamma, "lam": lam,
                                "advantage_normalisation": advantage_text(advantage_norm)}),
            "layer_table": layers_to_json(layers), "roles": victim.roles().to_json(),
            "components": json.dumps(settings["components"]),
            "scenes": json.dumps(settings["scenes"]), "all_scenes": json.dumps(all_scenes),
            "split": settings["split"], "shard": f"{index}/{count}",
            "gradient_dim": sum(layer.size for layer in layers),
            "hidden_size": victim.hidden_size, "env_config": json.dumps(settings["env"]),
            "seed": settings["seed"], "gradleak_version": __version__, "source": source,
            "settings": json.dumps(settings, sort_keys=True)}


def run_capture(job: CaptureJob) -> dict[str, Any]:
    plan = _plan(job)
    with created_directories(plan.out.parent), capture_lock(plan.out, partial_path(plan.out)):
        result = _run_locked(plan, job)
    if result["status"] == "complete":
        write_json(plan.out.with_name(plan.out.name + ".json"),
                   {"command": "capture", "victim": job.victim, "random_init": job.random_init,
                    "split": job.split, "steps": job.steps, "shard": list(job.shard),
                    "seed": plan.seed, "preset": job.preset.to_dict(), "result": result})
    return result


def _run_locked(plan: _Plan, job: CaptureJob) -> dict[str, Any]:
    env = make_env(job.preset.env, plan.scenes, job.preset.env.doomnav.max_steps)
    try:
        # Start the engine before the HDF5 file is opened: its process would otherwise inherit
        # the file's descriptor and lock, and outlive a killed capture holding both.
        env.reset(seed=plan.seed)
        theta0 = {k: v.detach().numpy() for k, v in plan.victim.state_dict().items()}
        victim = plan.victim
        columns = step_columns(victim.input_transform.frame_shape, victim.config.num_actions,
                               victim.hidden_size)
        writer = CaptureWriter(plan.out, plan.attrs, columns, plan.attrs["gradient_dim"],
                               theta0, job.resume, job.overwrite,
                               gradient_dtype=job.preset.capture.gradient_dtype,
                               steps=plan.steps)
        if writer.already_complete:
            return {"out": str(plan.out), "status": "already complete"}
        try:
            timings = _capture_loop(plan, env, writer, job)
        except GradleakError:
            writer.discard()  # a deterministic failure: resuming would only repeat it
            raise
        finally:
            writer.close()  # after a crash or Ctrl-C the partial file stays, resumable
    finally:
        env.close()
    writer.finish()
    return {"out": str(plan.out), "status": "complete", "steps": plan.steps,
            "episodes": _count_episodes(plan.out), **timings}


def _capture_loop(plan: _Plan, env: Any, writer: CaptureWriter, job: CaptureJob
                  ) -> dict[str, float]:
    max_steps = job.preset.env.doomnav.max_steps
    timings = {"episode_s": 0.0, "gradient_s": 0.0, "write_s": 0.0}
    with tqdm(total=plan.steps, initial=min(writer.num_rows, plan.steps), unit="step",
              disable=not job.progress, desc=f"capture {job.split}") as bar:
        while writer.num_rows < plan.steps:
            index = writer.num_episodes
            scene = plan.scenes[index % len(plan.scenes)]
            seed = episode_seed(plan.seed, plan.shard_index, index)
            tick = time.perf_counter()
            episode, bootstrap = run_episode(env, plan.victim, seed, scene,
                                             min(max_steps, plan.steps - writer.num_rows),
                                             torch.Generator().manual_seed(seed))
            targets = episode_targets(episode, bootstrap, plan.gamma, plan.lam,
                                      job.advantage_norm)
            tock = time.perf_counter()
            gradients = _gradients(plan, episode, targets, job.preset.capture, index)
            tack = time.perf_counter()
            writer.append_episode(_rows(episode, targets, index, plan.all_scenes.index(scene)),
                                  gradients)
            timings["episode_s"] += tock - tick
            timings["gradient_s"] += tack - tock
            timings["write_s"] += time.perf_counter() - tack
            bar.update(len(episode))
    return {key: round(value, 3) for key, value in timings.items()}


def _env_settings(preset: CaptureSetup) -> dict[str, Any]:
    env = preset.env
    return {"backend": env.backend, "gym_id": env.gym_id, "doomnav": env.doomnav.to_dict()}


def _gradients(plan: _Plan, episode: Any, targets: dict[str, np.ndarray],
               config: CaptureConfig, episode_index: int) -> np.ndarray:
    batch = StepBatch(images=torch.from_numpy(episode.images),
                      actions=torch.from_numpy(episode.actions),
                      advantages=torch.from_numpy(targets["advantages"]),
                      returns=torch.from_numpy(targets["returns"]),
                      old_log_probs=torch.from_numpy(episode.log_probs),
                      goals=torch.from_numpy(episode.goals),
                      hidden=None if episode.hidden is None else torch.from_numpy(episode.hidden))
    ppo = plan.algorithm == "ppo"
    if config.gradient_method == "loop":
        gradients = loop_gradients(plan.victim, batch, plan.coefficients, plan.layers, ppo=ppo)
    else:
        gradients = per_step_gradients(plan.victim, batch, plan.coefficients, plan.layers,
                                       ppo=ppo, chunk=config.chunk)
    out = plan.out
    peak = float(gradients.abs().amax()) if gradients.numel() else 0.0  # NaN/Inf propagate
    if not math.isfinite(peak):
        raise CaptureFileError(f"{out}: episode {episode_index} produced non-finite gradients; "
                               "the victim checkpoint θ0 is probably diverged")
    if config.gradient_dtype == "float32":
        return gradients.numpy()
    if peak > FLOAT16_MAX:
        raise CaptureFileError(f"{out}: episode {episode_index} has a gradient entry of "
                               f"{peak:.3g}, beyond float16's range")
    return gradients.to(torch.float16).numpy()  # torch's cast is ~5x faster than numpy's


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
