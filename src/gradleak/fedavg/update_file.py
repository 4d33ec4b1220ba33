"""One client's FedAvg update as a file: what a server recorded, for `gradleak fedavg-invert`.

A single safetensors file (so writing it is one atomic rename): tensors `w0/<name>` (the arrays
the server broadcast) and `wT/<name>` (the arrays the client sent back), under the model's own
state-dict names, and a metadata entry `gradleak` holding JSON:

    {"format": "gradleak-fedavg-update", "version": 1, "round": 1, "node_id": 7,
     "num_examples": 8, "config": {...sent with the round...},
     "metrics": {...the client's reply...}, "hyperparameters": {...declared...},
     "shape": [1, 28, 28], "input_transform": {"kind": "normalize", "mean": [0.5],
     "std": [0.5]}, "batchnorm": "train", "model": "my_package.models:Net"}

Integer buffers (BatchNorm's counter) keep their dtype. Nothing in it is executable: `model`
names code the reader must have loaded itself (--plugin).
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
from gradleak.io import load_tensors, save_tensors, tensors_metadata

UPDATE_FORMAT = "gradleak-fedavg-update"
UPDATE_VERSION = 1
REQUIRED = ("round", "node_id", "num_examples", "shape")


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
    missing = [k for k in REQUIRED if k not in meta]
    if missing:
        raise ConfigError(f"update metadata lacks {', '.join(missing)}")
    tensors = {f"w0/{k}": v for k, v in as_tensors(w0, "w0").items()}
    tensors.update({f"wT/{k}": v for k, v in as_tensors(wT, "w_T").items()})
    header = {"format": UPDATE_FORMAT, "version": UPDATE_VERSION, **meta}
    save_tensors(path, tensors, {"gradleak": json.dumps(header, sort_keys=True)})
    return Path(path)


def read_update(path: str | os.PathLike[str]) -> UpdateFile:
    path = Path(path)
    tensors = load_tensors(path, "update file")
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
    missing = [k for k in REQUIRED if k not in meta]
    if missing:
        raise CheckpointError(f"update file {path}: metadata lacks {', '.join(missing)}")
    w0 = {k[3:]: v for k, v in tensors.items() if k.startswith("w0/")}
    wT = {k[3:]: v for k, v in tensors.items() if k.startswith("wT/")}
    if set(w0) != set(wT) or not w0:
        raise CheckpointError(f"update file {path}: w0 and w_T name different arrays "
                              f"({len(w0)} and {len(wT)})")
    return UpdateFile(w0, wT, meta)


def transform_from_dict(data: Any, source: str) -> Any:
    """The input transform a file declares: None, or a Normalize."""
    from gradleak.fedavg.invert import Normalize

    if data is None:
        return None
    if not isinstance(data, dict) or data.get("kind") != "normalize":
        raise ConfigError(f"{source}: input transform {data!r} is not one gradleak can rebuild "
                          "(only {'kind': 'normalize', 'mean': ..., 'std': ...}); pass "
                          "--input-transform")
    return Normalize(tuple(data.get("mean", (0.0,))), tuple(data.get("std", (1.0,))))
