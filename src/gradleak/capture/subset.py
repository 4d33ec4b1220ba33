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

from gradleak.capture.layout import FACTORS, layout_of, mark_layout
from gradleak.capture.reader import CaptureFile
from gradleak.capture.schema import GRADIENTS
from gradleak.capture.storage import compression_options, file_compression
from gradleak.errors import CaptureFileError, ConfigError
from gradleak.io import atomic_path, check_output, created_directories
from gradleak.victims.base import COMPONENTS, LayerInfo, layers_to_json, side_by_side

CHUNK_ROWS = 1024


def kept_layers(layers: list[LayerInfo], components: list[str]) -> list[LayerInfo]:
    """The layers of `components` with their offsets in the restricted gradient."""
    return side_by_side([layer for layer in layers if layer.component in components])


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
        layout = layout_of(src)
        factored = [layer.name for layer in table if layer.name in layout.factored]
        for name in src:
            if name not in (GRADIENTS, FACTORS):
                src.copy(src[name], dst, name=name)
        for key, value in src.attrs.items():
            dst.attrs[key] = value
        settings = json.loads(src.attrs["settings"])
        settings["components"] = order
        settings.pop("factored_layers", None)
        if factored:
            settings["factored_layers"] = factored
        mark_layout(dst.attrs, factored)
        dst.attrs.update({"components": json.dumps(order), "layer_table": layers_to_json(table),
                          "gradient_dim": sum(layer.size for layer in table),
                          "settings": json.dumps(settings, sort_keys=True),
                          "restricted_from": str(source)})
        stored = layout.stored_offsets()
        filters = compression_options(file_compression(src.attrs))
        _copy_columns(src[GRADIENTS], dst, GRADIENTS, [
            (stored[layer.name], layer.size) for layer in table
            if layer.name not in layout.factored], progress, filters)
        if factored:
            spans = layout.factor_columns()
            _copy_columns(src[FACTORS], dst, FACTORS, [
                (span.start, span.stop - span.start) for name in factored
                for span in spans[name]], progress, filters)
    return {"in": str(source), "out": str(out), "components": order,
            "gradient_dim": sum(layer.size for layer in table)}


def _copy_columns(gradients: h5py.Dataset, dst: h5py.File, name: str,
                  spans: list[tuple[int, int]], progress: bool, filters: dict[str, Any]) -> None:
    """The stored columns `spans` ((first, count) each) of every row, side by side."""
    columns = np.concatenate([np.arange(first, first + count) for first, count in spans]) \
        if spans else np.zeros(0, np.int64)
    rows = gradients.shape[0]
    chunks = (min(gradients.chunks[0], rows), len(columns)) \
        if gradients.chunks and rows and len(columns) else None
    out = dst.create_dataset(name, shape=(rows, len(columns)), dtype=gradients.dtype,
                             chunks=chunks, **filters)
    for start in tqdm(range(0, rows, CHUNK_ROWS), disable=not progress, unit="chunk",
                      desc="restrict"):
        out[start:start + CHUNK_ROWS] = gradients[start:start + CHUNK_ROWS][:, columns]
