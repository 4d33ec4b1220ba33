"""Atomic writes and safetensors + JSON checkpoints (never pickle)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from gradleak.errors import CheckpointError, ConfigError, DiskFullError, GradleakError
from gradleak.victims.base import Victim, VictimConfig, create_victim

VICTIM_FORMAT = "gradleak-victim"
VICTIM_WEIGHTS = "victim.safetensors"
VICTIM_META = "victim.json"
MAX_JSON_BYTES = 256 * 2**20  # settings, records and merged results are far smaller


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it over `path` only if the block succeeds.
    A full disk is a DiskFullError naming `path` and the room left, the temporary file gone."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as error:
        raise disk_full(error, path) from None
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide results from other users
        os.replace(tmp, path)
    # h5py reports a failed write as a RuntimeError, safetensors as its own SafetensorError
    except (OSError, RuntimeError, SafetensorError) as error:
        raise disk_full(error, path) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def is_disk_full(error: BaseException) -> bool:
    """An error from a write that found no room (the OS's, or HDF5's text of it)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(error) or "errno = 28," in str(error) or \
        "os error 28" in str(error)


def disk_full(error: BaseException, path: Path) -> BaseException:
    """`error` as a DiskFullError naming `path` and its device's free space when it is one,
    else `error` itself."""
    if not is_disk_full(error):
        return error
    free = shutil.disk_usage(first_existing_ancestor(path.parent)).free
    return DiskFullError(f"{path}: no space left on its device ({free / 2**20:.1f} MB free); "
                         "nothing was half-written: free space and run the command again")


# what HDF5 may add beyond the raw bytes a write holds (metadata, chunk indexes)
SPACE_MARGIN = (1.1, 256 * 2**10)


def ensure_space(path: Path, needed: int, what: str) -> None:
    """Refuse a write of about `needed` bytes under `path`'s folder before it starts, when the
    device holds less: HDF5 that meets a full disk mid-write leaves its file unusable (and can
    crash as it closes it), so its writers look first."""
    free = shutil.disk_usage(first_existing_ancestor(path.parent)).free
    wanted = int(needed * SPACE_MARGIN[0]) + SPACE_MARGIN[1]
    if free < wanted:
        raise DiskFullError(f"{path}: {free / 2**20:.1f} MB free on its device, about "
                            f"{wanted / 2**20:.1f} MB needed for {what}")


def duplicate_file(source: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Give `path` the bytes of `source`, replaced atomically: a hard link where the file
    system has them (a paper-size checkpoint, 9 GB, is not written twice), else a copy. Sound
    because every writer here replaces a file by rename, never in place, so the two names part
    at the next write."""
    with atomic_path(path) as tmp:
        tmp.unlink()
        try:
            os.link(source, tmp)
        except OSError:  # no hard links here (some network and FAT file systems)
            shutil.copyfile(source, tmp)


@contextlib.contextmanager
def created_directories(directory: str | os.PathLike[str]) -> Iterator[Path]:
    """Make `directory` (and missing parents) for the block; if the block fails, remove the
    ones made here again, when they are still empty: a failed command leaves no folders."""
    directory = Path(directory)
    made = []
    for folder in [directory, *directory.parents]:
        if folder.exists():
            break
        made.append(folder)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        yield directory
    except BaseException:
        for folder in made:  # deepest first
            with contextlib.suppress(OSError):  # not empty: something else wrote there
                folder.rmdir()
        raise


@contextlib.contextmanager
def run_directory(directory: str | os.PathLike[str], keep: Callable[[Path], bool]
                  ) -> Iterator[Path]:
    """A run's output directory. If this command created it and fails before `keep` says the
    directory holds something worth resuming (a checkpoint), the directory goes again."""
    directory = Path(directory)
    fresh = not directory.exists()
    try:
        yield directory
    except (GradleakError, OSError):
        if fresh and directory.is_dir() and not keep(directory):
            shutil.rmtree(directory)
        raise


def first_existing_ancestor(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output(path: str | os.PathLike[str], what: str, directory: bool = False) -> Path:
    """Refuse, before any compute, an output location that cannot be written: the path is of
    the wrong kind (a directory where a file goes, or a file where a directory goes), a
    dangling symbolic link, a parent that is a file, or a nearest existing folder that refuses
    a new file (read-only, permission)."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise ConfigError(f"{what} {path} is a symbolic link to {os.readlink(path)}, which does "
                          "not exist: choose another path (a link is never replaced)")
    if path.exists() and path.is_dir() != directory:
        kind = "a directory" if path.is_dir() else "a file"
        raise ConfigError(f"{what} {path} is {kind}; expected "
                          f"{'a directory' if directory else 'a file path'}")
    ancestor = first_existing_ancestor(path if directory and path.exists() else path.parent)
    if not ancestor.is_dir():
        raise ConfigError(f"{what} {path}: {ancestor} is a file, not a directory")
    probe_writable(ancestor, f"{what} {path}")
    return path


