"""Scenes (reachable regions of Doom maps) and the fixed train / held-out split of maps.

A scene is one connected region of one map: spawn and goal always lie in the same region, so
every episode is solvable without opening doors (the agent has no USE button). Held-out maps
never appear in training, so held-out scenes test an attacker on unseen architecture and
textures, as the paper's held-out AI2-THOR scenes do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gradleak.envs.geometry import MapGeometry, build_geometry
from gradleak.envs.wad import Wad, default_wad_path
from gradleak.errors import ConfigError

SPLITS = ("train", "heldout", "all")

# freedoom2.wad (as shipped with vizdoom): MAP30 is the boss arena (one red room), MAP02 renders
# dark in 60% of random views (benchmarks/results/scene_survey.json). Held-out maps are spread
# over the episode order so early, middle and late map styles are all represented.
FREEDOOM2_EXCLUDED = ("MAP02", "MAP30")
FREEDOOM2_HELDOUT = ("MAP05", "MAP11", "MAP17", "MAP23", "MAP29")


@dataclass(frozen=True, order=True)
class Scene:
    map_name: str
    region: int

    @property
    def name(self) -> str:
        return f"{self.map_name}/r{self.region:02d}"

    @classmethod
    def parse(cls, text: str) -> Scene:
        map_name, _, region = text.partition("/r")
        if not map_name or not region.isdigit():
            raise ConfigError(f"scene {text!r}: expected MAPxx/rNN, e.g. MAP07/r00")
        return cls(map_name.upper(), int(region))


def cache_root() -> Path:
    return Path(os.environ.get("GRADLEAK_CACHE", Path.home() / ".cache" / "gradleak"))


class SceneCatalog:
    """The maps of one WAD, their cached geometry, and the fixed split into scenes."""

    def __init__(self, wad_path: str | os.PathLike[str] | None = None,
                 cache_dir: Path | None = None) -> None:
        self.wad = Wad(wad_path or default_wad_path())
        self._digest = self.wad.sha256()
        self.cache_dir = (cache_dir or cache_root() / "geometry") / self._digest[:16]
        self._geometry: dict[str, MapGeometry] = {}
        self._region_counts: dict[str, int] = {}

    @property
    def is_default_wad(self) -> bool:
        return self.wad.path.name.lower() == "freedoom2.wad" and self.wad.is_iwad

    def geometry(self, map_name: str) -> MapGeometry:
        if map_name not in self._geometry:
            path = self._cache_path(map_name)
            cached = MapGeometry.load(path)
            if cached is None:
                cached = build_geometry(self.wad.read_map(map_name))
                cached.save(path)
            self._geometry[map_name] = cached
        return self._geometry[map_name]

    def region_count(self, map_name: str) -> int:
        """The map's regions, from the cache's labels where the geometry is not loaded yet: a
        capture lists every map's scenes but visits a few maps, whose geometry its rollout
        loads when it gets there (listing the 25-map train split: 71–81 → 49–52 ms, 27 of
        them the WAD's hash and directory). Kept once read: an environment checks each of its
        scenes, 237 of them on 25 maps in the train split, in a capture's forked rollout
        process, whose first episode waits for it."""
        if map_name not in self._region_counts:
            count = None if map_name in self._geometry else \
                MapGeometry.cached_region_count(self._cache_path(map_name))
            self._region_counts[map_name] = self.geometry(map_name).num_regions \
                if count is None else count
        return self._region_counts[map_name]

    def _cache_path(self, map_name: str) -> Path:
        return self.cache_dir / f"{map_name}.npz"

    def excluded_maps(self) -> list[str]:
        return list(FREEDOOM2_EXCLUDED) if self.is_default_wad else []

    def split_maps(self, split: str) -> list[str]:
        if split not in SPLITS:
            raise ConfigError(f"scene split {split!r}: expected one of {', '.join(SPLITS)}")
        usable = [m for m in self.wad.map_names() if m not in self.excluded_maps()]
        # Any other WAD: every fourth usable map is held out, so the rule is fixed and visible.
        heldout = (set(FREEDOOM2_HELDOUT) if self.is_default_wad
                   else set(usable[3::4]))
        if split == "train":
            return [m for m in usable if m not in heldout]
        if split == "heldout":
            return [m for m in usable if m in heldout]
        return usable

    def scenes(self, split: str, maps: list[str] | None = None,
               max_regions_per_map: int | None = None) -> list[Scene]:
        allowed = self.split_maps(split)
        chosen = maps if maps else allowed
        for map_name in chosen:
            if map_name not in allowed:
                raise ConfigError(f"map {map_name} is not in the {split!r} split of "
                                  f"{self.wad.path.name}; that split holds: {', '.join(allowed)}")
        found = []
        for map_name in chosen:
            regions = self.region_count(map_name)
            limit = regions if max_regions_per_map is None else min(regions, max_regions_per_map)
            found.extend(Scene(map_name, r) for r in range(limit))
        return found

    def split_of_map(self, map_name: str) -> str:
        for split in ("train", "heldout"):
            if map_name in self.split_maps(split):
                return split
        return "excluded"
