"""`gradleak experiment NAME`: run a registered grid cell by cell, resume it, shard it, merge it.

    OUT/experiment.json      the settings (a rerun with other settings is refused, naming them)
    OUT/cells/<cell>.json    one record per finished cell, written atomically when it finishes
    OUT/shared/...           work cells share (victims, captures), built once under a lock

`--import-cells RESULTS/NAME.json` seeds OUT/cells from an earlier session's merged result, so
a grid longer than one session continues where that one stopped.

`--merge` reads every cell and writes benchmarks/results/NAME.{json,md}: one table per
experiment, mean ± std over seeds, with what each cell cost (CPU and wall minutes).
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gradleak.errors import ConfigError
from gradleak.experiments.base import EXPERIMENTS, Cell, Context, Experiment, locked
from gradleak.io import (
    atomic_path,
    owned_folder,
    read_json,
    release_lock,
    try_lock,
    write_json,
)

FORMAT = "gradleak-experiment"
CLOCKS = ("cpu", "wall")
MAX_SEEDS = 1000


@dataclass
class ExperimentSettings:
    name: str
    seeds: int = 2
    budget_minutes: float = 5.0  # per cell, for whatever the cell trains
    clock: str = "cpu"  # cells side by side get equal compute, not equal wall time
    preset: str = "cpu-bench"
    overrides: list[str] = field(default_factory=list)  # --set section.field=value

    def check(self) -> None:
        EXPERIMENTS.get(self.name)
        if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or \
                not 1 <= self.seeds <= MAX_SEEDS:
            raise ConfigError(f"--seeds {self.seeds!r}: expected an integer from 1 to "
                              f"{MAX_SEEDS}")
        if not self.budget_minutes > 0:
            raise ConfigError(f"--budget-minutes {self.budget_minutes}: expected > 0")
        if self.clock not in CLOCKS:
            raise ConfigError(f"--clock {self.clock!r}: expected cpu or wall")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_shard(text: str | None) -> tuple[int, int]:
    if text is None:
        return 0, 1
    index, _, count = text.partition("/")
    try:
        shard = int(index), int(count)
    except ValueError:
        shard = (-1, 0)
    if not 0 <= shard[0] < shard[1]:
        raise ConfigError(f"--shard {text!r}: expected I/N with 0 <= I < N, e.g. 0/4")
    return shard


def parse_where(texts: list[str] | None, axes: dict[str, list[Any]]
                ) -> dict[str, set[str]]:
    """--where AXIS=V1,V2 (repeatable) → axis → the values kept (as their text). An axis the
    experiment lacks, or a value not on its axis (a typo would otherwise run nothing), is
    refused, naming what there is."""
    where: dict[str, set[str]] = {}
    for text in texts or []:
        axis, _, values = text.partition("=")
        if axis not in axes:
            raise ConfigError(f"--where {text!r}: the axes are {', '.join(axes)}")
        known = [str(value) for value in axes[axis]]
        wanted = {value for value in values.split(",") if value}
        unknown = sorted(wanted - set(known))
        if not wanted or unknown:
            raise ConfigError(f"--where {text!r}: expected {axis}=V1,V2,... from "
                              f"{', '.join(known)}")
        where[axis] = where.get(axis, set(known)) & wanted
    return where


def kept(cell: Cell, where: dict[str, set[str]]) -> bool:
    return all(str(cell[axis]) in values for axis, values in where.items())


def cell_path(out: Path, cell: Cell) -> Path:
    return out / "cells" / f"{cell.id}.json"


def claim(out: Path, settings: ExperimentSettings, resume: bool, cells: list[Cell]) -> None:
    """A new or empty folder, or this experiment's own with the same settings. Shards claim
    it one at a time (a lock file beside it): a shard started with another would otherwise
    find the other's marker half-written (its temporary file in the folder, the marker not
    yet there) and refuse the folder as a stranger's."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with locked(out.parent / f".{out.name}.claim.lock"):
        _claim(out, settings, resume, cells)


