"""`gradleak defend`: a defended copy of a capture file, everything but the gradients unchanged."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from tqdm import tqdm

from gradleak.capture.reader import CaptureFile
from gradleak.capture.schema import DEFENSES_ATTR, GRADIENTS
from gradleak.defenses.base import Chain, row_keys
from gradleak.errors import CaptureFileError, ConfigError
from gradleak.io import atomic_path

CHUNK_ROWS = 1024


def applied_defenses(attrs: Any) -> list[dict[str, Any]]:
    return json.loads(attrs.get(DEFENSES_ATTR, "[]"))


def defend_capture(source: str | os.PathLike[str], chain: Chain, out: str | os.PathLike[str],
                   overwrite: bool = False, progress: bool = False) -> dict[str, Any]:
    source, out = Path(source), Path(out)
    if not chain.per_step:
        raise ConfigError(f"defense {chain.spec!r} aggregates steps, which changes the file's "
                          "rows; apply it on the fly with `gradleak evaluate --defense`")
    if out.resolve() == source.resolve():
        raise ConfigError(f"--out {out} is the input file: write the defended copy elsewhere")
    if out.exists() and not overwrite:
        raise CaptureFileError(f"{out} already exists: pass --overwrite to replace it")
    with CaptureFile(source) as capture:
        rows = len(capture)
    with h5py.File(source, "r") as src, atomic_path(out) as tmp, h5py.File(tmp, "w") as dst:
        for name in src:
            if name != GRADIENTS:
                src.copy(src[name], dst, name=name)
        for key, value in src.attrs.items():
            dst.attrs[key] = value
        history = applied_defenses(src.attrs) + [chain.describe()]
        dst.attrs[DEFENSES_ATTR] = json.dumps(history)
        _defend_gradients(src[GRADIENTS], dst, chain, rows, dict(src.attrs), progress)
    return {"in": str(source), "out": str(out), "rows": rows, "defenses": history}


def _defend_gradients(gradients: h5py.Dataset, dst: h5py.File, chain: Chain, rows: int,
                      attributes: dict[str, Any], progress: bool) -> None:
    out = dst.create_dataset(GRADIENTS, shape=gradients.shape, dtype=gradients.dtype,
                             chunks=gradients.chunks, compression=gradients.compression)
    limit = float(np.finfo(gradients.dtype).max)
    for start in tqdm(range(0, rows, CHUNK_ROWS), disable=not progress, unit="chunk",
                      desc=f"defend {chain.spec}"):
        stop = min(start + CHUNK_ROWS, rows)
        block = torch.from_numpy(gradients[start:stop].astype(np.float32))
        defended = chain.gradients(block, row_keys(attributes, start, stop))
        if float(defended.abs().amax()) > limit:
            raise CaptureFileError(f"defense {chain.spec!r} produced entries beyond "
                                   f"{gradients.dtype}'s range in rows {start}..{stop - 1}")
        out[start:stop] = defended.numpy().astype(gradients.dtype)
