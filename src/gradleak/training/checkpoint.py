"""Attacker checkpoints: safetensors weights + JSON (model config, training config, the capture
fingerprint it was trained against, progress), and the optimiser state for resuming."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradleak.attacks.feature_decoder import DecoderConfig, FeatureDecoder
from gradleak.attacks.frame_refiner import FrameRefiner, RefinerConfig
from gradleak.config import dataclass_from_dict
from gradleak.errors import CheckpointError, ConfigError, TrainingError
from gradleak.io import duplicate_file, load_tensors, read_json, save_tensors, write_json
from gradleak.registry import Registry
from gradleak.training.data import CaptureFingerprint
from gradleak.victims.base import VictimConfig

FORMAT = "gradleak-attacker"
WEIGHTS, BEST, META, STATE = ("attacker.safetensors", "best.safetensors", "attacker.json",
                              "training_state.safetensors")

# every learned model a checkpoint may hold: its class and its settings' class. The window
# attackers (TRACE, LtI, a plugin's) register with their objective
# (`training.objectives.window_attacker`)
MODELS: Registry[tuple[type, type]] = Registry("learned attacker")
MODELS.register("decoder")((FeatureDecoder, DecoderConfig))
MODELS.register("refiner")((FrameRefiner, RefinerConfig))  # the training-free attack's prior


def display_name(kind: str) -> str:
    """What reports call an attacker kind: its model class's own name (TRACE, LtI, ...)."""
    return MODELS.get(kind)[0].name if kind in MODELS else kind


def build_model(kind: str, config: dict[str, Any], source: str = "model config") -> nn.Module:
    """The `kind` model from its saved settings, each checked: a setting this version does not
    know is refused, naming it (dropping it would build another model than the one saved)."""
    model_class, config_class = MODELS.get(kind)
    if not isinstance(config, dict):
        raise CheckpointError(f"{source}: expected an object of {kind} model settings")
    unknown = sorted(set(config) - {f.name for f in fields(config_class)})
    if unknown:
        raise CheckpointError(f"{source}: {', '.join(map(repr, unknown))} "
                              f"{'is not a setting' if len(unknown) == 1 else 'are not settings'}"
                              f" of the {kind} model ({config_class.__name__}): written by "
                              "another gradleak version; refit it, or remove the field if it "
                              "has no effect")
    return model_class(dataclass_from_dict(config_class, config, source))


def fingerprint_to_dict(fingerprint: CaptureFingerprint) -> dict[str, Any]:
    return {"theta0_sha256": fingerprint.theta0_sha256, "layer_table": fingerprint.layer_table,
            "victim": fingerprint.victim.to_dict()}


def fingerprint_from_dict(data: dict[str, Any]) -> CaptureFingerprint:
    return CaptureFingerprint(data["theta0_sha256"], data["layer_table"],
                              VictimConfig.from_dict(data["victim"]))


def save_attacker(out: Path, model: nn.Module, meta: dict[str, Any], best: bool) -> None:
    state = model.state_dict()
    for name, tensor in state.items():  # never overwrite a good checkpoint with a diverged one
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise TrainingError(f"attacker weight {name} became NaN/Inf at epoch "
                                f"{meta.get('epoch')}; stopped, {out} keeps the last good "
                                "checkpoint")
    save_tensors(out / WEIGHTS, state)
    if best:
        duplicate_file(out / WEIGHTS, out / BEST)
    write_json(out / META, {"format": FORMAT, **meta})


