"""One writer per capture output: an `fcntl` lock on `OUT.lock`, taken before anything is opened.

HDF5 truncates a file the moment it is opened for writing, so two captures of one `--out` must
be told apart before either touches `OUT.partial`. The lock file holds the writer's PID, for the
message the second one prints. The kernel drops the lock when its holder dies (kill -9
included), so a stale lock file never blocks a resume.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from gradleak.capture.schema import LOCK_SUFFIX
from gradleak.errors import CaptureFileError
from gradleak.io import exclusive


def lock_path(out: Path) -> Path:
    return out.with_name(out.name + LOCK_SUFFIX)


def capture_lock(out: Path, partial: Path) -> contextlib.AbstractContextManager[None]:
    """Hold the lock of `out` for the block; refuse at once if another process holds it."""
    return exclusive(lock_path(out), lambda holder: CaptureFileError(
        f"{partial} is being written by another process (PID {holder}): wait for it to finish "
        "or stop it (its capture then resumes with --resume)"))


def lock_holder(out: Path) -> str | None:
    """The PID written in a held lock of `out`, or None when nobody holds it."""
    path = lock_path(out)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.read(fd, 32).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)
    return None
