"""Walkable cells and connected regions of a Doom map, from its sector geometry.

A map is rasterised on a 16-unit grid. A cell is walkable when its sector has head room for the
player, its floor is not liquid or damaging, and it keeps the player's radius from every line
the player cannot cross. Walkable cells are linked when their floors differ by at most a step;
closed doors (sectors with no head room) therefore split a map into regions, and a point-goal
episode keeps its spawn and its goal inside one region.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from gradleak.envs.wad import MapData

T = TypeVar("T")

CELL = 16.0  # grid pitch, map units
UNITS_PER_METRE = 32.0  # the player is 56 units (1.75 m) tall
CELL_AREA_M2 = (CELL / UNITS_PER_METRE) ** 2
PLAYER_RADIUS = 16.0
MAX_STEP = 24.0  # highest ledge the player climbs
PLAYER_HEIGHT = 56.0
SPAWN_CLEARANCE = 48.0  # spawns and goals keep this far from walls, trigger lines and things
MIN_REGION_CELLS = 400  # about 10 m x 10 m of floor
MIN_SPAWN_CELLS = 64  # and room for spawns and goals: about 16 m² of it clear of walls
ML_BLOCKING = 0x0001
HAZARD_TEXTURES = ("NUKAGE", "LAVA", "BLOOD", "FWATER", "SLIME")
DAMAGE_SPECIALS = frozenset({4, 5, 7, 11, 16})  # vanilla Doom damaging sector types
BOOM_DAMAGE_BITS = 0x60
GEOMETRY_VERSION = 3


@dataclass
class MapGeometry:
    """Rasterised geometry: per-cell floor height, walkability and region label."""

    map_name: str
    origin: tuple[float, float]  # map coordinates of the centre of cell (0, 0)
    floor: np.ndarray  # (ny, nx) float32, NaN outside every sector
    walkable: np.ndarray  # (ny, nx) bool
    spawnable: np.ndarray  # (ny, nx) bool: walkable and SPAWN_CLEARANCE from walls/triggers
    region: np.ndarray  # (ny, nx) int32: region index (0 = largest), -1 elsewhere

    @property
    def num_regions(self) -> int:
        return region_count(self.region)

    def region_sizes(self) -> list[int]:
        return np.bincount(self.region[self.region >= 0], minlength=self.num_regions).tolist()

    def spawn_points(self, region: int) -> np.ndarray:
        """(n, 2) map coordinates of the cells of `region` where spawns and goals may lie."""
        iy, ix = np.nonzero(self.spawnable & (self.region == region))
        return np.stack([self.origin[0] + ix * CELL, self.origin[1] + iy * CELL], axis=1)

    def save(self, path: Path) -> None:
        arrays = {"floor": self.floor, "walkable": self.walkable, "spawnable": self.spawnable,
                  "region": self.region}
        meta = {"map_name": self.map_name, "origin": list(self.origin),
                "version": GEOMETRY_VERSION, "num_regions": self.num_regions}
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp.npz")
        try:
            with os.fdopen(fd, "wb") as handle:
                np.savez_compressed(handle, meta=np.array(json.dumps(meta)), **arrays)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @classmethod
    def load(cls, path: Path) -> MapGeometry | None:
        """The cached geometry, or None when the cache is absent, stale or unreadable."""
        return _read_cache(path, lambda meta, data: cls(
            map_name=meta["map_name"], origin=tuple(meta["origin"]), floor=data["floor"],
            walkable=data["walkable"], spawnable=data["spawnable"], region=data["region"]))

    @staticmethod
    def cached_region_count(path: Path) -> int | None:
        """The cached geometry's region count from its metadata, or from its labels in a
        cache written without it (listing the 25-map train split's regions: 5 against 25 ms,
        and a third of the time of `load`, which listing scenes once paid for every map);
        None as `load`."""
        return _read_cache(path, lambda meta, data: int(meta["num_regions"])
                           if "num_regions" in meta else region_count(data["region"]))


def _read_cache(path: Path, read: Callable[[dict[str, Any], Any], T]) -> T | None:
    """read(meta, arrays) on a cached geometry file (arrays decompressed as they are asked
    for), or None when the file is absent, of another GEOMETRY_VERSION or unreadable."""
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            return read(meta, data) if meta.get("version") == GEOMETRY_VERSION else None
    except (OSError, KeyError, ValueError):
        return None


def region_count(region: np.ndarray) -> int:
    return int(region.max()) + 1 if region.size else 0


def build_geometry(data: MapData) -> MapGeometry:
    x_centres, y_centres = _grid(data)
    sector = _sector_of_cells(data, x_centres, y_centres)
    inside = sector >= 0
    floor = np.where(inside, data.sector_floor[sector], np.nan)
    ceiling = np.where(inside, data.sector_ceiling[sector], np.nan)
    hazard = _hazardous_sectors(data)[np.maximum(sector, 0)]
    candidate = inside & (ceiling - floor >= PLAYER_HEIGHT) & ~hazard

    blocking, trigger = _line_classes(data)
    cap = SPAWN_CLEARANCE + CELL
    wall_distance = _distance_to_lines(data.line_vertices[blocking], x_centres, y_centres,
                                       candidate, cap)
    trigger_distance = _distance_to_lines(data.line_vertices[trigger], x_centres, y_centres,
                                          candidate, cap)
    # Keeping the player radius from walls, and over half a cell from trigger lines, means no
    # pair of neighbouring walkable cells can straddle either kind of line.
    walkable = candidate & (wall_distance >= PLAYER_RADIUS) & (trigger_distance > CELL / 2)
    spawnable = walkable & (wall_distance >= SPAWN_CLEARANCE) & (
        trigger_distance >= SPAWN_CLEARANCE)
    # Warping onto a solid thing (a tree, a barrel) leaves the player on top of it or stuck
    # at z = -32768 in the engine: spawns keep a large thing's radius plus the player's.
    thing_distance = _distance_to_points(data.things, x_centres, y_centres, candidate, cap)
    spawnable &= thing_distance >= SPAWN_CLEARANCE
    region = _regions(walkable, spawnable, floor)
    return MapGeometry(map_name=data.name, origin=(float(x_centres[0]), float(y_centres[0])),
                       floor=floor.astype(np.float32), walkable=walkable,
                       spawnable=spawnable & (region >= 0), region=region)


def _grid(data: MapData) -> tuple[np.ndarray, np.ndarray]:
    low = np.floor(data.vertices.min(axis=0))
    high = data.vertices.max(axis=0)
    xs = np.arange(low[0] + CELL / 2, high[0], CELL)
    ys = np.arange(low[1] + CELL / 2, high[1], CELL)
    return xs, ys


def _sector_of_cells(data: MapData, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Sector index of every cell centre by scanning each grid row from the left.

    Walking towards +x, crossing a line enters its front (right-hand) side when the line runs
    upwards and its back side when it runs downwards; the last line crossed names the sector.
    """
    x1, y1, x2, y2 = data.line_vertices.T
    entered = np.where(y2 > y1, data.line_front_sector, data.line_back_sector)
    sector = np.full((len(ys), len(xs)), -1, dtype=np.int64)
    low, high = np.minimum(y1, y2), np.maximum(y1, y2)
    for row, y in enumerate(ys):
        crossing = (low <= y) & (y < high)  # half-open: a vertex on the row counts once
        if not crossing.any():
            continue
        t = (y - y1[crossing]) / (y2[crossing] - y1[crossing])
        x_cross = x1[crossing] + t * (x2[crossing] - x1[crossing])
        order = np.argsort(x_cross, kind="stable")
        x_sorted, sector_sorted = x_cross[order], entered[crossing][order]
        last = np.searchsorted(x_sorted, xs, side="left") - 1
        sector[row] = np.where(last >= 0, sector_sorted[np.maximum(last, 0)], -1)
    return sector


