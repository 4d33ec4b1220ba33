"""A capture restricted to some components' gradients (`--components cnn`), cut from a capture
of more of them instead of recorded again.

The per-step gradient of the CNN's parameters is the same columns whether or not the FC and the
heads were captured beside it, so the cut is the capture `--components cnn` would have written
on the same episodes (the same seed plays the same trajectories), at the cost of a copy rather
than a rollout: the component ablation compares the components on the very same steps.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from tqdm import tqdm

from gradleak.capture.reader import CaptureFile
from gradleak.capture.schema import GRADIENTS
from gradleak.capture.storage import compression_options, file_compression
from gradleak.errors import CaptureFileError, ConfigError
from gradleak.io import atomic_path, check_output, created_directories
from gradleak.victims.base import COMPONENTS, LayerInfo, layers_to_json

CHUNK_ROWS = 1024


def kept_layers(layers: list[LayerInfo], components: list[str]) -> list[LayerInfo]:
    """The layers of `components` with their offsets in the restricted gradient."""
    table, offset = [], 0
    for layer in layers:
        if layer.component in components:
            table.append(LayerInfo(layer.name, layer.shape, offset, layer.component))
            offset += layer.size
    return table


def restrict_components(source: str | os.PathLike[str], components: list[str],
                        out: str | os.PathLike[str], progress: bool = False) -> dict[str, Any]:
    """Writes (atomically) the capture `source` with only `components`' gradient columns."""
    source, out = Path(source), Path(out)
    unknown = [c for c in components if c not in COMPONENTS]
    if not components or unknown:
        raise ConfigError(f"components {components}: expected some of {', '.join(COMPONENTS)}")
    check_output(out, "out")
    if out.exists():
        raise CaptureFileError(f"{out} already exists: a restricted capture never replaces a "
                               "file")
    with CaptureFile(source) as capture:
        held = json.loads(capture.attrs["components"])
        layers = capture.layers
    missing = [c for c in components if c not in held]
    if missing:
        raise ConfigError(f"{source} holds the gradients of {', '.join(held)}, not of "
                          f"{', '.join(missing)}: capture them")
    table = kept_layers(layers, components)
    order = [c for c in held if c in components]  # the source's order, as a capture writes it
    with created_directories(out.parent), h5py.File(source, "r") as src, \
            atomic_path(out) as tmp, h5py.File(tmp, "w") as dst:
        for name in src:
            if name != GRADIENTS:
                src.copy(src[name], dst, name=name)
        for key, value in src.attrs.items():
            dst.attrs[key] = value
        settings = json.loads(src.attrs["settings"])
        settings["components"] = order
        dst.attrs.update({"components": json.dumps(order), "layer_table": layers_to_json(table),
                          "gradient_dim": sum(layer.size for layer in table),
                          "settings": json.dumps(settings, sort_keys=True),
                          "restricted_from": str(source)})
        _copy_columns(src[GRADIENTS], dst, layers, table, progress,
                      compression_options(file_compression(src.attrs)))
    return {"in": str(source), "out": str(out), "components": order,
            "gradient_dim": sum(layer.size for layer in table)}


def _copy_columns(gradients: h5py.Dataset, dst: h5py.File, layers: list[LayerInfo],
                  table: list[LayerInfo], progress: bool, filters: dict[str, Any]) -> None:
    by_name = {layer.name: layer for layer in layers}
    columns = np.concatenate([np.arange(by_name[layer.name].offset,
                                        by_name[layer.name].offset + layer.size)
                              for layer in table])
    rows = gradients.shape[0]
    chunks = (min(gradients.chunks[0], rows), len(columns)) if gradients.chunks else None
    out = dst.create_dataset(GRADIENTS, shape=(rows, len(columns)), dtype=gradients.dtype,
                             chunks=chunks, **filters)
    for start in tqdm(range(0, rows, CHUNK_ROWS), disable=not progress, unit="chunk",
                      desc="restrict"):
        out[start:start + CHUNK_ROWS] = gradients[start:start + CHUNK_ROWS][:, columns]
