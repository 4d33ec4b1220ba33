"""The named presets (`cpu-quick`, `cpu-bench`, `paper`): every stage's config assembled.

Each stage owns its config (envs.config, rl.config, capture.config, the attacks' and fits'
own); only this module, the CLI and the demo put them together. `EnvConfig`, `TrainConfig` and
`CaptureConfig` are re-exported here for callers that build a preset.

Every command writes the resolved config as JSON next to its output, so a run can be repeated
from that file alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import asdict, dataclass, field
from typing import Any

from gradleak.attacks.defense_aware import DefenseAwareConfig
from gradleak.attacks.exact import ExactConfig
from gradleak.attacks.feature_decoder import DecoderConfig
from gradleak.attacks.frame_refiner import RefinerConfig
from gradleak.attacks.lti import LtiConfig
from gradleak.attacks.optim.config import OptimConfig, deep_leakage, inverting_gradients
from gradleak.attacks.trace import TraceConfig
from gradleak.capture.config import CaptureConfig
from gradleak.config import dataclass_from_dict
from gradleak.envs.config import EnvConfig
from gradleak.envs.doomnav import DoomNavConfig
from gradleak.errors import ConfigError
from gradleak.inversion.frame_solve import PRECISIONS
from gradleak.names import renamed_sections, section_path
from gradleak.registry import Registry
from gradleak.rl.config import TrainConfig
from gradleak.training.checkpoint import MODELS
from gradleak.training.decoder_config import DecoderFitConfig
from gradleak.training.fit import FitConfig
from gradleak.training.objectives import FIT_KINDS, PERCEPTUAL_TERMS, LossWeights
from gradleak.training.refiner_fit import RefinerFitConfig
from gradleak.victims.base import COMPONENTS

LEARNED = ("trace", "lti", "decoder")  # the learned attackers' sections: KIND and KIND_fit


@dataclass
class AttackConfig:
    """The learned attackers and how they are fitted on auxiliary (training-scene) captures."""

    trace: TraceConfig = field(default_factory=TraceConfig)
    trace_fit: FitConfig = field(default_factory=FitConfig)
    lti: LtiConfig = field(default_factory=LtiConfig)
    lti_fit: FitConfig = field(default_factory=lambda: FitConfig(
        epochs=200, batch_size=64, accumulation=1, lr=1e-3, warmup_epochs=1, rollout_steps=0,
        teacher_forcing_epochs=0, weights=LossWeights(perceptual=0.0, rollout=0.0)))
    # Analytic recovery + a decoder trained on auxiliary frames (no gradients needed).
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    decoder_fit: DecoderFitConfig = field(default_factory=DecoderFitConfig)
    # The optimisation baselines; their probe-loss variants start from these too.
    ig: OptimConfig = field(default_factory=inverting_gradients)
    dlg: OptimConfig = field(default_factory=deep_leakage)
    # The training-free attack: the conv stack, then the first conv's own equations.
    training_free: ExactConfig = field(default_factory=ExactConfig)
    # What the defense-aware attack adds to it under a declared defense.
    defense_aware: DefenseAwareConfig = field(default_factory=DefenseAwareConfig)
    # Its learned prior, fitted on the attack's frames of the attacker's own captures.
    prior: RefinerConfig = field(default_factory=RefinerConfig)
    prior_fit: RefinerFitConfig = field(default_factory=RefinerFitConfig)

    def learned(self, kind: str) -> tuple[Any, Any]:
        """A learned attacker's model settings and fit schedule, the one way to both: `trace`,
        `lti`, `decoder` from their sections here; a window attacker a plugin registered
        (`training.objectives.window_attacker`) with its settings' defaults and `FitConfig`'s."""
        if kind in LEARNED:
            return getattr(self, kind), getattr(self, f"{kind}_fit")
        if kind in FIT_KINDS:
            return MODELS.get(kind)[1](), FitConfig()
        raise ConfigError(f"learned attacker {kind!r}: expected one of "
                          f"{', '.join(sorted({*LEARNED, *FIT_KINDS}))}")


@dataclass
class Preset:
    name: str
    env: EnvConfig = field(default_factory=EnvConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def validate(self, source: str = "preset") -> Preset:
        return validate_preset(self, source)


PRESETS: Registry[Any] = Registry("preset")


def with_iterations(config: OptimConfig, iterations: int) -> OptimConfig:
    config.iterations = iterations
    return config


@PRESETS.register("cpu-quick")
def cpu_quick() -> Preset:
    """The demo: a few minutes on 2 CPU cores end to end."""
    env = EnvConfig(train_maps=["MAP01", "MAP04", "MAP07"], heldout_maps=["MAP05", "MAP11"],
                    max_regions_per_map=3)
    train = TrainConfig(num_envs=4, updates=6)
    quick = dict(warmup_epochs=1, min_lr=1e-5, accumulation=1, max_val_windows=32,
                 normaliser_rows=1024)
    attack = AttackConfig(
        trace=TraceConfig(subsample_fraction=0.05, encoder_width=256, encoder_blocks=1,
                          latent=128, image_channels=8, dropout=0.0),
        # 1 - SSIM keeps the demo within its minutes: LPIPS-VGG costs 3.7 s per 64 frames
        # (forward and backward) on 2 cores, LPIPS-Alex 0.14 s; the metric is LPIPS-Alex still
        # TRACE about 4 min and LtI 1.5 min: the demo's ten minutes lead with the
        # training-free attack, which needs no training at all
        trace_fit=FitConfig(epochs=6, lr=2e-3, teacher_forcing_epochs=2, rollout_steps=2,
                            max_train_windows=384, perceptual="ssim", **quick),
        lti=LtiConfig(hidden=512),
        lti_fit=FitConfig(epochs=6, batch_size=32, lr=1e-3, teacher_forcing_epochs=0,
                          rollout_steps=0, weights=LossWeights(perceptual=0.0, rollout=0.0),
                          max_train_windows=2048, **quick),
        decoder=DecoderConfig(channels=64, global_channels=16),
        decoder_fit=DecoderFitConfig(epochs=4, extra_frames=4096),
        ig=with_iterations(inverting_gradients(), 200),
        dlg=with_iterations(deep_leakage(), 200))
    return Preset("cpu-quick", env, train, CaptureConfig(steps_train=4096, steps_heldout=1024),
                  attack)


@PRESETS.register("cpu-bench")
def cpu_bench() -> Preset:
    """Benchmarks: every training and held-out map at 64x64, about an hour of CPU in all."""
    env = EnvConfig()
    train = TrainConfig(updates=150)
    # Sized for about an hour of training per attacker on 2 cores (measured: TRACE 1.1 s per
    # step of 8 windows x 8 frames; LtI 0.7 s per step of 64 frames).
    bench = dict(min_lr=1e-5, accumulation=1)
    attack = AttackConfig(
        trace=TraceConfig(layers=4, heads=8, dropout=0.05),
        # LPIPS-Alex: the paper's LPIPS-VGG would be 26x the perceptual term's cost on 2 cores
        trace_fit=FitConfig(epochs=6, lr=1e-3, warmup_epochs=0.3, teacher_forcing_epochs=2,
                            max_train_windows=4000, perceptual="alex", **bench),
        lti=LtiConfig(hidden=1500),
        lti_fit=FitConfig(epochs=15, batch_size=64, lr=1e-3, warmup_epochs=0.3,
                          teacher_forcing_epochs=0, rollout_steps=0,
                          weights=LossWeights(perceptual=0.0, rollout=0.0), **bench),
        # About 0.4 s per step of 64 frames on 2 cores: 4 epochs of ~40k frames ≈ 15 min.
        decoder=DecoderConfig(channels=64),
        decoder_fit=DecoderFitConfig(epochs=4),
        ig=with_iterations(inverting_gradients(), 1200),
        dlg=with_iterations(deep_leakage(), 1200))
    return Preset("cpu-bench", env, train, CaptureConfig(steps_train=20_000, steps_heldout=4_000),
                  attack)


@PRESETS.register("paper")
def paper() -> Preset:
    """The paper's setting: 84x84, the full CNN, 500 PPO updates of 1024 steps."""
    env = EnvConfig(doomnav=DoomNavConfig(frame_size=84))
    train = TrainConfig(victim="cnn", updates=500, max_episode_steps=200)
    attack = AttackConfig(
        trace=TraceConfig(projection="dense", encoder_width=2048, encoder_blocks=4,
                          latent=1024, layers=6, heads=8, image_channels=64),
        # 50 epochs, batch 8 x 2, AdamW 1e-4, τ = 5, β 0.1 → 0.8, R = 3, LPIPS-VGG at weight
        # 0.2. One loader process kept an H200 waiting for data half of every epoch
        # (benchmarks/results/gpu_check.json): a window is 19 MB of compressed float32 rows.
        trace_fit=FitConfig(workers=6),
        decoder=DecoderConfig(channels=256, global_channels=64),
        decoder_fit=DecoderFitConfig(epochs=40, extra_frames=200_000))
    return Preset("paper", env, train, CaptureConfig(steps_train=108_000, steps_heldout=12_000),
                  attack)


