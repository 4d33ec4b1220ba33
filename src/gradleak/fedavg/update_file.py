"""One client's FedAvg update as a file: what a server recorded, for `gradleak fedavg-invert`.

A single safetensors file (so writing it is one atomic rename): tensors `w0/<name>` (the arrays
the server broadcast) and `wT/<name>` (the arrays the client sent back), under the model's own
state-dict names, and a metadata entry `gradleak` holding JSON:

    {"format": "gradleak-fedavg-update", "version": 1, "round": 1, "node_id": 7,
     "num_examples": 8, "config": {...sent with the round...},
     "metrics": {...the client's reply...}, "hyperparameters": {...declared...},
     "shape": [1, 28, 28], "input_transform": {"kind": "normalize", "mean": [0.5],
     "std": [0.5]}, "batchnorm": "train", "model": "net"}

Integer buffers (BatchNorm's counter) keep their dtype. Nothing in it is executable: `model` is
the name of a factory registered by a plugin the reader loaded itself (victims/factories.py),
and every field is checked, with the sizes an inversion would allocate bounded, before any
work.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradleak.errors import CheckpointError, ConfigError
from gradleak.io import existing_file, load_tensors, save_tensors, tensors_metadata

UPDATE_FORMAT = "gradleak-fedavg-update"
UPDATE_VERSION = 1
REQUIRED = ("round", "node_id", "num_examples", "shape")
# the images one inversion optimises, in values (num_examples × C × H × W): 512 MB as float32,
# several copies of which (the optimiser's, the gradients') the attacks hold at once
MAX_IMAGE_VALUES = 1 << 27


@dataclass
class UpdateFile:
    w0: dict[str, torch.Tensor]
    wT: dict[str, torch.Tensor]
    meta: dict[str, Any]


def as_tensors(state: Mapping[str, Any], field: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in state.items():
        if "/" in name:
            raise ConfigError(f"{field}[{name!r}]: '/' is reserved in update files")
        out[name] = value.detach().cpu() if isinstance(value, torch.Tensor) \
            else torch.from_numpy(np.ascontiguousarray(value))
    return out


def write_update(path: str | os.PathLike[str], w0: Mapping[str, Any], wT: Mapping[str, Any],
                 meta: Mapping[str, Any]) -> Path:
    check_meta(meta, "update metadata", ConfigError)
    tensors = {f"w0/{k}": v for k, v in as_tensors(w0, "w0").items()}
    tensors.update({f"wT/{k}": v for k, v in as_tensors(wT, "w_T").items()})
    header = {"format": UPDATE_FORMAT, "version": UPDATE_VERSION, **meta}
    save_tensors(path, tensors, {"gradleak": json.dumps(header, sort_keys=True)})
    return Path(path)


def read_update(path: str | os.PathLike[str]) -> UpdateFile:
    path = Path(path)
    tensors = load_tensors(path, "update file")
    meta = read_meta(path)
    w0 = {k[3:]: v for k, v in tensors.items() if k.startswith("w0/")}
    wT = {k[3:]: v for k, v in tensors.items() if k.startswith("wT/")}
    if set(w0) != set(wT) or not w0:
        raise CheckpointError(f"update file {path}: w0 and w_T name different arrays "
                              f"({len(w0)} and {len(wT)})")
    return UpdateFile(w0, wT, meta)


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """An update file's metadata, checked, from its header alone (no array is read)."""
    path = existing_file(path, "update file")
    raw = (tensors_metadata(path) or {}).get("gradleak")
    if raw is None:
        raise CheckpointError(f"update file {path} has no 'gradleak' metadata: it was not "
                              "written by gradleak (gradleak.integrations.flower or "
                              "gradleak.fedavg.write_update)")
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as error:
        raise CheckpointError(f"update file {path}: its metadata is not JSON ({error})") from None
    if not isinstance(meta, dict) or meta.get("format") != UPDATE_FORMAT:
        raise CheckpointError(f"update file {path}: format {meta.get('format')!r} "
                              f"(expected {UPDATE_FORMAT!r})" if isinstance(meta, dict)
                              else f"update file {path}: metadata is not an object")
    if meta.get("version") != UPDATE_VERSION:
        raise CheckpointError(f"update file {path}: version {meta.get('version')!r}, this "
                              f"gradleak reads version {UPDATE_VERSION}")
    check_meta(meta, f"update file {path}: metadata", CheckpointError)
    return meta


def check_meta(meta: Mapping[str, Any], source: str, error: type[Exception]) -> None:
    """Every field an inversion reads, with the sizes it would allocate bounded."""
    missing = [k for k in REQUIRED if k not in meta]
    if missing:
        raise error(f"{source} lacks {', '.join(missing)}")
    for key in ("round", "node_id", "num_examples"):
        value = meta[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < (key != "node_id"):
            raise error(f"{source}: {key} {value!r}: expected an integer >= "
                        f"{int(key != 'node_id')}")
    shape = meta["shape"]
    if not isinstance(shape, (list, tuple)) or len(shape) != 3 or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 4096 for n in shape):
        raise error(f"{source}: shape {shape!r}: expected [C, H, W] of positive sizes "
                    "(at most 4096 each)")
    values = meta["num_examples"] * shape[0] * shape[1] * shape[2]
    if values > MAX_IMAGE_VALUES:
        raise error(f"{source}: num_examples {meta['num_examples']:,} of shape {list(shape)} is "
                    f"{values:,} values to invert, more than the {MAX_IMAGE_VALUES:,} one "
                    "inversion holds in memory")
    for key in ("config", "hyperparameters", "metrics"):
        if not isinstance(meta.get(key, {}), dict):
            raise error(f"{source}: {key} {meta[key]!r:.80}: expected an object")
    if meta.get("batchnorm", "train") not in ("train", "eval"):
        raise error(f"{source}: batchnorm {meta['batchnorm']!r:.80}: expected train or eval")
    if not isinstance(meta.get("model") or "", str):
        raise error(f"{source}: model {meta['model']!r:.80}: expected the name of a registered "
                    "model factory")


def transform_from_dict(data: Any, source: str) -> Any:
    """The input transform a file declares: None, or a Normalize."""
    from gradleak.fedavg.invert import Normalize

    if data is None:
        return None
    if not isinstance(data, dict) or data.get("kind") != "normalize":
        raise ConfigError(f"{source}: input transform {data!r} is not one gradleak can rebuild "
                          "(only {'kind': 'normalize', 'mean': ..., 'std': ...}); pass "
                          "--input-transform")
    mean, std = data.get("mean", 0.0), data.get("std", 1.0)
    if not all(isinstance(v, (int, float, list)) for v in (mean, std)):
        raise ConfigError(f"{source}: input transform {data!r:.120}: mean and std must be "
                          "numbers or lists of numbers")
    return Normalize(tuple(mean) if isinstance(mean, list) else mean,
                     tuple(std) if isinstance(std, list) else std)
