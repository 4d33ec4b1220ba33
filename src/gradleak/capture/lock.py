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
from collections.abc import Iterator
from pathlib import Path

from gradleak.capture.schema import LOCK_SUFFIX
from gradleak.errors import CaptureFileError


def lock_path(out: Path) -> Path:
    return out.with_name(out.name + LOCK_SUFFIX)


@contextlib.contextmanager
def capture_lock(out: Path, partial: Path) -> Iterator[None]:
    """Hold the lock of `out` for the block; refuse at once if another process holds it."""
    path = lock_path(out)
    fd = _acquire(path, partial)
    try:
        yield
    finally:
        # Unlinked while still held: a process that opened the old file retries on a new one.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


def _acquire(path: Path, partial: Path) -> int:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # close-on-exec: engines never hold it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CaptureFileError(
                f"{partial} is being written by another process (PID {holder}): wait for it "
                "to finish or stop it (its capture then resumes with --resume)") from None
        if _still_linked(fd, path):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)  # its holder finished and removed it between our open and flock


def _still_linked(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


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