def _claim(out: Path, settings: ExperimentSettings, resume: bool, cells: list[Cell]) -> None:
    found = owned_folder(out, "experiment.json", FORMAT, "--out", "an experiment run")
    if found is not None:
        before = found.get("settings", {})
        changed = sorted(k for k, v in settings.to_dict().items() if before.get(k) != v)
        if changed:
            raise ConfigError(f"--out {out} holds a run with other settings ("
                              + ", ".join(f"{k}: {before.get(k)!r} → {settings.to_dict()[k]!r}"
                                          for k in changed) + "): use a new --out")
        done = [cell.id for cell in cells if cell_path(out, cell).exists()]
        if not resume and done:  # this shard ran before; the other shards' cells are theirs
            raise ConfigError(f"--out {out} already holds {len(done)} finished cell(s) of this "
                              f"run ({done[0]}, ...): pass --resume to run only the missing "
                              "ones")
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "experiment.json", {"format": FORMAT, "settings": settings.to_dict()})


def importable_cells(settings: ExperimentSettings, source: Path
                     ) -> list[tuple[Cell, dict[str, Any]]]:
    """The finished cells of a merged result (benchmarks/results/NAME.json, written by an
    earlier session whose run folder is gone), checked: the same experiment, run with these
    very settings, every cell in this grid. Nothing is written."""
    data = read_json(source, "merged experiment result")
    if data.get("experiment") != settings.name or not isinstance(data.get("cells"), list):
        raise ConfigError(f"--import-cells {source}: not a merged result of experiment "
                          f"{settings.name!r} (it says {data.get('experiment')!r})")
    before, now = data.get("settings", {}), settings.to_dict()
    changed = sorted(k for k in now if before.get(k) != now[k])
    if changed:
        raise ConfigError(f"--import-cells {source} was run with other settings ("
                          + ", ".join(f"{k}: {before.get(k)!r} → {now[k]!r}" for k in changed)
                          + "): its cells would not be comparable")
    experiment: Experiment = EXPERIMENTS.get(settings.name)()
    grid = {cell.id for cell in experiment.cells(settings.seeds)}
    cells = []
    for record in data["cells"]:
        cell = check_record(record, experiment, f"--import-cells {source}")
        if cell.id not in grid:
            raise ConfigError(f"--import-cells {source}: cell {cell.id} is not in the grid of "
                              f"{settings.seeds} seed(s)")
        cells.append((cell, record))
    return cells


def run_experiment(settings: ExperimentSettings, out: Path, resume: bool = False,
                   shard: str | None = None, progress: bool = False,
                   shared: Path | None = None, import_from: Path | None = None,
                   where: list[str] | None = None) -> dict[str, Any]:
    """Run this shard's missing cells, after taking those `import_from` (an earlier session's
    merged result) holds, marked with where they came from (a cell OUT already holds is
    kept); returns what was imported, what ran and what is still missing. `where` (AXIS=V1,V2
    texts) runs a slice of the grid first, e.g. the defended cells of a long experiment; the
    shards split the slice, and the merge still wants the whole grid."""
    from tqdm import tqdm

    from gradleak.presets import load_preset, validate_preset

    settings.check()
    index, count = parse_shard(shard)
    preset = validate_preset(load_preset(settings.preset, settings.overrides), "--set")
    experiment: Experiment = EXPERIMENTS.get(settings.name)()
    chosen = parse_where(where, experiment.axes(settings.seeds))
    cells = [cell for cell in experiment.cells(settings.seeds) if kept(cell, chosen)]
    cells = cells[index::count]
    importing = importable_cells(settings, import_from) if import_from is not None else []
    claim(out, settings, resume or import_from is not None, cells)
    imported = []
    for cell, record in importing:
        if not cell_path(out, cell).exists():
            write_json(cell_path(out, cell), {**record, "imported_from": str(import_from)})
            imported.append(cell.id)
    context = Context(out, settings.budget_minutes, settings.clock, preset, progress, shared)
    ran, elsewhere = [], []
    (out / "cells").mkdir(exist_ok=True)
    for cell in tqdm(cells, disable=not progress, desc=settings.name):
        path = cell_path(out, cell)
        if path.exists():
            continue
        lock = path.with_name(f".{path.name}.lock")
        fd, _ = try_lock(lock)
        if fd is None:  # another run of this folder is running it
            elsewhere.append(cell.id)
            continue
        try:
            if not path.exists():  # it may have finished between our look and the lock
                run_cell(experiment, cell, context, path)
                ran.append(cell.id)
        finally:
            release_lock(lock, fd)
    missing = [c.id for c in experiment.cells(settings.seeds) if not cell_path(out, c).exists()]
    return {"experiment": settings.name, "shard": f"{index}/{count}", "imported": imported,
            "ran": ran, "running_elsewhere": elsewhere, "cells_in_shard": len(cells),
            "missing_in_grid": missing}


