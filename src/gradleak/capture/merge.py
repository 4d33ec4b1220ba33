"""Shards of one capture as one file, without copying: HDF5 virtual datasets (h5py VDS).

A capture the paper's size (108,000 steps, ~150 GB of float32 gradients after LZ4) is a
sharded job (`gradleak capture-plan` prints it); `gradleak merge` then writes a small file whose
per-step datasets map onto the shards' rows in shard order. Only `episode_ids` is written out
(8 bytes a step): each shard numbers its episodes from 0, and the merged file renumbers them
so they stay unique. The shards are named relative to the merged file when they sit beside
it, so the folder can be moved as a whole; every reader needs the shards where the merged file
says they are (`gradleak info` names a missing one).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from gradleak.capture.layout import FACTORED_ATTR
from gradleak.capture.reader import CaptureFile
from gradleak.capture.schema import THETA0_GROUP
from gradleak.capture.shards import SHARED_ATTRS
from gradleak.errors import CaptureFileError, ConfigError
from gradleak.io import atomic_path, check_output, created_directories

MERGED_ATTR = "merged_from"  # JSON list of the shard files, as the virtual datasets name them
SAME = (*SHARED_ATTRS, "split", "components", "compression", "hidden_size", "all_scenes",
        FACTORED_ATTR,
        "env_config", "seed", "loss")


def merge_shards(shards: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]
                 ) -> dict[str, Any]:
    """Writes (atomically) one capture file over `shards` (complete, of one capture, each
    shard once; any order: they are put in shard order)."""
    out = Path(out)
    check_output(out, "--out")
    if out.exists() or out.is_symlink():
        raise CaptureFileError(f"{out} already exists: merge never replaces a file")
    ordered = _check_shards([Path(s) for s in shards])
    with CaptureFile(ordered[0]) as first:
        attrs = first.attrs
    with created_directories(out.parent), atomic_path(out) as tmp:
        with h5py.File(tmp, "w") as handle:
            rows = _write(handle, ordered, out.parent)
            for key, value in attrs.items():
                handle.attrs[key] = value
            _merged_attributes(handle, ordered, rows, out.parent)
    return {"out": str(out), "shards": [str(s) for s in ordered], "rows": rows}


def _check_shards(paths: list[Path]) -> list[Path]:
    if len(paths) < 2:
        raise ConfigError("merge: give the shard files of one capture (two or more)")
    found: dict[int, Path] = {}
    count = None
    first: dict[str, Any] = {}
    for path in paths:
        with CaptureFile(path) as capture:
            attrs = capture.attrs
        index, total = (int(part) for part in str(attrs["shard"]).split("/"))
        if not attrs.get("complete"):
            raise CaptureFileError(f"{path} is not complete: finish it with --resume first")
        if count is None:
            count, first = total, attrs
        for key in SAME:
            if attrs.get(key) != first.get(key):
                raise CaptureFileError(f"{path} and {paths[0]} differ in '{key}': they are not "
                                       "shards of one capture")
        if total != count:
            raise CaptureFileError(f"{path} is shard {index} of {total}, {paths[0]} one of "
                                   f"{count}")
        if index in found:
            raise CaptureFileError(f"{path} and {found[index]} are both shard {index}")
        found[index] = path
    missing = sorted(set(range(count)) - set(found))
    if missing:
        raise CaptureFileError(f"shard(s) {', '.join(map(str, missing))} of {count} are missing")
    return [found[i] for i in range(count)]


def _source_name(path: Path, folder: Path) -> str:
    """Beside the merged file: its bare name (HDF5 looks there first); elsewhere: absolute."""
    return path.name if path.resolve().parent == folder.resolve() else str(path.resolve())


def _write(handle: h5py.File, shards: list[Path], folder: Path) -> int:
    sources = [h5py.File(path, "r") for path in shards]
    try:
        counts = [int(source.attrs["num_rows"]) for source in sources]
        total = sum(counts)
        for name, dataset in sources[0].items():
            if name == THETA0_GROUP:
                sources[0].copy(dataset, handle, name=name)
            elif name == "episode_ids":
                handle.create_dataset(name, data=_renumbered(sources), chunks=True)
            else:
                layout = h5py.VirtualLayout(shape=(total,) + dataset.shape[1:],
                                            dtype=dataset.dtype)
                start = 0
                for source, path, count in zip(sources, shards, counts):
                    layout[start:start + count] = h5py.VirtualSource(
                        _source_name(path, folder), name, shape=(count,) + dataset.shape[1:],
                        dtype=dataset.dtype)
                    start += count
                handle.create_virtual_dataset(name, layout)
        return total
    finally:
        for source in sources:
            source.close()


def _renumbered(sources: list[h5py.File]) -> np.ndarray:
    parts, offset = [], 0
    for source in sources:
        ids = source["episode_ids"][()]
        parts.append(ids + offset)
        offset += int(ids.max()) + 1 if len(ids) else 0
    return np.concatenate(parts)


def _merged_attributes(handle: h5py.File, shards: list[Path], rows: int, folder: Path) -> None:
    scenes: list[str] = []
    episodes = 0
    for path in shards:
        with h5py.File(path, "r") as shard:
            scenes += json.loads(shard.attrs["scenes"])
            episodes += int(shard.attrs["num_episodes"])
    settings = json.loads(handle.attrs["settings"])
    settings.update(shard=[0, 1], scenes=scenes)
    handle.attrs.update({"num_rows": rows, "num_episodes": episodes, "shard": "0/1",
                         "scenes": json.dumps(scenes), "complete": True,
                         "settings": json.dumps(settings, sort_keys=True),
                         MERGED_ATTR: json.dumps([_source_name(p, folder) for p in shards])})