def save_training_state(out: Path, optimiser: torch.optim.Optimizer,
                        scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """Tensors to safetensors; returns the JSON part (param groups, scheduler position)."""
    state = optimiser.state_dict()
    tensors = {f"optimiser.{i}.{k}": v for i, slots in state["state"].items()
               for k, v in slots.items()}
    tensors["torch_rng"] = torch.get_rng_state()
    save_tensors(out / STATE, tensors)
    return {"param_groups": state["param_groups"], "scheduler": scheduler.state_dict()}


def load_training_state(out: Path, optimiser: torch.optim.Optimizer,
                        scheduler: torch.optim.lr_scheduler.LRScheduler,
                        saved: dict[str, Any]) -> None:
    tensors = load_tensors(out / STATE, "attacker training state")
    slots: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optimiser."):
            _, index, name = key.split(".", 2)
            slots.setdefault(int(index), {})[name] = value
    optimiser.load_state_dict({"state": slots, "param_groups": saved["param_groups"]})
    scheduler.load_state_dict(saved["scheduler"])
    torch.set_rng_state(tensors["torch_rng"])


def resume_run(out: Path, kind: str, model: nn.Module, optimiser: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, frame_size: int,
               fingerprint: CaptureFingerprint, model_config: dict[str, Any]
               ) -> tuple[int, float, list[dict[str, Any]], torch.Tensor]:
    """Weights, optimiser and scheduler back from a run directory; returns (epoch, best
    validation loss, history, mean training image). The run must continue on captures of the
    same victim, θ0 and layout, with the same model: anything else is refused, naming both."""
    meta = read_json(out / META, "attacker config")
    if meta.get("kind") != kind:
        raise CheckpointError(f"{out / META} holds a {meta.get('kind')!r} attacker, not "
                              f"{kind!r}")
    try:
        saved = fingerprint_from_dict(meta["fingerprint"])
    except (KeyError, TypeError, ConfigError) as err:
        raise CheckpointError(f"{out / META}: field 'fingerprint' is missing or malformed "
                              f"({err})") from None
    saved.check(fingerprint, f"--resume {out}: the training captures")
    requested = json.loads(json.dumps(model_config))
    differ = [key for key, value in requested.items()
              if key in meta.get("model", {}) and meta["model"][key] != value]
    if differ:
        key = differ[0]
        raise CheckpointError(f"--resume {out}: the attacker there has {key}="
                              f"{meta['model'][key]!r}, this run asks for {requested[key]!r} "
                              f"({len(differ)} model setting(s) differ: "
                              f"{', '.join(differ[:4])}); resume with the saved settings or "
                              "choose another --out")
    state = load_tensors(out / WEIGHTS, "attacker weights")
    check_finite_weights(state, out / WEIGHTS)
    model.load_state_dict(state)
    load_training_state(out, optimiser, scheduler, meta["training_state"])
    mean_image = torch.tensor(meta["mean_image"]).view(3, frame_size, frame_size)
    return int(meta["epoch"]), float(meta["best_val_loss"]), list(meta["history"]), mean_image


def load_attacker(path: str | Path, best: bool = True) -> tuple[nn.Module, dict[str, Any]]:
    """An attacker in eval mode from its run directory (the best weights by default)."""
    directory = Path(path)
    directory = directory.parent if directory.suffix in (".json", ".safetensors") else directory
    meta = read_json(directory / META, "attacker config")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{directory / META}: field 'format' is {meta.get('format')!r}, "
                              f"expected {FORMAT!r}")
    for key in ("kind", "model", "fingerprint"):
        if key not in meta:
            raise CheckpointError(f"{directory / META}: missing field {key!r}")
    model = build_model(meta["kind"], meta["model"], f"{directory / META}: field 'model'")
    weights = directory / (BEST if best and (directory / BEST).exists() else WEIGHTS)
    state = load_tensors(weights, "attacker weights")
    expected = model.state_dict()
    bad = sorted(set(expected) ^ set(state)) or sorted(
        k for k in expected if tuple(expected[k].shape) != tuple(state[k].shape))
    if bad:
        raise CheckpointError(f"{weights} does not match the {meta['kind']} model described in "
                              f"{directory / META} (first mismatch: {bad[0]})")
    check_finite_weights(state, weights)
    model.load_state_dict(state)
    return model.eval(), meta


def check_finite_loss(loss: torch.Tensor, out: Path, epoch: int, step: int) -> None:
    """Stop at the first non-finite loss: the checkpoint of the last whole epoch is kept."""
    if not bool(torch.isfinite(loss.detach()).all()):
        saved = read_json(out / META, "attacker config").get("epoch") if (out / META).is_file() \
            else None
        kept = (f"the last good checkpoint (epoch {saved}) is kept in {out}" if saved
                else "no checkpoint had been written yet")
        raise TrainingError(f"training loss became {float(loss.detach()):g} at epoch {epoch + 1}, "
                            f"step {step + 1}; stopped ({kept}). Lower the learning rate or "
                            "check the captures")


def check_finite_weights(state: dict[str, torch.Tensor], where: Path | str) -> None:
    """A diverged attacker scores a plausible-looking PSNR: refuse it rather than report it."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"{where}: tensor {name} holds NaN/Inf (a diverged training "
                                  "run); retrain, or resume from an earlier checkpoint")


def describe(meta: dict[str, Any]) -> str:
    return json.dumps({k: meta[k] for k in ("kind", "epoch") if k in meta})