def load_preset(name: str, overrides: list[str] | None = None) -> Preset:
    """The named preset after `overrides` (`section.field=value`), checked whole."""
    preset = PRESETS.get(name)()
    for assignment in overrides or []:
        apply_override(preset, assignment)
    return validate_preset(preset, "--set" if overrides else f"preset {name}")


def apply_override(config: Any, assignment: str) -> None:
    """`train.updates=3` or `env.doomnav.frame_size=84`: typed by the field's current value."""
    path, sep, text = assignment.partition("=")
    if not sep:
        raise ConfigError(f"override {assignment!r}: expected section.field=value")
    path = section_path(path.strip())  # old names (attack.exact.rounds, ...) still read
    _assign(config, path.split("."), text.strip(), path, assignment)


def _assign(target: Any, parts: list[str], text: str, path: str, assignment: str) -> Any:
    """`target` with the field `parts` leads to set from `text`: changed in place, or a
    changed copy where it is frozen (`attack.training_free.solve` is a `FrameSolve`)."""
    current = _field(target, parts[0], path)
    if len(parts) > 1:
        value = _assign(current, parts[1:], text, path, assignment)
    elif dataclasses.is_dataclass(current):
        example = dataclasses.fields(current)[0].name
        raise ConfigError(f"override {assignment!r}: {path} is a section, not a value; "
                          f"set one of its fields, e.g. {path}.{example}=...")
    else:
        try:
            hint = typing.get_type_hints(type(target)).get(parts[0])
        except NameError:  # an annotation only a type checker resolves: parse by example
            hint = None
        value = _parse_like(current, text, path, hint)
    if type(target).__dataclass_params__.frozen:
        return dataclasses.replace(target, **{parts[0]: value})
    setattr(target, parts[0], value)
    return target


