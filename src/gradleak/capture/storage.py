"""How capture files compress their datasets: the HDF5 filter, by name.

Chosen by measurement (`benchmarks/capture.py`, on 256 float32 rows of a cnn-small capture,
51% exact zeros): LZ4 (through hdf5plugin) stores as few bytes as lzf (247 vs 246 kB a step)
and writes 5x and reads 9x faster (1.1 GB/s, 3.7 GB/s against 0.21, 0.43); Zstd at level 1
saves 12% more at about half LZ4's writing speed, for captures kept long. Files stay readable
by plain h5py once `import hdf5plugin` has registered the filters (gradleak.capture does it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hdf5plugin

from gradleak.errors import ConfigError

COMPRESSION_ATTR = "compression"  # the file's filter, by name; files without it used lzf
DEFAULT = "lz4"
COMPRESSIONS: dict[str, Callable[[], dict[str, Any]]] = {
    "lz4": lambda: dict(hdf5plugin.LZ4()),
    "zstd": lambda: dict(hdf5plugin.Zstd(clevel=1)),
    "lzf": lambda: {"compression": "lzf"},
    "gzip": lambda: {"compression": "gzip", "compression_opts": 1},
    "none": lambda: {},
}


def check_compression(name: str, field: str = "capture.compression") -> str:
    if name not in COMPRESSIONS:
        raise ConfigError(f"{field}={name!r}: expected one of {', '.join(COMPRESSIONS)}")
    return name


def compression_options(name: str) -> dict[str, Any]:
    """create_dataset keywords for the filter `name`."""
    return COMPRESSIONS[check_compression(name)]()


def file_compression(attrs: Any) -> str:
    """The filter a capture file's datasets were written with (lzf before it was recorded)."""
    name = attrs.get(COMPRESSION_ATTR, "lzf")
    return name if name in COMPRESSIONS else "lzf"
