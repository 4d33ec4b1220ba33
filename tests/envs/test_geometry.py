"""Scene geometry read from WAD bytes: sectors, doors, hazards, things, regions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import write_test_wad

from gradleak.envs import geometry as geometry_module
from gradleak.envs.geometry import CELL, SPAWN_CLEARANCE, MapGeometry, build_geometry
from gradleak.envs.scenes import SceneCatalog
from gradleak.envs.wad import Wad
from gradleak.errors import ConfigError, WadError


@pytest.fixture
def geometry(tmp_path: Path) -> MapGeometry:
    return build_geometry(Wad(write_test_wad(tmp_path / "rooms.wad")).read_map("MAP01"))


def cell_at(geometry: MapGeometry, x: float, y: float) -> tuple[int, int]:
    return (round((y - geometry.origin[1]) / CELL), round((x - geometry.origin[0]) / CELL))


def test_closed_door_splits_the_map_into_two_regions(geometry: MapGeometry) -> None:
    assert geometry.num_regions == 2
    room_a = geometry.region[cell_at(geometry, 100, 400)]
    room_b = geometry.region[cell_at(geometry, 700, 100)]
    assert {int(room_a), int(room_b)} == {0, 1}


def test_cells_keep_the_player_radius_from_walls(geometry: MapGeometry) -> None:
    assert not geometry.walkable[cell_at(geometry, 8, 200)]  # 8 units from the west wall
    assert geometry.walkable[cell_at(geometry, 40, 200)]
    assert not geometry.walkable[cell_at(geometry, 540, 256)]  # inside the closed door


def test_liquid_floor_is_not_walkable(geometry: MapGeometry) -> None:
    assert not geometry.walkable[cell_at(geometry, 850, 250)]
    assert geometry.walkable[cell_at(geometry, 1000, 400)]


def test_spawns_keep_clear_of_walls_and_things(geometry: MapGeometry) -> None:
    points = np.concatenate([geometry.spawn_points(r) for r in range(geometry.num_regions)])
    tree = np.array([256.0, 256.0])
    assert np.hypot(*(points - tree).T).min() >= SPAWN_CLEARANCE
    assert points[:, 0].min() >= SPAWN_CLEARANCE and points[:, 1].min() >= SPAWN_CLEARANCE


def test_geometry_cache_round_trip(geometry: MapGeometry, tmp_path: Path) -> None:
    geometry.save(tmp_path / "g.npz")
    loaded = MapGeometry.load(tmp_path / "g.npz")
    assert loaded is not None
    assert np.array_equal(loaded.region, geometry.region)
    assert loaded.origin == geometry.origin


def test_catalog_uses_every_fourth_map_rule_for_other_wads(tmp_path: Path) -> None:
    catalog = SceneCatalog(write_test_wad(tmp_path / "rooms.wad"), cache_dir=tmp_path / "cache")
    assert catalog.split_maps("train") == ["MAP01"] and catalog.split_maps("heldout") == []
    assert [s.name for s in catalog.scenes("train")] == ["MAP01/r00", "MAP01/r01"]
    assert any((tmp_path / "cache").rglob("MAP01.npz"))


def unreadable(path: Path) -> None:
    raise AssertionError(f"{path} was read")


def test_listing_scenes_reads_region_labels_and_leaves_geometry_to_the_first_visit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wad = write_test_wad(tmp_path / "rooms.wad")
    SceneCatalog(wad, cache_dir=tmp_path / "cache").scenes("train")  # builds the cache
    catalog = SceneCatalog(wad, cache_dir=tmp_path / "cache")
    with monkeypatch.context() as patch:  # listing works with no geometry readable
        patch.setattr(MapGeometry, "load", unreadable)
        assert [s.name for s in catalog.scenes("train")] == ["MAP01/r00", "MAP01/r01"]
    assert catalog.geometry("MAP01").num_regions == 2


def test_an_environment_checks_its_scenes_on_the_counts_the_listing_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture's rollout process builds its environment on the plan's catalog before its
    first episode: checking every scene needs no geometry and no cache file again (loading
    all 25 train maps' geometry there cost 70 ms), and a region past the count is refused."""
    from gradleak.envs.doomnav import DoomNavConfig, DoomNavEnv

    wad = write_test_wad(tmp_path / "rooms.wad")
    SceneCatalog(wad, cache_dir=tmp_path / "cache").scenes("train")  # builds the cache
    catalog = SceneCatalog(wad, cache_dir=tmp_path / "cache")
    scenes = [s.name for s in catalog.scenes("train")]
    for name in ("load", "cached_region_count"):
        monkeypatch.setattr(MapGeometry, name, unreadable)
    env = DoomNavEnv(DoomNavConfig(wad=str(wad), scenes=scenes * 3), catalog=catalog)
    assert len(env.scenes) == 6
    with pytest.raises(ConfigError, match="MAP01 has 2 regions"):
        DoomNavEnv(DoomNavConfig(wad=str(wad), scenes=["MAP01/r02"]), catalog=catalog)


def test_the_region_count_comes_from_the_metadata_or_an_older_cache_s_labels(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    SceneCatalog(write_test_wad(tmp_path / "rooms.wad"),
                 cache_dir=tmp_path / "cache").scenes("train")
    cached = next((tmp_path / "cache").rglob("MAP01.npz"))
    with monkeypatch.context() as patch:  # labels never read: the metadata holds the count
        patch.setattr(geometry_module, "region_count", None)
        assert MapGeometry.cached_region_count(cached) == 2
    with np.load(cached) as data:
        arrays = dict(data)
    meta = json.loads(str(arrays.pop("meta")))
    del meta["num_regions"]  # as caches were written before the count was kept
    with open(cached, "wb") as handle:
        np.savez_compressed(handle, meta=np.array(json.dumps(meta)), **arrays)
    assert MapGeometry.cached_region_count(cached) == 2


def test_a_stale_or_broken_cache_is_rebuilt_when_the_scenes_are_listed(tmp_path: Path) -> None:
    wad = write_test_wad(tmp_path / "rooms.wad")
    catalog = SceneCatalog(wad, cache_dir=tmp_path / "cache")
    catalog.scenes("train")
    cached = next((tmp_path / "cache").rglob("MAP01.npz"))
    cached.write_bytes(b"not an npz")
    assert MapGeometry.cached_region_count(cached) is None
    again = SceneCatalog(wad, cache_dir=tmp_path / "cache")
    assert [s.name for s in again.scenes("train")] == ["MAP01/r00", "MAP01/r01"]
    assert MapGeometry.cached_region_count(cached) == 2  # rebuilt and saved


@pytest.mark.parametrize("content, message", [
    (b"", "too short"),
    (b"JUNKJUNKJUNKJUNK", "not a WAD file"),
    (b"PWAD" + (5).to_bytes(4, "little") + (9999).to_bytes(4, "little"), "truncated"),
])
def test_bad_wad_files_are_named(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.wad"
    path.write_bytes(content)
    with pytest.raises(WadError, match=message) as info:
        Wad(path)
    assert str(path) in str(info.value)


def test_missing_wad_and_unknown_map(tmp_path: Path) -> None:
    with pytest.raises(WadError, match="does not exist"):
        Wad(tmp_path / "nope.wad")
    with pytest.raises(WadError, match="MAP07.*holds: MAP01"):
        Wad(write_test_wad(tmp_path / "rooms.wad")).read_map("MAP07")
