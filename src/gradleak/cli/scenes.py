"""`gradleak scenes`: the maps, their regions and the train/held-out split of a WAD."""

from __future__ import annotations

import argparse

from gradleak.cli.common import common_flags, emit


def run(args: argparse.Namespace) -> None:
    from gradleak.envs.geometry import CELL_AREA_M2
    from gradleak.envs.scenes import SceneCatalog
    from gradleak.report.tables import text_table

    catalog = SceneCatalog(args.wad)
    rows = []
    for split in ("train", "heldout"):
        for map_name in catalog.split_maps(split):
            geometry = catalog.geometry(map_name)
            rows.append({"map": map_name, "split": split, "regions": geometry.num_regions,
                         "largest_region_m2": round(max(geometry.region_sizes(), default=0)
                                                    * CELL_AREA_M2, 1)})
    excluded = catalog.excluded_maps()
    data = {"wad": str(catalog.wad.path), "maps": rows, "excluded": excluded,
            "train_scenes": sum(r["regions"] for r in rows if r["split"] == "train"),
            "heldout_scenes": sum(r["regions"] for r in rows if r["split"] == "heldout")}
    text = (f"{catalog.wad.path}\n" + text_table(rows, ["map", "split", "regions",
                                                        "largest_region_m2"])
            + f"\n{data['train_scenes']} training scenes, {data['heldout_scenes']} held-out "
            f"scenes; excluded maps: {', '.join(excluded) or 'none'}")
    emit(args, data, text)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scenes", help="list the maps, regions and the train/held-out split")
    common_flags(p)
    p.add_argument("--wad", default=None)
    p.set_defaults(func=run)
