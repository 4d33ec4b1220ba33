"""Crash-safe HDF5 writing: `OUT.partial` grows one whole episode at a time, then is renamed.

The partial file is written in HDF5's single-writer/multiple-reader (SWMR) mode. Without it,
HDF5 writes metadata in any order, so a capture killed between two flushes could leave a file
whose metadata points past its end. SWMR orders metadata writes so that the file on disk is
consistent at every instant, except for the superblock's end of allocation, which can lag behind
blocks the writer had already written past it; a resume moves it to the file's end before it
writes, so that new space never lands on those blocks. After each episode its rows are flushed,
then the episode's end is appended to `committed_rows` (the commit marker) and flushed;
`--resume` keeps the rows the marker counts, drops the rest, and continues with the next
episode. `finish` removes the marker and writes `num_rows` / `num_episodes` / `complete`
(attributes cannot change under SWMR).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from gradleak.capture.layout import (
    FACTORED_ATTR,
    FACTORS,
    GradientLayout,
    factor_datasets,
)
from gradleak.capture.schema import (
    FORMAT,
    GRADIENTS,
    NEW_SUFFIX,
    PARTIAL_SUFFIX,
    THETA0_GROUP,
    Column,
    layers_from_json,
)
from gradleak.capture.storage import COMPRESSION_ATTR, DEFAULT, compression_options
from gradleak.errors import CaptureFileError, DiskFullError
from gradleak.io import ensure_space, is_disk_full

SMALL_CHUNK = 1024
FACTOR_CHUNK_ROWS = 16
COMMITTED = "committed_rows"  # the partial file's commit marker: rows after each episode
READER_WAIT_SECONDS = 30.0  # at the end, for a reader following the capture to close


# partial files whose writes met a full disk: HDF5 may crash trying to write them out again
# at the interpreter's exit, so the command line leaves without it (gradleak.cli.entry)
ABANDONED: list[Path] = []


def partial_path(path: Path) -> Path:
    return path.with_name(path.name + PARTIAL_SUFFIX)


def refuse_unless_capture(path: Path) -> None:
    """--overwrite replaces a capture (or an interrupted one), never a user's other file."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not path.is_file():
        raise CaptureFileError(f"{path} exists and is not a capture file (a folder, link or "
                               "device): --overwrite replaces only captures; choose another path")
    try:
        with h5py.File(path, "r") as existing:
            ours = existing.attrs.get("format") == FORMAT
    except OSError:
        ours = False
    if not ours:
        raise CaptureFileError(f"{path} exists and is not a gradleak capture: --overwrite "
                               "replaces only captures; choose another path")


