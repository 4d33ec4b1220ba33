"""Reading a capture file: what the server sees (`observation`), private ground truth for
scoring and auxiliary training (`target`, `private_column`), and full validation.

The file is checked on open (`capture.header`); every error names the file and the field, so a
truncated, foreign or inconsistent file is reported as such rather than as an h5py traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from tqdm import tqdm

from gradleak.capture.header import check_layout, read_header
from gradleak.capture.layout import FACTORED_ATTR, read_gradients
from gradleak.capture.lock import lock_holder
from gradleak.capture.schema import (
    DEFENSES_ATTR,
    GRADIENTS,
    PARTIAL_SUFFIX,
    THETA0_GROUP,
    step_columns,
)
from gradleak.capture.text import describe_rows, nonfinite_message, roles_text
from gradleak.errors import CaptureFileError
from gradleak.threat import Observation, Target, declared
from gradleak.victims.base import LayerInfo, side_by_side

SCAN_ROWS = 256
SCAN_BYTES = 64 * 2**20  # a scan block's gradients: wide rows (3.7 MB for the paper's cnn) in
# 256-row blocks took ~1 GB, and every command that reads a capture scans it first
PRIVATE_COLUMNS = frozenset(column.name for column in step_columns((1, 1, 3), 1, 1)
                            if column.private)
_SCANNED: dict[tuple[str, int, int], np.ndarray] = {}  # (file, size, mtime) → non-finite rows


class CaptureFile:
    """One complete capture file, opened read-only and checked on open."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if self.path.name.endswith(PARTIAL_SUFFIX):
            holder = lock_holder(self.path.with_name(self.path.name[:-len(PARTIAL_SUFFIX)]))
            if holder is not None:
                raise CaptureFileError(f"{self.path} is a capture in progress: process {holder} "
                                       "is writing it")
            raise CaptureFileError(f"{self.path} is an interrupted capture: continue it with "
                                   "`gradleak capture ... --resume`")
        if self.path.is_dir():
            raise CaptureFileError(f"capture file {self.path} is a directory; expected an HDF5 "
                                   "capture file")
        if not self.path.is_file():
            raise CaptureFileError(f"capture file {self.path} does not exist")
        try:
            self._h5 = h5py.File(self.path, "r")
        except OSError:
            raise CaptureFileError(f"{self.path} is not a readable HDF5 file (truncated, or not "
                                   "a capture)") from None
        self._nonfinite: np.ndarray | None = None
        try:
            header = read_header(self._h5, self.path)
            check_layout(self._h5, self.path, header)
            self._check_merged_shards()
        except CaptureFileError:
            self._h5.close()
            raise
        self.victim, self.layers, self.roles = header.victim, header.layers, header.roles
        self.hidden_size = header.hidden_size

    def _check_merged_shards(self) -> None:
        """A merged capture's rows live in its shards (virtual datasets): HDF5 would read a
        missing shard's rows as zeros, silently, so each is looked for first."""
        if "merged_from" not in self._h5.attrs:
            return
        theta0 = str(self._h5.attrs["theta0_sha256"])
        for name in json.loads(self._h5.attrs["merged_from"]):
            shard = Path(name) if os.path.isabs(name) else self.path.parent / name
            if not shard.is_file():
                raise CaptureFileError(f"{self.path} is merged from shards, and shard {shard} "
                                       "is missing: put it back (shards named without a folder "
                                       "sit beside the merged file)")
            try:
                with h5py.File(shard, "r") as handle:
                    found = str(handle.attrs.get("theta0_sha256", "none"))
            except OSError:
                raise CaptureFileError(f"{self.path}: its shard {shard} is not a readable HDF5 "
                                       "file") from None
            if found != theta0:  # replaced since the merge: its rows are of another victim
                raise CaptureFileError(f"{self.path}: its shard {shard} was captured at θ0 "
                                       f"{found[:12]}…, the merged file at {theta0[:12]}…: "
                                       "the shard was replaced since the merge; merge again")

    # -- metadata ------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return int(self._h5.attrs["num_rows"])

    def __len__(self) -> int:
        return self.num_rows

    @property
    def attrs(self) -> dict[str, Any]:
        return {k: (v.item() if isinstance(v, np.generic) else v)
                for k, v in self._h5.attrs.items()}

    @property
    def hyperparameters(self) -> dict[str, Any]:
        return {"algorithm": str(self._h5.attrs["algorithm"]),
                **json.loads(self._h5.attrs["loss"])}

    @property
    def scenes(self) -> list[str]:
        return json.loads(self._h5.attrs.get("all_scenes", self._h5.attrs["scenes"]))

    def column(self, name: str, rows: Any = slice(None)) -> np.ndarray:
        """Rows of a column the server sees (episode and step ids, gradients)."""
        return self.read(name, rows)

    def private_column(self, name: str, rows: Any = slice(None)) -> np.ndarray:
        """Rows of any column, private ground truth included (frames, actions, advantages,
        ...): for scoring, and for the attacker's own training captures (auxiliary data)."""
        return self._read(name, rows)

    def read(self, name: str, rows: Any = slice(None), columns: slice = slice(None)
             ) -> np.ndarray:
        """Rows of a dataset the server sees; a private column is refused, naming the reader
        that serves it (`Column.private` in the schema)."""
        if name in PRIVATE_COLUMNS:
            raise CaptureFileError(f"{self.path}: column '{name}' is private ground truth; "
                                   "read it with private_column() or target() (scoring and "
                                   "auxiliary training data only)")
        return self._read(name, rows, columns)

    def _read(self, name: str, rows: Any = slice(None), columns: slice = slice(None)
              ) -> np.ndarray:
        """Rows of a dataset; a chunk that does not decode is named, with its rows."""
        try:
            if name == GRADIENTS:
                return read_gradients(self._h5, rows, columns)
            return self._h5[name][rows, columns] if columns != slice(None) \
                else self._h5[name][rows]
        except OSError:
            where = describe_rows(rows, self.num_rows)
            raise CaptureFileError(f"{self.path}: dataset '{name}' rows {where} cannot be read "
                                   "(a corrupt or truncated chunk)") from None

    def theta0(self) -> dict[str, np.ndarray]:
        return {name: np.asarray(self.read(f"{THETA0_GROUP}/{name}", ()))
                for name in self._h5[THETA0_GROUP]} if THETA0_GROUP in self._h5 else {}

    # -- the two sides of the threat model -----------------------------------------------------
    def observation(self, rows: Any = slice(None), layers: Sequence[str] | None = None,
                    with_theta0: bool = True) -> Observation:
        """What the server sees; `layers` limits the gradient columns read (and held)."""
        chosen = self.layers if layers is None else [self._layer(n) for n in layers]
        if layers is None:  # whole rows in one read: a row's chunk decodes once, not per layer
            matrix = self.read(GRADIENTS, rows).astype(np.float32)
        else:
            blocks = [self.read(GRADIENTS, rows, slice(layer.offset, layer.offset + layer.size))
                      .astype(np.float32) for layer in chosen]
            matrix = np.concatenate(blocks, axis=1) if blocks else np.zeros((0, 0), np.float32)
        self._check_finite(matrix, rows)
        return Observation(gradients=matrix, layers=tuple(side_by_side(chosen)),
                           victim=self.victim,
                           hyperparameters=self.hyperparameters,
                           episode_ids=self.column("episode_ids", rows),
                           step_in_episode=self.column("step_in_episode", rows),
                           theta0=self.theta0() if with_theta0 else {}, roles=self.roles,
                           defense=self.declared_defense())

    def declared_defense(self) -> tuple[dict[str, Any], ...]:
        """The transforms a defended copy went through (`gradleak defend`), without seeds;
        a record that is not a list of chains of named transforms is refused, naming the file."""
        try:
            chains = json.loads(self._h5.attrs.get(DEFENSES_ATTR, "[]"))
            transforms = [t for chain in chains for t in chain.get("transforms", [])]
            if not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                       for t in transforms):
                raise TypeError
        except (ValueError, TypeError, AttributeError):
            raise CaptureFileError(f"{self.path}: attribute {DEFENSES_ATTR!r} is not the list "
                                   "of defense chains `gradleak defend` writes") from None
        return declared(transforms)

    def target(self, rows: Any = slice(None), images: bool = True) -> Target:
        """Private ground truth: auxiliary training targets and scoring only."""
        def read(name: str) -> np.ndarray:
            return self.private_column(name, rows)

        return Target(images=read("images") if images else None, actions=read("actions"),
                      advantages=read("advantages"), returns=read("returns"),
                      values=read("values"), probs=read("probs"), rewards=read("rewards"),
                      goals=read("goals"),
                      hidden_states=read("hidden_states") if self.hidden_size else None)

    def _layer(self, name: str) -> LayerInfo:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise CaptureFileError(f"{self.path}: layer {name!r} is not in the capture (components "
                               f"{self._h5.attrs['components']})")

    def _check_finite(self, matrix: np.ndarray, rows: Any) -> None:
        if not np.isfinite(matrix).all():
            bad = np.nonzero(~np.isfinite(matrix).all(axis=1))[0]
            indices = np.arange(self.num_rows)[rows] if not isinstance(rows, (int, np.integer)) \
                else np.array([rows])
            raise CaptureFileError(nonfinite_message(self.path, indices[bad]))

    def nonfinite_rows(self, progress: bool = False) -> np.ndarray:
        """Rows whose gradient holds NaN or Inf, from a full scan, kept for this process as long
        as the file is unchanged (a training run opens its captures several times)."""
        stat = self.path.stat()
        key = (str(self.path.resolve()), stat.st_size, stat.st_mtime_ns)
        self._nonfinite = _SCANNED.get(key)
        if self._nonfinite is None:
            found = []
            width = int(self._h5.attrs["gradient_dim"]) * self._h5[GRADIENTS].dtype.itemsize
            step = max(1, min(SCAN_ROWS, SCAN_BYTES // max(1, width)))
            for start in tqdm(range(0, self.num_rows, step), disable=not progress,
                              desc=f"scan {self.path.name}", unit="block", leave=False):
                rows = slice(start, min(start + step, self.num_rows))
                block = self.read(GRADIENTS, rows)
                bad = ~np.isfinite(block).all(axis=1)
                found.append(np.flatnonzero(bad) + start)
            self._nonfinite = np.concatenate(found) if found else np.zeros(0, np.int64)
            _SCANNED[key] = self._nonfinite
        return self._nonfinite

    def usable_rows(self, skip_nonfinite: bool = False) -> np.ndarray:
        """(N,) bool: the rows an attack may read. Non-finite rows are refused, naming the file
        and the rows, or left out when the user asked (`--skip-nonfinite`)."""
        bad = self.nonfinite_rows()
        if len(bad) and not skip_nonfinite:
            raise CaptureFileError(nonfinite_message(self.path, bad))
        usable = np.ones(self.num_rows, bool)
        usable[bad] = False
        return usable

    def validate(self, progress: bool = False) -> dict[str, Any]:
        """Full scan: every chunk of every dataset decodes, gradients are finite, episodes are
        contiguous and closed by a done flag."""
        names = [column.name for column in step_columns(self.roles.transform.frame_shape,
                                                        self.victim.num_actions,
                                                        self.hidden_size)]
        blocks = [(name, start) for name in names for start in range(0, self.num_rows,
                                                                      SCAN_ROWS)]
        for name, start in tqdm(blocks, disable=not progress, unit="block",
                                desc=f"validate {self.path.name}"):
            self._read(name, slice(start, min(start + SCAN_ROWS, self.num_rows)))
        for name, data in (self._h5[THETA0_GROUP].items() if THETA0_GROUP in self._h5 else ()):
            self.read(f"{THETA0_GROUP}/{name}", ())
        bad = self.nonfinite_rows(progress)
        if len(bad):
            raise CaptureFileError(nonfinite_message(self.path, bad))
        episodes = self.column("episode_ids")
        steps = self.column("step_in_episode")
        dones = self.private_column("dones")
        starts = np.r_[True, episodes[1:] != episodes[:-1]]
        if (steps[starts] != 0).any() or (np.diff(steps)[~starts[1:]] != 1).any():
            raise CaptureFileError(f"{self.path}: 'step_in_episode' does not count 0, 1, 2, ... "
                                   "inside each episode")
        ends = np.r_[starts[1:], True]
        if not np.array_equal(dones, ends):
            raise CaptureFileError(f"{self.path}: 'dones' does not mark exactly the last step of "
                                   "each episode")
        return {"rows": self.num_rows, "episodes": int(starts.sum()), "finite": True}

    def summary(self) -> dict[str, Any]:
        attrs = self.attrs
        episodes = self.column("episode_ids")
        lengths = np.bincount(np.unique(episodes, return_inverse=True)[1])
        rewards = self.private_column("rewards")
        terminated = self.private_column("terminated")
        return {"file": str(self.path), "victim": attrs["victim"],
                "frame_size": self.victim.frame_size, "num_actions": self.victim.num_actions,
                "algorithm": attrs["algorithm"], "split": attrs["split"],
                "shard": attrs.get("shard", "0/1"), "rows": self.num_rows,
                "episodes": len(lengths), "mean_episode_length": float(lengths.mean()),
                "success_rate": float(terminated.sum() / max(len(lengths), 1)),
                "mean_reward": float(rewards.mean()) if len(rewards) else 0.0,
                "gradient_dim": int(attrs["gradient_dim"]),
                # stored as their output gradient and input (gradleak.capture.layout)
                "factored_weights": json.loads(attrs.get(FACTORED_ATTR, "[]")),
                "components": json.loads(attrs["components"]),
                "scenes": len(json.loads(attrs["scenes"])),
                "theta0_sha256": attrs["theta0_sha256"],
                "defenses": [chain["spec"] for chain in json.loads(attrs.get(DEFENSES_ATTR,
                                                                             "[]"))],
                "frames": "×".join(map(str, self.roles.transform.frame_shape)),
                "roles": roles_text(self.roles),
                "size_mb": round(self.path.stat().st_size / 2**20, 2)}

    def content_key(self, samples: int = 8) -> dict[str, Any]:
        """What identifies this capture's content, not its path: θ0's hash, the rows, and a
        digest of every attribute and of `samples` evenly spaced rows of every column (a few
        MB read, whatever the capture's size)."""
        digest = hashlib.sha256()
        for name, value in sorted(self.attrs.items()):
            digest.update(f"{name}={value!r};".encode())
        for name in sorted(self._h5):
            data = self._h5[name]
            if isinstance(data, h5py.Dataset) and data.shape and len(data):
                digest.update(f"{name}{data.shape}{data.dtype}".encode())
                for row in sorted({int(r) for r in np.linspace(0, len(data) - 1, samples)}):
                    digest.update(np.ascontiguousarray(self._read(name, row)).tobytes())
        return {"theta0_sha256": str(self.attrs["theta0_sha256"]), "rows": self.num_rows,
                "digest": digest.hexdigest()[:16]}

    def close(self) -> None:
        self._h5.close()

    def __enter__(self) -> CaptureFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
