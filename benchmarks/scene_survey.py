"""Survey the maps of a WAD: regions, walkable area, geometry build time, dark views.

The dark-view fraction (views from random spawns whose mean brightness is under 20/255) is
what excluded MAP02 from the default split; MAP30 is the boss arena. Prints JSON and writes
benchmarks/results/scene_survey.json.

    python benchmarks/scene_survey.py [--wad PATH] [--views 40]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from gradleak.envs.doomnav import DoomNavConfig, DoomNavEnv
from gradleak.envs.geometry import CELL_AREA_M2, build_geometry
from gradleak.envs.scenes import SceneCatalog
from gradleak.io import atomic_path

RESULTS = Path(__file__).parent / "results" / "scene_survey.json"
DARK = 20.0


def survey_map(catalog: SceneCatalog, map_name: str, views: int) -> dict[str, object]:
    start = time.perf_counter()
    geometry = build_geometry(catalog.wad.read_map(map_name))
    build_s = time.perf_counter() - start
    scenes = [f"{map_name}/r{r:02d}" for r in range(geometry.num_regions)]
    row: dict[str, object] = {"map": map_name, "split": catalog.split_of_map(map_name),
                              "regions": geometry.num_regions,
                              "walkable_m2": round(float(geometry.walkable.sum())
                                                   * CELL_AREA_M2, 1),
                              "geometry_build_s": round(build_s, 3)}
    if scenes:
        env = DoomNavEnv(DoomNavConfig(wad=str(catalog.wad.path), frame_size=64, scenes=scenes),
                         catalog=catalog)
        brightness = [env.reset(seed=seed)[0]["image"].mean() for seed in range(views)]
        env.close()
        row["dark_view_fraction"] = float(np.mean(np.array(brightness) < DARK))
        row["mean_brightness"] = round(float(np.mean(brightness)), 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--wad", default=None)
    parser.add_argument("--views", type=int, default=40)
    args = parser.parse_args()
    catalog = SceneCatalog(args.wad)
    rows = [survey_map(catalog, m, args.views) for m in catalog.wad.map_names()]
    result = {"wad": catalog.wad.path.name, "views_per_map": args.views,
              "dark_threshold": DARK, "maps": rows}
    text = json.dumps(result, indent=2)
    print(text)
    if args.wad is None:
        with atomic_path(RESULTS) as tmp:
            tmp.write_text(text + "\n")


if __name__ == "__main__":
    main()
