"""What a capture decides before touching the environment or the file: the job, every argument
checked, the victim and the learning rule the client declared, this shard's scenes, steps and seed,
and the attributes the file will carry (docs/data-format.md)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradleak import __version__
from gradleak.capture.config import CaptureSetup
from gradleak.capture.grads import GRADIENT_METHODS, StepBatch, StepGradients, factorable_weights
from gradleak.capture.layout import mark_layout
from gradleak.capture.storage import check_compression
from gradleak.capture.schema import FORMAT, FORMAT_VERSION, layers_to_json
from gradleak.capture.writer import partial_path
from gradleak.envs.factory import num_actions, scene_catalog, scene_names
from gradleak.envs.scenes import SceneCatalog
from gradleak.errors import CheckpointError, ConfigError
from gradleak.io import check_output, load_victim, theta_sha256, victim_directory
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






GRADIENT_DTYPES = ("float16", "float32")



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



@dataclass
class CapturePlan:
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
    factored: list[str] = dataclasses.field(default_factory=list)  # stored as their factors
    catalog: SceneCatalog | None = None  # the maps the scenes came from (None: a gym backend)



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



def plan_capture(job: CaptureJob) -> CapturePlan:
    _check_job(job)
    if job.preset.capture.gradient_method not in GRADIENT_METHODS:
        raise ConfigError(f"capture.gradient_method={job.preset.capture.gradient_method!r}: "
                          f"expected one of {', '.join(GRADIENT_METHODS)}")
    check_compression(job.preset.capture.compression)
    dtype = job.preset.capture.gradient_dtype
    if dtype not in GRADIENT_DTYPES:
        raise ConfigError(f"capture.gradient_dtype={dtype!r}: expected one of "
                          f"{', '.join(GRADIENT_DTYPES)}")
    preset, (shard_index, shard_count) = job.preset, job.shard
    victim, algorithm, coefficients, gamma, lam = _victim_and_rule(job)
    layers = layer_table(victim, tuple(preset.capture.components))
    catalog = scene_catalog(preset.env)
    all_scenes = scene_names(preset.env, job.split, catalog)
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
    factored = _factored(victim, layers, preset.capture)
    if factored:  # likewise
        settings["factored_layers"] = factored
    attrs = capture_attributes(victim, layers, algorithm, coefficients, gamma, lam,
                               job.advantage_norm, settings, all_scenes, str(job.victim))
    mark_layout(attrs, factored)
    steps = shard_steps(job.steps, job.shard)
    return CapturePlan(victim, algorithm, coefficients, gamma, lam, layers, scenes, all_scenes,
                       steps, seed, shard_index, shard_output(job.out, job.shard), attrs,
                       factored, catalog)


def _factored(victim: Victim, layers: list[Any], config: Any) -> list[str]:
    """The Linear weights stored as their factors (capture.factor_linear): float32 rows by the
    einsum method only, where reading them back gives the very bits sent."""
    if not config.factor_linear or config.gradient_dtype != "float32" \
            or StepGradients(config.gradient_method).resolve(victim, layers) != "einsum":
        return []
    return factorable_weights(victim, layers, example_steps(victim))


def example_steps(victim: Victim, steps: int = 2) -> StepBatch:
    """Steps of blank frames: what shape each layer's input takes, whatever the content."""
    hidden = torch.zeros(steps, victim.hidden_size) if victim.recurrent else None
    goals = torch.zeros(steps, 3) if "goal" in victim.extra_inputs else None
    return StepBatch(torch.zeros(steps, *victim.input_transform.frame_shape, dtype=torch.uint8),
                     torch.zeros(steps, dtype=torch.int64), torch.ones(steps), torch.ones(steps),
                     torch.zeros(steps), goals, hidden)



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



def _env_settings(preset: CaptureSetup) -> dict[str, Any]:
    env = preset.env
    return {"backend": env.backend, "gym_id": env.gym_id, "doomnav": env.doomnav.to_dict()}
