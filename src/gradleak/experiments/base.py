"""Experiments as registered grids of cells.

An experiment names its axes (victim × algorithm × attacker × setting × seed); each cell is one
point of the grid and runs on its own, so a grid can be resumed cell by cell, split across
processes or machines (`--shard i/n`), and merged into one table at the end. Work that several
cells share (a trained victim, a capture) is built once under OUT/shared, guarded by a file lock,
so shards running side by side never build it twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from gradleak.errors import ConfigError
from gradleak.registry import Registry

T = TypeVar("T")
MAX_CELLS = 100_000  # cells one grid may have: each is a file, and the grid is built in memory


@dataclass(frozen=True)
class Cell:
    """One point of an experiment's grid: axis name → value, in the axes' order."""

    values: tuple[tuple[str, Any], ...]

    def __getitem__(self, axis: str) -> Any:
        return dict(self.values)[axis]

    @property
    def id(self) -> str:
        """A file name: 'victim=ppo,components=cnn,seed=0', other characters percent-encoded
        ('defense=noise%3A0.01'), so that values differing only in them stay apart."""
        return quote(",".join(f"{k}={v}" for k, v in self.values), safe=",=+")

    def to_dict(self) -> dict[str, Any]:
        return dict(self.values)


SHARED_SECTIONS = ("env", "train", "capture")  # what shapes victims and captures
# how the per-step gradients are computed and stored, not what they are (the methods are
# tested equal; the filters and the factored layout are lossless)
HOW_NOT_WHAT = {"capture": ("gradient_method", "chunk", "compression", "overlap",
                             "background_write", "factor_linear")}


def shared_key(preset: Any) -> str:
    """A short fingerprint of the preset sections that shape shared work: experiments sharing
    a root reuse a victim or capture only when these sections agree."""
    data = {section: {k: v for k, v in preset.to_dict()[section].items()
                      if k not in HOW_NOT_WHAT.get(section, ())} for section in SHARED_SECTIONS}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:12]


@dataclass
class Context:
    """What a cell runs with: the run folder, the per-cell budget and its clock, the preset,
    and where shared work lives (OUT/shared unless --shared names a root several experiments
    use)."""

    out: Path
    budget_minutes: float
    clock: str
    preset: Any
    progress: bool = False
    shared_root: Path | None = None
    # CPU minutes this process spent building shared work (counted apart from the cells)
    shared_cpu_minutes: float = 0.0

    def shared(self, name: str, build: Callable[[Path], T], done: Callable[[Path], bool]
               ) -> Path:
        """ROOT/<preset key>/NAME, built once by `build(path)` under a lock; `done(path)` says
        whether an earlier process (or shard, or experiment) already built it."""
        root = self.shared_root if self.shared_root is not None else self.out / "shared"
        path = root / shared_key(self.preset) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path.with_name(f".{name}.lock")):
            if not done(path):
                # a build may build what it starts from (a capture cut from the full one):
                # the time of both is counted once
                start, before = time.process_time(), self.shared_cpu_minutes
                build(path)
                self.shared_cpu_minutes = before + (time.process_time() - start) / 60
        return path


@contextlib.contextmanager
def locked(lock: Path) -> Iterator[None]:
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class Experiment(ABC):
    """A subclass names its grid, runs one cell, and turns all cells' results into tables."""

    name: str = ""
    description: str = ""

    @abstractmethod
    def axes(self, seeds: int) -> dict[str, list[Any]]:
        """Axis name → values; the grid is their product, seeds last by convention."""

    def cells(self, seeds: int) -> list[Cell]:
        axes = self.axes(seeds)
        size = math.prod(len(values) for values in axes.values())
        if size > MAX_CELLS:
            raise ConfigError(f"experiment {self.name!r} with {seeds} seed(s) has {size:,} "
                              f"cells, more than the {MAX_CELLS:,} one run folder holds")
        return [Cell(tuple(zip(axes, values))) for values in itertools.product(*axes.values())]

    @abstractmethod
    def run_cell(self, cell: Cell, context: Context) -> dict[str, Any]:
        """The cell's measurements (numbers and short strings, JSON-ready)."""

    @abstractmethod
    def summarize(self, results: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
        """(the merged JSON's summary, its Markdown) from every cell's record."""

    def cell_of(self, record: dict[str, Any]) -> Cell:
        """The cell a merged record is of (records keep its values, not their axis order)."""
        return Cell(tuple((axis, record["cell"][axis]) for axis in self.axes(1)))

    def figures(self, results: list[dict[str, Any]], out: Path, folder: Path) -> list[Path]:
        """Pictures drawn at --merge into `folder` from the cells' records and what they left
        under `out` (their evaluations); the Markdown shows each. None by default."""
        return []


EXPERIMENTS: Registry[type[Experiment]] = Registry("experiment")


def register_experiment(name: str) -> Callable[[type[Experiment]], type[Experiment]]:
    def decorate(cls: type[Experiment]) -> type[Experiment]:
        cls.name = name
        return EXPERIMENTS.register(name)(cls)

    return decorate
