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

from gradleak.capture.layout import FACTORS, mark_layout, read_gradients
from gradleak.capture.reader import CaptureFile
from gradleak.capture.schema import DEFENSES_ATTR, GRADIENTS, THETA0_GROUP
from gradleak.capture.storage import compression_options, file_compression
from gradleak.defenses.base import Chain, row_keys
from gradleak.errors import CaptureFileError, ConfigError
from gradleak.io import atomic_path, check_output, created_directories

CHUNK_ROWS = 1024
BLOCK_BYTES = 64 * 2**20  # rows defended at once: 1024 rows of the paper cnn were 3.8 GB


def applied_defenses(attrs: Any) -> list[dict[str, Any]]:
    return json.loads(attrs.get(DEFENSES_ATTR, "[]"))


def defend_capture(source: str | os.PathLike[str], chain: Chain, out: str | os.PathLike[str],
                   overwrite: bool = False, progress: bool = False,
                   skip_nonfinite: bool = False) -> dict[str, Any]:
    """A defended copy of `source`. With `skip_nonfinite`, episodes holding a NaN/Inf gradient
    are left out whole, so the copy stays a valid capture (episodes contiguous, closed)."""
    source, out = Path(source), Path(out)
    if not chain.defenses:
        raise ConfigError(f"--defense {chain.spec!r} applies nothing: name a defense, e.g. "
                          "quant:8")
    if not chain.per_step:
        raise ConfigError(f"defense {chain.spec!r} aggregates steps, which changes the file's "
                          "rows; apply it on the fly with `gradleak evaluate --defense`")
    check_output(out, "--out")
    if out.resolve() == source.resolve():
        raise ConfigError(f"--out {out} is the input file: write the defended copy elsewhere")
    if out.exists() and not overwrite:
        raise CaptureFileError(f"{out} already exists: pass --overwrite to replace it")
    with CaptureFile(source) as capture:
        rows = len(capture)
        usable = capture.usable_rows(skip_nonfinite)
        episodes = capture.column("episode_ids")
    dropped = np.unique(episodes[~usable])
    kept = np.flatnonzero(~np.isin(episodes, dropped))
    with created_directories(out.parent), h5py.File(source, "r") as src, \
            atomic_path(out) as tmp, h5py.File(tmp, "w") as dst:
        filters = compression_options(file_compression(src.attrs))
        for name in src:
            if name in (GRADIENTS, FACTORS):  # defended rows are no outer products
                continue
            if len(kept) == rows or name == THETA0_GROUP:
                src.copy(src[name], dst, name=name)
            else:
                _copy_rows(src[name], dst, name, kept, filters)
        for key, value in src.attrs.items():
            dst.attrs[key] = value
        if len(kept) < rows:
            dst.attrs["num_rows"], dst.attrs["num_episodes"] = len(kept), \
                int(src.attrs["num_episodes"]) - len(dropped)
        history = applied_defenses(src.attrs) + [chain.describe()]
        dst.attrs[DEFENSES_ATTR] = json.dumps(history)
        mark_layout(dst.attrs, [])  # written dense (noise is no outer product)
        _defend_gradients(src, dst, chain, kept, dict(src.attrs), progress, filters)
    return {"in": str(source), "out": str(out), "rows": len(kept), "defenses": history,
            "skipped_nonfinite_rows": int((~usable).sum()),
            "skipped_episodes": len(dropped), "skipped_rows": rows - len(kept)}


def _copy_rows(data: h5py.Dataset, dst: h5py.File, name: str, kept: np.ndarray,
               filters: dict[str, Any]) -> None:
    out = dst.create_dataset(name, shape=(len(kept),) + data.shape[1:], dtype=data.dtype,
                             maxshape=(None,) + data.shape[1:], chunks=data.chunks,
                             **(filters if data.ndim > 1 else {}))
    for start in range(0, len(kept), CHUNK_ROWS):
        out[start:start + CHUNK_ROWS] = data[kept[start:start + CHUNK_ROWS]]


def _defend_gradients(src: h5py.File, dst: h5py.File, chain: Chain, kept: np.ndarray,
                      attributes: dict[str, Any], progress: bool, filters: dict[str, Any]
                      ) -> None:
    """Defends the `kept` rows (a factored source's as the full rows they stand for); the
    noise is keyed by each row's place in the source file."""
    total, width = src[GRADIENTS].shape[0], int(attributes["gradient_dim"])
    dtype = src[GRADIENTS].dtype
    out = dst.create_dataset(GRADIENTS, shape=(len(kept), width), dtype=dtype,
                             chunks=(1, width) if len(kept) and width else None, **filters)
    limit = float(np.finfo(dtype).max)
    every = len(kept) == total
    block_rows = max(1, min(CHUNK_ROWS, BLOCK_BYTES // max(1, width * 4)))
    for start in tqdm(range(0, len(kept), block_rows), disable=not progress, unit="block",
                      desc=f"defend {chain.spec}"):
        rows = kept[start:start + block_rows]
        block = read_gradients(src, slice(start, start + len(rows)) if every else rows)
        keys = row_keys(attributes, 0, total)[torch.from_numpy(rows)]
        defended = chain.gradients(torch.from_numpy(block.astype(np.float32)), keys)
        if float(defended.abs().amax()) > limit:
            raise CaptureFileError(f"defense {chain.spec!r} produced entries beyond "
                                   f"{dtype}'s range in rows {int(rows[0])}.."
                                   f"{int(rows[-1])}")
        out[start:start + len(rows)] = defended.numpy().astype(dtype)