def probe_writable(directory: Path, label: str) -> None:
    """Create and remove a file in `directory`: the only test that also holds for root, for
    read-only mounts and for ACLs (os.access answers for none of them reliably)."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".gradleak-write-test.")
    except OSError as err:
        raise ConfigError(f"{label}: cannot write in {directory} ({err.strerror})") from None
    os.close(fd)
    os.unlink(probe)


def existing_file(path: str | os.PathLike[str], what: str) -> Path:
    """A path that must name a readable regular file; says what it is when it is not."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a directory; expected a file")
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def owned_folder(out: Path, marker: str, fmt: str, field: str, what: str
                 ) -> dict[str, Any] | None:
    """Check that `out` is new, empty, or a folder this kind of run wrote (its `marker` JSON
    says `format: fmt`); returns that marker's content, or None for a new or empty folder. A
    user's folder is refused untouched."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{field} {out}: exists and is not a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return None
    found = read_json(out / marker, marker) if (out / marker).is_file() else {}
    if found.get("format") != fmt:
        raise ConfigError(f"{field} {out}: a non-empty folder that is not {what}; choose a "
                          "new folder (nothing there was touched)")
    return found


def try_lock(path: Path) -> tuple[int | None, str]:
    """An exclusive `flock` on `path` (created, this PID written in it): (fd, "") or, when
    another process holds it, (None, its PID). The kernel drops a lock when its holder dies
    (kill -9 included), so a lock file left behind never blocks."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # close-on-exec: children never hold it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            return None, holder
        if _still_linked(fd, path):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd, ""
        os.close(fd)  # its holder finished and removed it between our open and flock


def release_lock(path: Path, fd: int) -> None:
    """Remove the lock file while still holding it (a process that opened it retries on a new
    one), then let go."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)


@contextlib.contextmanager
def exclusive(path: Path, refuse: Callable[[str], Exception]) -> Iterator[None]:
    """Hold the lock `path` for the block; another holder is refused at once by raising
    `refuse(its PID)`."""
    fd, holder = try_lock(path)
    if fd is None:
        raise refuse(holder)
    try:
        yield
    finally:
        release_lock(path, fd)


def _still_linked(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_json(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """A JSON object from a regular file of at most MAX_JSON_BYTES: a FIFO, a device or a
    runaway file is refused before it is read."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{what} {path} is a directory; expected a JSON file")
    if path.exists() and not path.is_file():
        raise CheckpointError(f"{what} {path} is not a regular file (a pipe or a device)")
    if path.is_file() and path.stat().st_size > MAX_JSON_BYTES:
        raise CheckpointError(f"{what} {path} is {path.stat().st_size:,} bytes, more than the "
                              f"{MAX_JSON_BYTES:,} a JSON file here may hold")
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} does not exist") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{what} {path} is not readable JSON: {err}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} {path}: expected a JSON object")
    return data


def save_tensors(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor],
                 metadata: dict[str, str] | None = None) -> None:
    with atomic_path(path) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp),
                  metadata=metadata)


def tensors_metadata(path: str | os.PathLike[str]) -> dict[str, str] | None:
    """The string metadata of a safetensors file; None if it is missing or unreadable."""
    try:
        with safe_open(str(path), "pt") as handle:
            return dict(handle.metadata() or {})
    except (SafetensorError, OSError):
        return None


def load_tensors(path: str | os.PathLike[str], what: str) -> dict[str, torch.Tensor]:
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{what} {path} is a directory; expected a safetensors file")
    if not path.is_file():
        raise CheckpointError(f"{what} {path} does not exist")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{what} {path} is not a readable safetensors file: {err}") from None


def theta_sha256(victim: Victim) -> str:
    """Fingerprint of θ0: parameters and buffers, in name order, as little-endian float32."""
    digest = hashlib.sha256()
    for name, tensor in sorted(victim.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).contiguous().cpu().numpy()
                      .astype("<f4").tobytes())
    return digest.hexdigest()


def save_victim(directory: str | os.PathLike[str], victim: Victim,
                extra: dict[str, Any] | None = None) -> None:
    directory = Path(directory)
    save_tensors(directory / VICTIM_WEIGHTS, victim.state_dict())
    meta = {"format": VICTIM_FORMAT, "version": 1, "victim": victim.config.to_dict(),
            "theta_sha256": theta_sha256(victim), **(extra or {})}
    write_json(directory / VICTIM_META, meta)


def victim_directory(path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    return path.parent if path.suffix in (".safetensors", ".json") else path


def load_victim(path: str | os.PathLike[str]) -> tuple[Victim, dict[str, Any]]:
    """A victim in eval mode from a checkpoint directory (or its .safetensors / .json file)."""
    directory = victim_directory(path)
    meta = read_json(directory / VICTIM_META, "victim config")
    if meta.get("format") != VICTIM_FORMAT:
        raise CheckpointError(f"{directory / VICTIM_META}: field 'format' is "
                              f"{meta.get('format')!r}, expected {VICTIM_FORMAT!r}")
    config = VictimConfig.from_dict(meta.get("victim", {}), f"{directory / VICTIM_META} 'victim'")
    victim = create_victim(config)
    state = load_tensors(directory / VICTIM_WEIGHTS, "victim weights")
    expected = victim.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{directory / VICTIM_WEIGHTS} does not match victim {config.name!r} "
            f"(frame {config.frame_size}, {config.num_actions} actions): missing "
            f"{missing[:3] or 'none'}, unexpected {unexpected[:3] or 'none'}")
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{directory / VICTIM_WEIGHTS}: tensor {name} has shape "
                f"{tuple(state[name].shape)}, victim {config.name!r} with frame "
                f"{config.frame_size} and {config.num_actions} actions expects "
                f"{tuple(tensor.shape)}")
    victim.load_state_dict(state)
    return victim.eval(), meta