def run_cell(experiment: Experiment, cell: Cell, context: Context, path: Path) -> None:
    wall, cpu = time.perf_counter(), time.process_time()
    shared_before = context.shared_cpu_minutes
    result = experiment.run_cell(cell, context)
    shared = context.shared_cpu_minutes - shared_before
    # the cell's own cost; the victims and captures it happened to build are apart
    write_json(path, {"cell": cell.to_dict(), "result": result,
                      "wall_minutes": (time.perf_counter() - wall) / 60,
                      "cpu_minutes": (time.process_time() - cpu) / 60 - shared,
                      "shared_cpu_minutes": shared})


def check_record(record: Any, experiment: Experiment, source: str) -> Cell:
    """A cell record as a merge reads it: an object with the cell's axes, a result object and
    its cost in minutes. Returns its cell."""
    if not isinstance(record, dict):
        raise ConfigError(f"{source}: a cell record is a {type(record).__name__}, expected an "
                          "object")
    try:
        cell = experiment.cell_of(record)
    except (KeyError, TypeError):
        raise ConfigError(f"{source}: a cell record without this experiment's axes "
                          f"({str(record.get('cell'))[:80]!r})") from None
    if not isinstance(record.get("result"), dict):
        raise ConfigError(f"{source}: cell {cell.id} has result {record.get('result')!r:.60}, "
                          "expected an object")
    for key in ("cpu_minutes", "wall_minutes"):
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not 0 <= value < float("inf"):
            raise ConfigError(f"{source}: cell {cell.id} has {key} {value!r:.40}, expected "
                              "minutes >= 0")
    return cell