def _hazardous_sectors(data: MapData) -> np.ndarray:
    texture = np.array([name.startswith(HAZARD_TEXTURES) for name in data.sector_floor_texture])
    special = data.sector_special
    damaging = np.isin(special, list(DAMAGE_SPECIALS)) | ((special & BOOM_DAMAGE_BITS) != 0)
    return texture | damaging


def _line_classes(data: MapData) -> tuple[np.ndarray, np.ndarray]:
    """Lines the player cannot cross, and passable lines that carry a special (triggers)."""
    front, back = data.line_front_sector, data.line_back_sector
    two_sided = (front >= 0) & (back >= 0)
    f, b = np.maximum(front, 0), np.maximum(back, 0)
    floor_step = np.abs(data.sector_floor[f] - data.sector_floor[b])
    opening = (np.minimum(data.sector_ceiling[f], data.sector_ceiling[b])
               - np.maximum(data.sector_floor[f], data.sector_floor[b]))
    passable = (two_sided & ((data.line_flags & ML_BLOCKING) == 0) & (floor_step <= MAX_STEP)
                & (opening >= PLAYER_HEIGHT))
    return ~passable, passable & (data.line_special != 0)


def _distance_to_lines(segments: np.ndarray, xs: np.ndarray, ys: np.ndarray, mask: np.ndarray,
                       cap: float, tile: int = 32) -> np.ndarray:
    """Distance from each masked cell centre to the nearest segment, capped at `cap`.

    Tiled so that each tile only meets the segments near it: exact, and fast on big maps.
    """
    distance = np.full(mask.shape, cap)
    if len(segments) == 0:
        return distance
    seg_low = np.minimum(segments[:, :2], segments[:, 2:])
    seg_high = np.maximum(segments[:, :2], segments[:, 2:])
    for r0 in range(0, len(ys), tile):
        for c0 in range(0, len(xs), tile):
            block = mask[r0:r0 + tile, c0:c0 + tile]
            if not block.any():
                continue
            tx, ty = xs[c0:c0 + tile], ys[r0:r0 + tile]
            near = ((seg_high[:, 0] >= tx[0] - cap) & (seg_low[:, 0] <= tx[-1] + cap)
                    & (seg_high[:, 1] >= ty[0] - cap) & (seg_low[:, 1] <= ty[-1] + cap))
            if not near.any():
                continue
            iy, ix = np.nonzero(block)
            points = np.stack([tx[ix], ty[iy]], axis=1)
            d = _point_segment_distance(points, segments[near]).min(axis=1)
            distance[r0 + iy, c0 + ix] = np.minimum(d, cap)
    return distance


