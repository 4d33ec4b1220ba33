"""Windows of T consecutive steps inside an episode, streamed from one or more capture files.

Only the small per-step columns (episode ids, steps) are read up front; gradients and frames
are read window by window, in whichever process asks (DataLoader workers open their own HDF5
handles), so no file is ever loaded whole.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import h5py
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, get_worker_info

from gradleak.capture.reader import CaptureFile
from gradleak.capture.layout import (
    GradientLayout,
    layout_from_attrs,
    read_gradients,
    read_stored,
)
from gradleak.capture.schema import GRADIENTS
from gradleak.capture.shards import open_captures
from gradleak.defenses.base import Chain, Stream, row_keys
from gradleak.errors import CaptureFileError, ConfigError
from gradleak.threat import ObservedWindows
from gradleak.victims.base import VictimConfig

PARTS = ("train", "val", "all")


@dataclass(frozen=True)
class CaptureFingerprint:
    """What an attacker was trained against: the same θ0 and gradient layout must be attacked."""

    theta0_sha256: str
    layer_table: str
    victim: VictimConfig

    def check(self, other: CaptureFingerprint, where: str) -> None:
        """`other` (the data at hand) must match this (the attacker's); errors name both."""
        if other.victim != self.victim:
            raise CaptureFileError(f"{where}: victim {_victim_text(other.victim)} differs from "
                                   f"the attacker's {_victim_text(self.victim)}")
        if other.layer_table != self.layer_table:
            raise CaptureFileError(f"{where}: layer table {_short_hash(other.layer_table)}… "
                                   f"differs from the attacker's {_short_hash(self.layer_table)}…"
                                   " (another victim or --components)")
        if other.theta0_sha256 != self.theta0_sha256:
            raise CaptureFileError(f"{where}: θ0 hash {other.theta0_sha256[:12]}… differs from "
                                   f"the attacker's {self.theta0_sha256[:12]}… (another "
                                   "checkpoint)")


def check_rgb_frames(capture: CaptureFile) -> None:
    """The learned attackers (TRACE, LtI, the feature decoder) and the image metrics they are
    scored with reconstruct square RGB frames; refuse other frames before any work."""
    transform = capture.roles.transform
    if not transform.rgb:
        height, width, channels = transform.frame_shape
        raise ConfigError(f"{capture.path}: frames of {height}×{width}×{channels} (a stack of "
                          f"{transform.stack}): the learned attackers reconstruct square RGB "
                          "frames; the closed form (gradleak analytic) and gradient matching "
                          "(gradleak attack dlg|ig) apply to these")


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _victim_text(victim: VictimConfig) -> str:
    return f"{victim.name} ({victim.frame_size}x{victim.frame_size}, {victim.num_actions} actions)"


@dataclass(frozen=True)
class CompactRows:
    """Gradient rows as a factored capture stores them: the unfactored columns and each
    factored weight's two factors (`gradleak.capture.layout`), 8x fewer bytes than the full rows
    on the paper cnn (468 kB against 3.7 MB a row). A loader that hands these on spares its
    workers the outer products and the copies of the full rows; `full` forms them where they
    are used (on a GPU, after a copy of the compact ones)."""

    stored: torch.Tensor  # (..., stored width)
    factors: torch.Tensor  # (..., factor width)
    layout: GradientLayout

    def full(self, device: torch.device | str | None = None) -> torch.Tensor:
        """(..., d) float32: the rows these stand for, formed on `device` (default: here)."""
        stored, factors = self.stored, self.factors
        if device is not None:
            stored = stored.to(device, non_blocking=True)
            factors = factors.to(device, non_blocking=True)
        return self.layout.expand(stored, factors)

    def pin_memory(self) -> CompactRows:
        return replace(self, stored=self.stored.pin_memory(), factors=self.factors.pin_memory())

    def __len__(self) -> int:
        return len(self.stored)


Rows = torch.Tensor | CompactRows


def full_rows(rows: Rows, device: torch.device | str | None = None) -> torch.Tensor:
    """Full gradient rows on `device` (default: where they are), whichever form they came in."""
    if isinstance(rows, CompactRows):
        return rows.full(device)
    return rows if device is None else rows.to(device, non_blocking=True)


@dataclass
class WindowBatch:
    """A batch split along the threat model: what was observed, and the private targets."""

    observed: ObservedWindows
    images: torch.Tensor  # (B, T, 3, H, W) float in [0, 1]: targets, or teacher context
    actions: torch.Tensor  # (B, T)
    rows: torch.Tensor | None = None  # (B, T) row keys (defenses.base.row_keys)

    def pin_memory(self) -> WindowBatch:
        """Page-locked copies, so that a copy to the GPU overlaps its work. A DataLoader with
        pin_memory=True pins a batch through this method: a dataclass is otherwise handed on
        as it is, and the batches were copied from pageable memory."""
        return WindowBatch(ObservedWindows(self.observed.gradients.pin_memory()),
                           self.images.pin_memory(), self.actions.pin_memory(),
                           None if self.rows is None else self.rows.pin_memory())

    def on(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gradients, images, actions) on `device`, compact rows made full there."""
        return (full_rows(self.observed.gradients, device),
                self.images.to(device, non_blocking=True),
                self.actions.to(device, non_blocking=True))


@dataclass(frozen=True)
class Window:
    """One window split along the threat model: what the server saw (the gradients, after any
    defense, and their row keys), and the private targets of the attacker's own training
    captures."""

    gradients: Rows  # (T, d) float32, or compact (`WindowDataset` with compact=True)
    rows: torch.Tensor  # (T,) row keys (defenses.base.row_keys)
    images: torch.Tensor  # private: (T, H, W, 3) uint8
    actions: torch.Tensor  # private: (T,) taken, or (T, K) histograms of an aggregated stream


def episode_is_validation(seed: int, file_index: int, episode: int, fraction: float) -> bool:
    return bool(np.random.default_rng([seed, file_index, episode]).random() < fraction)


def episode_is_kept(seed: int, file_index: int, episode: int, fraction: float) -> bool:
    """Whether a training episode is in the first `fraction` of the training data: a draw of its
    own per episode (apart from the validation draw), so the subsets for growing fractions are
    nested and the validation episodes stay the same."""
    return fraction >= 1.0 or \
        bool(np.random.default_rng([seed, file_index, episode, 1]).random() < fraction)


class WindowDataset(Dataset):
    """Windows over capture files; `part` picks the episode-disjoint train/val split (or all).

    `files` (positions in `paths`) restricts it to some of the files, and only those are ever
    opened: one DDP rank's shard of a sharded capture. The split and the subsets are drawn per
    (file position, episode), so a file's windows are the same whichever files are selected.

    With `compact`, the gradient rows of factored captures come as `CompactRows` (the full rows
    formed by whoever uses them): without a defense (which works on full rows) and where every
    file has the same factored layout; else as full rows (`self.compact` says which)."""

    def __init__(self, paths: Sequence[str | os.PathLike[str]], window: int, stride: int = 2,
                 part: str = "all", val_fraction: float = 0.05, seed: int = 0,
                 expect_split: str | None = None, defense: Chain | None = None,
                 skip_nonfinite: bool = False, train_fraction: float = 1.0,
                 files: Sequence[int] | None = None, compact: bool = False,
                 rgb_only: bool = True) -> None:
        """`rgb_only`: refuse frames other than square RGB ones, which the learned attackers
        reconstruct (an evaluation of the single-step attacks alone reads any frames)."""
        if part not in PARTS:
            raise ConfigError(f"part {part!r}: expected one of {', '.join(PARTS)}")
        if window < 1 or stride < 1:
            raise ConfigError(f"window {window} and stride {stride} must be positive")
        if not 0 < train_fraction <= 1:
            raise ConfigError(f"train_episode_fraction {train_fraction}: expected a fraction in "
                              "(0, 1]")
        self.train_fraction = train_fraction
        self.paths = [str(p) for p in paths]
        self.file_indices = list(range(len(self.paths))) if files is None else list(files)
        if not self.file_indices or not set(self.file_indices) <= set(range(len(self.paths))):
            raise ConfigError(f"files {self.file_indices}: expected positions among the "
                              f"{len(self.paths)} capture files given")
        self.window = window
        self.defense = defense
        # Under agg:k a window is T aggregated rows: T·k steps from an aggregation boundary
        # (k-step blocks counted from the episode's start), its targets the last frame of each
        # block and the block's action histogram (paper Table 11).
        self.span = 1 if defense is None else defense.span
        files = open_captures([self.paths[i] for i in self.file_indices])
        try:
            first = files[0]
            if rgb_only:
                check_rgb_frames(first)
            self.fingerprint = CaptureFingerprint(first.attrs["theta0_sha256"],
                                                  first.attrs["layer_table"], first.victim)
            self.gradient_dim = int(first.attrs["gradient_dim"])
            self.num_actions = first.victim.num_actions
            self.file_attrs = {index: {k: capture.attrs[k] for k in ("split", "seed", "shard")
                                       if k in capture.attrs}
                               for index, capture in zip(self.file_indices, files, strict=True)}
            for capture in files:
                if expect_split and capture.attrs["split"] != expect_split:
                    raise CaptureFileError(
                        f"{capture.path} holds {capture.attrs['split']!r} scenes, expected "
                        f"{expect_split!r} (held-out scenes are for testing only)")
            layouts = {layout_from_attrs(capture.attrs) for capture in files}
            self.layout = layouts.pop() if len(layouts) == 1 else None
            self.compact = bool(compact and defense is None and self.layout is not None
                                and self.layout.factored)
            usable = [capture.usable_rows(skip_nonfinite) for capture in files]
            rows, longest, longest_chosen = self._windows(files, usable, stride, part,
                                                          val_fraction, seed)
            # what --skip-nonfinite left out, for the run's record
            self.skipped_rows = int(sum((~mask).sum() for mask in usable))
        finally:
            for capture in files:
                capture.close()
        if not rows:
            raise ConfigError(f"no {part!r} window of T={window} in "
                              f"{', '.join(self.paths[i] for i in self.file_indices)}: "
                              f"the longest {part!r} episode has {longest_chosen} steps, the "
                              f"longest of all {longest} (a {part!r} window needs "
                              f"{window * self.span})")
        self.rows = np.array(rows, dtype=np.int64)  # (N, 3): file, start row, episode
        self._handles: dict[int, dict[int, h5py.File]] = {}

    def _windows(self, files: list[Any], usable: list[np.ndarray], stride: int, part: str,
                 fraction: float, seed: int) -> tuple[list[tuple[int, int, int]], int, int]:
        """(file, start row, episode) of every window inside an episode whose rows are all
        usable; and the longest episode's length, of all and of the part's, for the error when
        there is none."""
        rows, longest, longest_chosen = [], 0, 0
        for position, (file_index, capture) in enumerate(zip(self.file_indices, files,
                                                             strict=True)):
            # bad[i] = unusable rows before i: a window [s, s + n) is clean iff bad[s + n] = bad[s]
            bad = np.r_[0, np.cumsum(~usable[position])]
            episodes = capture.column("episode_ids")
            starts = np.flatnonzero(np.r_[True, episodes[1:] != episodes[:-1]])
            ends = np.r_[starts[1:], len(episodes)]
            chosen = self._split(episodes[starts], file_index, part, fraction, seed)
            for start, end, episode in zip(starts, ends, episodes[starts], strict=True):
                longest = max(longest, int(end - start))
                if int(episode) in chosen:
                    longest_chosen = max(longest_chosen, int(end - start))
                    steps = self.window * self.span
                    rows += [(file_index, int(s), int(episode))
                             for s in range(start, end - steps + 1, stride * self.span)
                             if bad[s + steps] == bad[s]]
        return rows, longest, longest_chosen

    @staticmethod
    def _split_episodes(episodes: np.ndarray, file_index: int, part: str, fraction: float,
                        seed: int) -> set[int]:
        if part == "all":
            return {int(e) for e in episodes}
        validation = {int(e) for e in episodes
                      if episode_is_validation(seed, file_index, int(e), fraction)}
        if not validation and len(episodes) > 1 and fraction > 0:
            validation = {int(episodes[-1])}  # a split with no validation episode at all
        train = {int(e) for e in episodes} - validation
        return validation if part == "val" else train

    def _split(self, episodes: np.ndarray, file_index: int, part: str, fraction: float,
               seed: int) -> set[int]:
        chosen = self._split_episodes(episodes, file_index, part, fraction, seed)
        if part != "train":
            return chosen
        return {e for e in chosen if episode_is_kept(seed, file_index, e, self.train_fraction)}

    def __len__(self) -> int:
        return len(self.rows)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_handles"] = {}  # HDF5 handles never cross a process boundary
        return state

    def _file(self, index: int) -> h5py.File:
        # each DataLoader worker opens its own handles after the fork, and only the files it
        # reads from
        handles = self._handles.setdefault(os.getpid(), {})
        if index not in handles:
            handles[index] = h5py.File(self.paths[index], "r")
        return handles[index]

    def __getitem__(self, index: int) -> Window:
        return self._window(index)

    def __getitems__(self, indices: list[int]) -> list[Window]:
        """A batch's windows (what a DataLoader asks for), their gradient rows read straight
        into one (B, T, d) float32 tensor, of which each window's are a view (`collate` then
        hands that tensor on as it is). In a DataLoader worker it lies in shared memory, where
        the batch crosses to the training process: a batch of the paper cnn's windows is 480
        MB, which per-window arrays and their stack wrote twice (`benchmarks/recovery_speed.py`
        times both ways side by side)."""
        if self.defense is not None:  # the defense forms each window's rows anew
            return [self._window(index) for index in indices]
        rows = self._empty_rows(len(indices))
        return [self._window(index, _slot(rows, slot)) for slot, index in enumerate(indices)]

    def _empty_rows(self, count: int | None) -> Rows:
        """Room for `count` windows' rows (None: one window's), full or compact."""
        batch = () if count is None else (count,)
        if not self.compact:
            return _empty_batch((*batch, self.window, self.gradient_dim))
        assert self.layout is not None  # factored captures are float32 (a float16 one is dense)
        return CompactRows(_empty_batch((*batch, self.window, self.layout.stored_width)),
                           _empty_batch((*batch, self.window, self.layout.factor_width)),
                           self.layout)

    def _window(self, index: int, into: Rows | None = None) -> Window:
        file_index, start, _ = (int(v) for v in self.rows[index])
        stop = start + self.window * self.span
        keys = row_keys(self.file_attrs[file_index], start, stop)
        if into is None and self.compact:
            into = self._empty_rows(None)
        gradients: Rows
        if into is None:
            gradients = torch.from_numpy(self._read(file_index, GRADIENTS, start, stop)
                                         .astype(np.float32, copy=False))
        else:
            self._read(file_index, GRADIENTS, start, stop,
                       into if isinstance(into, CompactRows) else into.numpy())
            gradients = into
        actions = torch.from_numpy(self._read(file_index, "actions", start, stop))
        images = torch.from_numpy(self._read(file_index, "images", start, stop))
        if self.defense is None:
            return Window(gradients, keys, images, actions)
        # keyed seeding: the same noise however windows overlap or are batched
        stream = self.defense.apply(Stream.of(gradients, keys))
        last = slice(self.span - 1, None, self.span)
        if self.span > 1:  # the targets of an aggregated row: the last frame, the histogram
            counts = F.one_hot(actions.view(self.window, self.span), self.num_actions)
            return Window(stream.gradients, stream.keys, images[last], counts.float().mean(1))
        return Window(stream.gradients, stream.keys, images[last], actions[last])

    def _read(self, file_index: int, name: str, start: int, stop: int,
              out: np.ndarray | CompactRows | None = None) -> np.ndarray | None:
        """Rows of dataset `name` (the gradients full, into `out` if given, or as stored into
        compact `out`)."""
        try:
            handle = self._file(file_index)
            if name != GRADIENTS:
                return handle[name][start:stop]
            if isinstance(out, CompactRows):
                read_stored(handle, slice(start, stop), out.stored.numpy(), out.factors.numpy())
                return None
            return read_gradients(handle, slice(start, stop), out=out)
        except OSError:
            raise CaptureFileError(f"{self.paths[file_index]}: dataset '{name}' rows "
                                   f"{start}-{stop - 1} cannot be read (a corrupt or truncated "
                                   "chunk)") from None

    def gradient_rows(self, limit: int, seed: int = 0) -> Iterator[torch.Tensor]:
        """Up to `limit` gradient rows from random windows, in chunks: normaliser statistics."""
        order = np.random.default_rng(seed).permutation(len(self))
        seen = 0
        for index in order:
            if seen >= limit:
                return
            rows = full_rows(self[int(index)].gradients)[: limit - seen]
            seen += len(rows)
            yield rows

    def mean_image(self, limit: int = 2048, seed: int = 0) -> torch.Tensor:
        """(3, H, W) mean training frame: the no-gradient baseline of every table."""
        total, count = None, 0
        for index in np.random.default_rng(seed).permutation(len(self))[: max(1, limit //
                                                                              self.window)]:
            frames = self[int(index)].images.to(torch.float64) / 255.0
            total = frames.sum(0) if total is None else total + frames.sum(0)
            count += len(frames)
        return (total / count).permute(2, 0, 1).to(torch.float32)


def collate(items: list[Window]) -> WindowBatch:
    images = torch.stack([item.images for item in items])  # (B, T, H, W, 3) uint8
    return WindowBatch(observed=ObservedWindows(_stack_rows([i.gradients for i in items])),
                       images=images.permute(0, 1, 4, 2, 3).to(torch.float32) / 255.0,
                       actions=torch.stack([item.actions for item in items]),
                       rows=torch.stack([item.rows for item in items]))


def _slot(rows: Rows, slot: int) -> Rows:
    """One window's part of a batch's rows: views, whatever the form."""
    if isinstance(rows, CompactRows):
        return replace(rows, stored=rows.stored[slot], factors=rows.factors[slot])
    return rows[slot]


def _stack_rows(rows: list[Rows]) -> Rows:
    """The windows' rows as one batch's, uncopied where `__getitems__` read them together."""
    first = rows[0]
    if isinstance(first, CompactRows):
        compact = [r for r in rows if isinstance(r, CompactRows)]
        return replace(first, stored=_stack([r.stored for r in compact]),
                       factors=_stack([r.factors for r in compact]))
    return _stack([r for r in rows if isinstance(r, torch.Tensor)])


def _empty_batch(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised float32 tensor, in shared memory in a DataLoader worker (as torch's
    default collate puts a batch there), so that it reaches the training process uncopied."""
    if get_worker_info() is None:
        return torch.empty(shape)
    storage = torch.UntypedStorage._new_shared(4 * math.prod(shape))
    return torch.empty(0).set_(storage, 0, shape)


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack; where the tensors already lie one after the other in one storage (the rows
    `WindowDataset.__getitems__` read), that storage seen as the stack, uncopied."""
    first = tensors[0]
    step = first.numel()
    if all(t.is_contiguous() and t.shape == first.shape
           and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
           and t.storage_offset() == first.storage_offset() + i * step
           for i, t in enumerate(tensors)):
        return first.as_strided((len(tensors), *first.shape), (step, *first.stride()),
                                first.storage_offset())
    out = _empty_batch((len(tensors), *first.shape)) if first.dtype == torch.float32 else None
    return torch.stack(tensors, out=out)
