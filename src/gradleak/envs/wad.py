"""A minimal Doom WAD reader: the map lumps that scene geometry needs, nothing more.

Reading the WAD ourselves (instead of asking a running engine for its sector list) makes the
geometry of every map available in a second, for any IWAD or PWAD the user has, with floor
textures and sector specials that the engine does not expose.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gradleak.errors import WadError

MAP_NAME = re.compile(r"^(MAP\d\d|E\dM\d)$")

# Lump record layouts of the Doom map format (and Hexen's linedef variant).
VERTEX = np.dtype([("x", "<i2"), ("y", "<i2")])
LINEDEF_DOOM = np.dtype(
    [("v1", "<u2"), ("v2", "<u2"), ("flags", "<u2"), ("special", "<u2"), ("tag", "<u2"),
     ("front", "<u2"), ("back", "<u2")]
)
LINEDEF_HEXEN = np.dtype(
    [("v1", "<u2"), ("v2", "<u2"), ("flags", "<u2"), ("special", "u1"), ("args", "u1", (5,)),
     ("front", "<u2"), ("back", "<u2")]
)
SIDEDEF = np.dtype(
    [("xoff", "<i2"), ("yoff", "<i2"), ("upper", "S8"), ("lower", "S8"), ("middle", "S8"),
     ("sector", "<u2")]
)
SECTOR = np.dtype(
    [("floor", "<i2"), ("ceiling", "<i2"), ("floor_tex", "S8"), ("ceiling_tex", "S8"),
     ("light", "<i2"), ("special", "<i2"), ("tag", "<i2")]
)
THING_DOOM = np.dtype([("x", "<i2"), ("y", "<i2"), ("angle", "<i2"), ("type", "<u2"),
                       ("flags", "<u2")])
THING_HEXEN = np.dtype(
    [("tid", "<u2"), ("x", "<i2"), ("y", "<i2"), ("z", "<i2"), ("angle", "<i2"), ("type", "<u2"),
     ("flags", "<u2"), ("special", "u1"), ("args", "u1", (5,))]
)
NO_SIDEDEF = 0xFFFF


@dataclass(frozen=True)
class MapData:
    """Raw geometry of one map, in map units (about 32 units per metre)."""

    name: str
    vertices: np.ndarray  # (V, 2) float64
    line_vertices: np.ndarray  # (L, 4) float64: x1, y1, x2, y2
    line_flags: np.ndarray  # (L,) int
    line_special: np.ndarray  # (L,) int
    line_front_sector: np.ndarray  # (L,) int, -1 where the side is missing
    line_back_sector: np.ndarray  # (L,) int, -1 for one-sided lines
    sector_floor: np.ndarray  # (S,) float64
    sector_ceiling: np.ndarray  # (S,) float64
    sector_floor_texture: list[str]
    sector_special: np.ndarray  # (S,) int
    sector_light: np.ndarray  # (S,) int
    things: np.ndarray  # (N, 2) float64 positions of every placed thing (solid or not)


class Wad:
    """The directory of one WAD file and lazy access to its map lumps."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise WadError(f"WAD file {self.path} is a directory (expected a Doom IWAD or PWAD)")
        if not self.path.is_file():
            raise WadError(f"WAD file {self.path} does not exist (expected a Doom IWAD or PWAD)")
        try:
            self._bytes = self.path.read_bytes()
        except OSError as err:
            raise WadError(f"WAD file {self.path} cannot be read: {err.strerror}") from None
        self.kind, self._lumps = _read_directory(self.path, self._bytes)

    @property
    def is_iwad(self) -> bool:
        return self.kind == "IWAD"

    def sha256(self) -> str:
        return hashlib.sha256(self._bytes).hexdigest()

    def map_names(self) -> list[str]:
        return [name for name, _, _ in self._lumps if MAP_NAME.match(name)]

    def read_map(self, name: str) -> MapData:
        lumps = self._map_lumps(name)
        if "TEXTMAP" in lumps:
            raise WadError(f"map {name} in {self.path} is in UDMF format; only the Doom and "
                           "Hexen binary map formats are supported")
        for needed in ("VERTEXES", "LINEDEFS", "SIDEDEFS", "SECTORS"):
            if needed not in lumps:
                raise WadError(f"map {name} in {self.path} has no {needed} lump")
        hexen = "BEHAVIOR" in lumps
        linedef, thing = (LINEDEF_HEXEN, THING_HEXEN) if hexen else (LINEDEF_DOOM, THING_DOOM)
        vertices = self._records(name, "VERTEXES", lumps, VERTEX)
        lines = self._records(name, "LINEDEFS", lumps, linedef)
        sides = self._records(name, "SIDEDEFS", lumps, SIDEDEF)
        sectors = self._records(name, "SECTORS", lumps, SECTOR)
        things = (self._records(name, "THINGS", lumps, thing) if "THINGS" in lumps
                  else np.zeros(0, dtype=thing))
        return _assemble(name, self.path, vertices, lines, sides, sectors, things)

    def _map_lumps(self, name: str) -> dict[str, tuple[int, int]]:
        names = [lump[0] for lump in self._lumps]
        if name not in names or not MAP_NAME.match(name):
            known = ", ".join(self.map_names()) or "(none)"
            raise WadError(f"map {name!r} is not in {self.path}; it holds: {known}")
        start = names.index(name)
        lumps: dict[str, tuple[int, int]] = {}
        for lump_name, offset, size in self._lumps[start + 1:]:
            if MAP_NAME.match(lump_name) or lump_name in lumps:
                break
            lumps[lump_name] = (offset, size)
        return lumps

    def _records(self, map_name: str, lump: str, lumps: dict[str, tuple[int, int]],
                 dtype: np.dtype) -> np.ndarray:
        offset, size = lumps[lump]
        if size % dtype.itemsize:
            raise WadError(f"{lump} lump of map {map_name} in {self.path} has {size} bytes, "
                           f"not a multiple of the {dtype.itemsize}-byte record")
        return np.frombuffer(self._bytes, dtype=dtype, count=size // dtype.itemsize, offset=offset)


def _read_directory(path: Path, data: bytes) -> tuple[str, list[tuple[str, int, int]]]:
    if len(data) < 12:
        raise WadError(f"{path} is too short to be a WAD file ({len(data)} bytes)")
    magic, count, table = struct.unpack("<4sii", data[:12])
    if magic not in (b"IWAD", b"PWAD"):
        raise WadError(f"{path} is not a WAD file: header {magic!r}, expected b'IWAD' or b'PWAD'")
    if count < 0 or table < 12 or table + 16 * count > len(data):
        raise WadError(f"{path} is truncated: its directory ({count} lumps at byte {table}) "
                       f"lies beyond the file's {len(data)} bytes")
    lumps = []
    for i in range(count):
        offset, size, raw = struct.unpack("<ii8s", data[table + 16 * i: table + 16 * i + 16])
        if offset < 0 or size < 0 or offset + size > len(data):
            raise WadError(f"{path} is truncated: lump {i} ends beyond the end of the file")
        lumps.append((raw.split(b"\0", 1)[0].decode("ascii", "replace").upper(), offset, size))
    return magic.decode(), lumps


def _side_sector(sides: np.ndarray, side_index: np.ndarray) -> np.ndarray:
    valid = (side_index != NO_SIDEDEF) & (side_index < len(sides))
    sector = np.full(len(side_index), -1, dtype=np.int64)
    sector[valid] = sides["sector"][side_index[valid]].astype(np.int64)
    return sector


def _assemble(name: str, path: Path, vertices: np.ndarray, lines: np.ndarray, sides: np.ndarray,
              sectors: np.ndarray, things: np.ndarray) -> MapData:
    if len(vertices) == 0 or len(lines) == 0 or len(sectors) == 0:
        raise WadError(f"map {name} in {path} has no geometry")
    if int(lines["v1"].max()) >= len(vertices) or int(lines["v2"].max()) >= len(vertices):
        raise WadError(f"map {name} in {path}: a linedef refers to a vertex that does not exist")
    xy = np.stack([vertices["x"], vertices["y"]], axis=1).astype(np.float64)
    front = _side_sector(sides, lines["front"])
    back = _side_sector(sides, lines["back"])
    for side in (front, back):
        side[side >= len(sectors)] = -1
    return MapData(
        name=name,
        vertices=xy,
        line_vertices=np.concatenate([xy[lines["v1"]], xy[lines["v2"]]], axis=1),
        line_flags=lines["flags"].astype(np.int64),
        line_special=lines["special"].astype(np.int64),
        line_front_sector=front,
        line_back_sector=back,
        sector_floor=sectors["floor"].astype(np.float64),
        sector_ceiling=sectors["ceiling"].astype(np.float64),
        sector_floor_texture=[t.split(b"\0", 1)[0].decode("ascii", "replace").upper()
                              for t in sectors["floor_tex"]],
        sector_special=sectors["special"].astype(np.int64),
        sector_light=sectors["light"].astype(np.int64),
        things=np.stack([things["x"], things["y"]], axis=1).astype(np.float64),
    )


def default_wad_path() -> Path:
    """freedoom2.wad as shipped inside the vizdoom package (no download)."""
    import vizdoom  # deferred: importing the engine is slow and not needed for parsing

    return Path(vizdoom.__file__).parent / "freedoom2.wad"