def _distance_to_points(points: np.ndarray, xs: np.ndarray, ys: np.ndarray, mask: np.ndarray,
                        cap: float) -> np.ndarray:
    degenerate = np.concatenate([points, points], axis=1) if len(points) else np.zeros((0, 4))
    return _distance_to_lines(degenerate, xs, ys, mask, cap)


def _point_segment_distance(points: np.ndarray, segments: np.ndarray) -> np.ndarray:
    a, b = segments[None, :, :2], segments[None, :, 2:]
    p = points[:, None, :]
    ab = b - a
    length2 = np.maximum((ab * ab).sum(-1), 1e-12)
    t = np.clip(((p - a) * ab).sum(-1) / length2, 0.0, 1.0)
    closest = a + t[..., None] * ab
    return np.sqrt(((p - closest) ** 2).sum(-1))


def _regions(walkable: np.ndarray, spawnable: np.ndarray, floor: np.ndarray) -> np.ndarray:
    """Connected components of walkable cells (4-neighbours, floor step ≤ MAX_STEP).

    Components under MIN_REGION_CELLS walkable or MIN_SPAWN_CELLS spawnable cells are dropped
    (long corridors have floor but nowhere to spawn); the rest are numbered by size.
    """
    ny, nx = walkable.shape
    index = np.arange(ny * nx).reshape(ny, nx)
    edges = []
    for a, b, fa, fb in ((walkable[:, :-1], walkable[:, 1:], floor[:, :-1], floor[:, 1:]),
                         (walkable[:-1, :], walkable[1:, :], floor[:-1, :], floor[1:, :])):
        linked = a & b & (np.abs(np.nan_to_num(fa) - np.nan_to_num(fb)) <= MAX_STEP)
        edges.append(linked)
    src = np.concatenate([index[:, :-1][edges[0]], index[:-1, :][edges[1]]])
    dst = np.concatenate([index[:, 1:][edges[0]], index[1:, :][edges[1]]])
    graph = coo_matrix((np.ones(len(src)), (src, dst)), shape=(ny * nx, ny * nx))
    _, labels = connected_components(graph, directed=False)
    labels = np.where(walkable.ravel(), labels, -1)
    inside = labels >= 0
    sizes = np.bincount(labels[inside], minlength=ny * nx)
    spawns = np.bincount(labels[inside & spawnable.ravel()], minlength=ny * nx)
    big = [int(c) for c in np.argsort(-sizes, kind="stable")
           if sizes[c] >= MIN_REGION_CELLS and spawns[c] >= MIN_SPAWN_CELLS]
    relabel = np.full(len(sizes) + 1, -1, dtype=np.int32)
    relabel[big] = np.arange(len(big), dtype=np.int32)
    return relabel[labels].reshape(ny, nx)