class CaptureWriter:
    def __init__(self, path: Path, attrs: dict[str, Any], columns: tuple[Column, ...],
                 gradient_dim: int, theta0: dict[str, np.ndarray], resume: bool = False,
                 overwrite: bool = False, gradient_dtype: str = "float32",
                 steps: int | None = None, compression: str = DEFAULT) -> None:
        """The caller holds the output's lock (capture.lock): opening "w" truncates."""
        self.path, self.partial = Path(path), partial_path(Path(path))
        self.gradient_dtype, self.compression = gradient_dtype, compression
        self.columns = columns
        self.already_complete = False
        self._full = False  # a write met a full disk: close without flushing
        self._pending = 0  # rows of the episode being written, not yet committed
        if overwrite:
            refuse_unless_capture(self.path)
        if self.path.exists() and not overwrite:
            if resume and self._complete_with_same_settings(attrs, steps):
                self.already_complete = True
                return
            raise CaptureFileError(f"{self.path} already exists: pass --overwrite to replace it")
        if self.partial.exists() and resume:
            self._file = self._reopen(attrs, steps)
        elif self.partial.exists() and not overwrite:
            raise CaptureFileError(f"an interrupted capture exists at {self.partial}: pass "
                                   "--resume to continue it, or delete it")
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self._create(attrs, gradient_dim, theta0)

    # -- opening -------------------------------------------------------------------------------
    def _complete_with_same_settings(self, attrs: dict[str, Any], steps: int | None) -> bool:
        try:
            with h5py.File(self.path, "r") as existing:
                same = existing.attrs.get("settings") == attrs["settings"]
                rows = int(existing.attrs.get("num_rows", -1))
        except OSError:
            raise CaptureFileError(f"{self.path} exists but is not a readable HDF5 file; pass "
                                   "--overwrite to replace it") from None
        if not same:
            raise CaptureFileError(f"{self.path} exists and was captured with other settings; "
                                   "pass --overwrite to replace it")
        if steps is not None and rows != steps:
            raise CaptureFileError(f"{self.path} is complete with {rows} steps, not the --steps "
                                   f"{steps} asked for; pass --overwrite to capture it again")
        return True

    def _create(self, attrs: dict[str, Any], gradient_dim: int,
                theta0: dict[str, np.ndarray]) -> h5py.File:
        """The file is laid out under `OUT.partial.new` and renamed to `OUT.partial` once it is
        flushed in SWMR mode: before that HDF5 orders nothing, and a kill mid-creation left a
        `.partial` a resume could not read. A leftover `.new` is overwritten by the next run."""
        fresh = self.partial.with_name(self.partial.name + NEW_SUFFIX)
        ensure_space(fresh, sum(v.nbytes for v in theta0.values()), "its θ0 and layout")
        handle = h5py.File(fresh, "w", libver="latest")
        try:
            self._lay_out(handle, attrs, gradient_dim, theta0)
        except BaseException:
            handle.close()
            fresh.unlink(missing_ok=True)
            raise
        os.replace(fresh, self.partial)
        self._rows = self._episodes = 0
        self._empty_size = self.partial.stat().st_size
        return handle

    def _lay_out(self, handle: h5py.File, attrs: dict[str, Any], gradient_dim: int,
                 theta0: dict[str, np.ndarray]) -> None:
        filters = compression_options(self.compression)
        for column in self.columns:
            chunk = (1,) + column.shape if column.shape else (SMALL_CHUNK,)
            handle.create_dataset(column.name, shape=(0,) + column.shape,
                                  maxshape=(None,) + column.shape, dtype=column.dtype,
                                  chunks=chunk, **(filters if column.shape else {}))
        # One gradient per chunk row: readers fetch single steps or windows without decoding
        # neighbours (the filter: gradleak.capture.storage).
        layout = GradientLayout(tuple(layers_from_json(attrs["layer_table"])),
                                frozenset(json.loads(attrs.get(FACTORED_ATTR, "[]"))))
        width = layout.stored_width if layout.factored else gradient_dim
        handle.create_dataset(GRADIENTS, shape=(0, width), maxshape=(None, width),
                              dtype=self.gradient_dtype, chunks=(1, width), **filters)
        if layout.factored:  # a few thousand floats a step: a window's rows in one chunk
            width = layout.factor_width
            handle.create_dataset(FACTORS, shape=(0, width), maxshape=(None, width),
                                  dtype=self.gradient_dtype, chunks=(FACTOR_CHUNK_ROWS, width),
                                  **filters)
        group = handle.create_group(THETA0_GROUP)
        for name, tensor in theta0.items():
            group.create_dataset(name, data=tensor)
        for key, value in attrs.items():
            handle.attrs[key] = value
        handle.attrs[COMPRESSION_ATTR] = self.compression
        handle.attrs["num_rows"] = 0
        handle.attrs["num_episodes"] = 0
        handle.attrs["complete"] = False
        handle.create_dataset(COMMITTED, shape=(0,), maxshape=(None,), dtype="int64",
                              chunks=(SMALL_CHUNK,))
        handle.swmr_mode = True  # no object or attribute may be added from here on
        handle.flush()

    def _reopen(self, attrs: dict[str, Any], steps: int | None) -> h5py.File:
        handle = _open_killed_writer(self.partial)
        if handle.attrs.get("format") != FORMAT:
            handle.close()
            raise CaptureFileError(f"{self.partial} is not a gradleak capture")
        if handle.attrs.get("settings") != attrs["settings"]:
            found = json.loads(handle.attrs.get("settings", "{}"))
            wanted = json.loads(attrs["settings"])
            differ = sorted(k for k in set(found) | set(wanted) if found.get(k) != wanted.get(k))
            handle.close()
            hint = (f": it was written with capture.factor_linear="
                    f"{str('factored_layers' in found).lower()}"
                    if "factored_layers" in differ else "")
            raise CaptureFileError(f"{self.partial} was captured with other settings "
                                   f"({', '.join(differ)} differ); cannot resume it{hint}")
        if COMMITTED not in handle:
            handle.close()
            raise CaptureFileError(f"{self.partial} was written by an earlier gradleak (without "
                                   "a commit marker), which this one cannot resume safely: "
                                   "start again with --overwrite")
        committed = handle[COMMITTED][:]
        rows = int(committed[-1]) if len(committed) else 0
        if steps is not None and rows > steps:
            handle.close()
            raise CaptureFileError(f"{self.partial} already holds {rows} steps, more than "
                                   f"--steps {steps} asks for: resume with --steps >= {rows}, "
                                   "or start again with --overwrite")
        for name in [c.name for c in self.columns] + [GRADIENTS] + factor_datasets(handle):
            handle[name].resize(rows, axis=0)  # drop rows of an episode cut off by the crash
        self._rows, self._episodes = rows, len(committed)
        self._empty_size = 0  # unknown: the rows' share of the file is overestimated
        handle.swmr_mode = True
        return handle

    # -- writing -------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self._rows if not self.already_complete else -1

    @property
    def num_episodes(self) -> int:
        return self._episodes if not self.already_complete else -1

    def append_episode(self, steps: dict[str, np.ndarray], gradients: np.ndarray,
                       factors: np.ndarray | None = None) -> None:
        """`gradients`: the rows' stored columns; `factors`: the rows of `gradient_factors`,
        when the file keeps weights factored (gradleak.capture.layout)."""
        self.append_rows(steps, gradients, factors)
        self.end_episode()

    def append_rows(self, steps: dict[str, np.ndarray], gradients: np.ndarray,
                    factors: np.ndarray | None = None) -> None:
        """Part of an episode, written but not yet counted: a crash before `end_episode`
        drops it whole, so an episode far larger than memory is written in pieces."""
        n = len(gradients)
        start = self._rows + self._pending
        blocks = {**{column.name: steps[column.name] for column in self.columns},
                  GRADIENTS: gradients}
        if (factors is not None) != bool(factor_datasets(self._file)):
            raise ValueError("factors: expected them exactly when the file keeps weights "
                             "factored")
        if factors is not None:
            blocks[FACTORS] = factors
        # a full disk is met here, before HDF5 writes: the partial file keeps every episode
        # written so far, whole, and resumes once there is room. The bytes an episode takes:
        # its raw size at first, then what the rows written so far took (compressed), twice
        raw = sum(np.asarray(v).nbytes for v in blocks.values())
        grown = self.partial.stat().st_size - self._empty_size
        ensure_space(self.partial, min(raw, 2 * n * grown // self._rows) if self._rows else raw,
                     f"the next episode ({n} steps; the {self._rows} written resume with "
                     "--resume once there is room)")
        try:
            for name, values in blocks.items():
                data = self._file[name]
                data.resize(start + n, axis=0)
                data[start:start + n] = values
            self._file.flush()
            self._pending += n
        except (OSError, RuntimeError) as error:  # the disk filled past the estimate
            if not is_disk_full(error):
                raise
            self._full = True
            raise DiskFullError(f"{self.partial}: its device filled while the capture wrote "
                                f"(another process, or rows compressed worse than before); the "
                                f"{self._rows} steps committed resume with --resume once there "
                                "is room") from None

    def end_episode(self) -> None:
        """Count the rows written since the last episode's end as one episode."""
        self._commit(self._rows + self._pending)
        self._pending = 0

    def _commit(self, rows: int) -> None:
        """The episode counts once its end is in the marker (after its rows are flushed)."""
        marker = self._file[COMMITTED]
        marker.resize(self._episodes + 1, axis=0)
        marker[self._episodes] = rows
        self._file.flush()
        self._rows, self._episodes = rows, self._episodes + 1

    def finish(self) -> None:
        if self.already_complete:
            return
        with self._open_to_finish() as handle:
            del handle[COMMITTED]
            handle.attrs["num_rows"] = self._rows
            handle.attrs["num_episodes"] = self._episodes
            handle.attrs["complete"] = True
        os.replace(self.partial, self.path)

    def _open_to_finish(self) -> h5py.File:
        """The closed partial file (closed cleanly: no SWMR flag), once no SWMR reader following
        the capture holds it open."""
        deadline = time.monotonic() + READER_WAIT_SECONDS
        while True:
            try:
                return h5py.File(self.partial, "a")
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise CaptureFileError(
                        f"{self.partial} holds every step, but another process has it open (a "
                        "reader following the capture): close it, then run the same capture "
                        "with --resume to finish the file") from None
                time.sleep(0.5)

    def discard(self) -> None:
        """Delete the partial file: the capture failed for a reason a resume would not fix."""
        self.close()
        if self.partial.exists():
            self.partial.unlink()

    def close(self) -> None:
        """Leave the partial file resumable (an interrupted capture)."""
        if not self.already_complete and self._file.id.valid:
            if self._full:  # HDF5 cannot write its cache out: drop it, the commits stand
                self._abandon()
                return
            self._file.flush()
            self._file.close()

    def _abandon(self) -> None:
        """Close a file whose last writes failed, without the flush that would fail again."""
        ABANDONED.append(self.partial)
        with contextlib.suppress(OSError, RuntimeError):
            self._file.close()


def _open_killed_writer(path: Path) -> h5py.File:
    """Opens for writing a partial file whose writer may have been killed. A SWMR writer that
    did not close leaves a flag in the superblock that makes HDF5 refuse the file ("already open
    for write"); the caller holds the capture's lock, so no writer is alive, and the flag is
    cleared the way `h5clear -s` does it (through a file-access property the HDF5 library
    reads but h5py does not expose). Its end of allocation is then moved to the file's end."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    hdf5 = ctypes.CDLL(h5py.h5p.__file__)  # resolves to the HDF5 library h5py itself loaded
    hdf5.H5Pset.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_void_p]
    clear = ctypes.c_bool(True)
    if hdf5.H5Pset(fapl.id, b"clear_status_flags", ctypes.byref(clear)) < 0:
        raise CaptureFileError(f"cannot clear {path}'s HDF5 writer flag with this HDF5 library: "
                               f"run `h5clear -s {path}`, then resume")
    try:
        handle = h5py.File(h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDWR, fapl=fapl))
    except OSError as err:
        raise CaptureFileError(f"{path} cannot be reopened to resume ({err}); start again "
                               "with --overwrite") from None
    # The superblock's end of allocation can lag behind what the killed writer had already
    # written past it (chunk-index blocks among it); new space handed out from there would
    # overwrite them ("addr overflow" on the next read). Move it to the file's end first, as
    # `h5clear --increment=0` does.
    hdf5.H5Fincrement_filesize.argtypes = [ctypes.c_int64, ctypes.c_uint64]
    if hdf5.H5Fincrement_filesize(handle.id.id, 0) < 0:
        handle.close()
        raise CaptureFileError(f"cannot move {path}'s HDF5 end of allocation to its end: run "
                               f"`h5clear --increment=0 {path}`, then resume")
    return handle