def merge_experiment(out: Path, results: Path, allow_partial: bool = False
                     ) -> tuple[Path, Path]:
    """Every cell's record → RESULTS/NAME.json and NAME.md (refused while cells are missing,
    unless allow_partial, which names them in both files)."""
    meta = read_json(out / "experiment.json", "experiment")
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{out}/experiment.json is not an experiment run's")
    settings = ExperimentSettings(**meta["settings"])
    experiment: Experiment = EXPERIMENTS.get(settings.name)()
    cells = experiment.cells(settings.seeds)
    records = [read_json(cell_path(out, c), f"cell {c.id}") for c in cells
               if cell_path(out, c).exists()]
    for cell, record in zip([c for c in cells if cell_path(out, c).exists()], records):
        if check_record(record, experiment, str(cell_path(out, cell))) != cell:
            raise ConfigError(f"{cell_path(out, cell)}: holds the record of cell "
                              f"{experiment.cell_of(record).id}")
    missing = [c.id for c in cells if not cell_path(out, c).exists()]
    if missing and not allow_partial:
        raise ConfigError(f"{len(missing)} of {len(cells)} cells have not run ("
                          f"{', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}): run "
                          "the missing shards, or --allow-partial")
    if not records:
        raise ConfigError(f"{out}: no cell has finished yet")
    summary, markdown = experiment.summarize(records)
    results.mkdir(parents=True, exist_ok=True)
    pictures = experiment.figures(records, out, results)
    markdown += "".join(f"\n\n![{p.stem}]({p.name})" for p in pictures)
    cost = [r["cpu_minutes"] for r in records]
    shared_cost = sum(r.get("shared_cpu_minutes", 0.0) for r in records)
    imported = sorted({r["imported_from"] for r in records if "imported_from" in r})
    checkpoints = victim_checkpoints(records)
    data = {"experiment": settings.name, "description": experiment.description,
            "settings": settings.to_dict(), "summary": summary, "cells": records,
            "missing": missing, "machine": machine(),
            "cpu_minutes_total": sum(cost), "cpu_minutes_median_cell": statistics.median(cost),
            "shared_cpu_minutes": shared_cost, "figures": [p.name for p in pictures],
            "victim_checkpoints": {k: sorted(v) for k, v in checkpoints.items()}}
    json_path, md_path = results / f"{settings.name}.json", results / f"{settings.name}.md"
    write_json(json_path, data)
    note = f"\n\n{len(missing)} cells missing: {', '.join(missing)}\n" if missing else "\n"
    for victim, hashes in sorted(checkpoints.items()):
        if len(hashes) > 1:  # a victim rebuilt after code changes (or elsewhere) differs
            note += (f"\nThe {victim} cells attacked {len(hashes)} different checkpoints of "
                     f"that victim (θ0 {', '.join(h[:12] for h in sorted(hashes))}): its rows "
                     "mix victims trained alike, not one victim.\n")
    if imported:
        count = sum(1 for r in records if "imported_from" in r)
        note += (f"\n{count} of the {len(records)} cells were run by an earlier session and "
                 f"imported from {', '.join(imported)}{_where_the_rest_ran(records)}.\n")
    with atomic_path(md_path) as tmp:
        tmp.write_text(f"# `gradleak experiment {settings.name}`\n\n{experiment.description}\n\n"
                       f"Settings: {settings.to_dict()}; {machine()}; "
                       f"{sum(cost):.1f} CPU minutes over {len(records)} cells, and "
                       f"{shared_cost:.1f} building the victims and captures they share.\n\n"
                       + markdown.rstrip() + note)
    return json_path, md_path


def _where_the_rest_ran(records: list[dict[str, Any]]) -> str:
    """The cells run beside imported ones: on the very checkpoints the imported cells attacked
    (a --shared folder kept from that session), or on victims this run rebuilt from the same
    preset, which training does not reproduce bit for bit. A cell without a θ0 counts as
    rebuilt."""
    earlier = {_checkpoint(r) for r in records if "imported_from" in r}
    rest = [_checkpoint(r) for r in records if "imported_from" not in r]
    if not rest:
        return ""
    if all(theta0 and (victim, theta0) in earlier for victim, theta0 in rest):
        return "; the others ran here on the same checkpoints (their θ0 hashes match)"
    return "; the others ran on victims rebuilt from the same preset"


def victim_checkpoints(records: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Per victim axis value (or "victim"), the θ0 hashes its cells attacked (cells that
    record one)."""
    found: dict[str, set[str]] = {}
    for victim, theta0 in map(_checkpoint, records):
        if theta0:
            found.setdefault(victim, set()).add(theta0)
    return found


def _checkpoint(record: dict[str, Any]) -> tuple[str, str | None]:
    """A cell's victim axis value (or "victim") and the θ0 hash it attacked, if it records one."""
    return (str(record["cell"].get("victim", "victim")),
            record.get("result", {}).get("theta0_sha256"))


def machine() -> str:
    import torch

    return (f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}")


def mean_std(values: list[float], digits: int = 2) -> str:
    """'m ± s' over seeds (population std); a single value says so instead of '± 0', which
    would read as seeds that agreed."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f} (n = 1)"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.pstdev(values):.{digits}f}"


def grouped(records: list[dict[str, Any]], by: list[str]) -> dict[tuple, list[dict[str, Any]]]:
    """Records grouped by the values of the axes `by` (seeds pooled), in first-seen order."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault(tuple(record["cell"][axis] for axis in by), []).append(record)
    return groups