def _field(obj: Any, name: str, path: str) -> Any:
    if not dataclasses.is_dataclass(obj) or name not in {f.name for f in dataclasses.fields(obj)}:
        raise ConfigError(f"override {path!r}: no field {name!r} there")
    return getattr(obj, name)


def _parse_like(current: Any, text: str, path: str, hint: Any = None) -> Any:
    """The text as the field's declared type (`hint`, from the dataclass), else its current
    value's: `feature_shape=16,8,8` is a list of ints, an optional int's `-1` is an int."""
    options = [a for a in typing.get_args(hint) if a is not type(None)] \
        if typing.get_origin(hint) in (typing.Union, types.UnionType) else []
    try:
        if options and text.lower() == "none":
            return None
        if options:
            return _parse_like(_example(options[0]), text, path, options[0])
        if isinstance(current, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if isinstance(current, list):
            item = (typing.get_args(hint) or (str,))[0]
            return [item(part.strip()) for part in text.split(",") if part.strip()]
        if current is None:  # an optional field without a declared type
            if text.lower() == "none":
                return None
            return json.loads(text) if text[:1].isdigit() or text[:1] == "-" else text
        return type(current)(text)
    except ValueError:
        raise ConfigError(f"override {path}={text!r}: expected a value like "
                          f"{current!r}") from None


def _example(kind: Any) -> Any:
    """A value of a declared type, for parsing by example (list[int] → [])."""
    origin = typing.get_origin(kind) or kind
    return origin() if origin in (int, float, str, bool, list) else None


def preset_from_dict(data: dict[str, Any], source: str = "preset") -> Preset:
    """Rebuild a preset from its saved JSON (the reproducibility path)."""
    if not isinstance(data, dict) or not isinstance(data.get("name", ""), str):
        raise ConfigError(f"{source}: expected a preset object with a 'name'")
    data = {"name": "saved", **data}
    if isinstance(data.get("attack"), dict):  # saved before the sections were renamed
        data["attack"] = renamed_sections(data["attack"])
    return validate_preset(dataclass_from_dict(Preset, data, source), source)


# Settings that count something: each must be at least this (a 0 would fail deep inside the
# engine, a DataLoader or a vmap chunking loop, after minutes of work or not at all).
AT_LEAST = {"env.doomnav.frame_size": 16, "env.doomnav.max_steps": 1,
            "env.doomnav.num_actions": 1, "train.num_envs": 1, "train.rollout_steps": 1,
            "train.updates": 1, "train.epochs": 1, "train.minibatch": 1,
            "capture.steps_train": 1, "capture.steps_heldout": 1, "capture.chunk": 1}
POSITIVE_FIELDS = ("epochs", "batch_size", "accumulation", "chunk", "iterations", "window",
                     "restarts", "batch", "validate_every")
TIME_LIMITS = ("time_limit_minutes", "time_limit_s")  # None (no limit) or > 0
CHOICES = {"perceptual": PERCEPTUAL_TERMS, "precision": tuple(PRECISIONS)}  # named strings


def validate_preset(preset: Preset, source: str = "preset") -> Preset:
    """Counts at least 1 (or the minimum above), seeds non-negative, rates finite."""
    for path, value in _leaves(preset):
        where = f"{source} field {path}"
        choices = CHOICES.get(path.rsplit(".", 1)[-1])
        if isinstance(value, str) and choices and value not in choices:
            raise ConfigError(f"{where}={value!r}: expected one of {', '.join(choices)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            raise ConfigError(f"{where}={value!r}: expected a finite number")
        minimum = AT_LEAST.get(path)
        if minimum is None and path.rsplit(".", 1)[-1] in POSITIVE_FIELDS:
            minimum = 1
        if minimum is not None and value < minimum:
            raise ConfigError(f"{where}={value!r}: expected at least {minimum}")
        if path.rsplit(".", 1)[-1] in TIME_LIMITS and value <= 0:
            raise ConfigError(f"{where}={value!r}: expected a positive time limit (none: "
                              "leave it unset)")
        if path.rsplit(".", 1)[-1].endswith("seed") and value < 0:
            raise ConfigError(f"{where}={value!r}: expected a non-negative seed")
    for component in preset.capture.components:
        if component not in COMPONENTS:
            raise ConfigError(f"{source} field capture.components: {component!r} is not one of "
                              f"{', '.join(COMPONENTS)}")
    return preset


def _leaves(config: Any, prefix: str = "") -> list[tuple[str, Any]]:
    found = []
    for item in dataclasses.fields(config):
        value, path = getattr(config, item.name), f"{prefix}{item.name}"
        if dataclasses.is_dataclass(value):
            found += _leaves(value, path + ".")
        else:
            found.append((path, value))
    return found
