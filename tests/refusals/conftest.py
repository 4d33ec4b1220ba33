"""The refusal contract every command keeps: exit status 2, one line on stderr that names the
file or field, no traceback, no new file, and every existing file byte-identical."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest

from gradleak.cli import main

Snapshot = dict[str, str]


def snapshot(*roots: Path) -> Snapshot:
    """Every file and folder under `roots`, with a hash of each file's bytes."""
    found: Snapshot = {}
    for root in roots:
        for path in sorted(Path(root).rglob("*")):
            found[str(path)] = (hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file()
                                else "dir")
    return found


def check_refusal(code: int, err: str, fragments: tuple[str, ...]) -> str:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("gradleak: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.fixture
def refused(capsys: pytest.CaptureFixture[str], tmp_path: Path
            ) -> Callable[..., str]:
    """refused(argv, *fragments, watch=(dirs...)): run the command and check the contract."""

    def run(argv: list[str], *fragments: str, watch: tuple[Path, ...] = ()) -> str:
        roots = (tmp_path, *watch)
        before = snapshot(*roots)
        capsys.readouterr()
        code = main([*argv, "--quiet"])
        line = check_refusal(code, capsys.readouterr().err, fragments)
        assert snapshot(*roots) == before, "files were added, removed or changed"
        return line

    return run


def copy_capture(source: Path, folder: Path, name: str = "copy.h5") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / name
    shutil.copyfile(source, target)
    return target


def poison_rows(path: Path, rows: list[int], value: float = np.nan) -> Path:
    """Overwrite whole gradient rows with NaN or Inf, as a broken client would send them."""
    with h5py.File(path, "r+") as handle:
        for row in rows:
            handle["gradients"][row] = value
    return path


def set_attribute(path: Path, name: str, value: object) -> Path:
    with h5py.File(path, "r+") as handle:
        handle.attrs[name] = value
    return path


def corrupt_chunk(path: Path, dataset: str, row: int) -> Path:
    """Scribble over the stored bytes of the chunk holding `row` (chunks are one row here)."""
    with h5py.File(path, "r") as handle:
        data = handle[dataset]
        info = data.id.get_chunk_info_by_coord((row,) + (0,) * (data.ndim - 1))
    with open(path, "r+b") as raw:
        raw.seek(info.byte_offset)
        raw.write(bytes(range(256)) * (info.size // 256) + b"\xff" * (info.size % 256))
    return path


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder that an unprivileged user can reach (pytest's tmp_path is private to root)."""
    folder = Path(tempfile.mkdtemp(prefix="gradleak-refusal-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def run_unprivileged(argv: list[str]) -> tuple[int, str]:
    """main(argv) as user 'nobody' when the tests run as root (root ignores permission bits),
    in a forked child whose stderr comes back through a pipe; in-process otherwise."""
    if os.geteuid() != 0:
        import contextlib
        import io

        stream = io.StringIO()
        with contextlib.redirect_stderr(stream):
            code = main([*argv, "--quiet"])
        return code, stream.getvalue()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, run, report
        import sys
        import traceback

        code = 70
        try:
            os.close(read_end)
            os.dup2(write_end, 2)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            os.setgid(65534)
            os.setuid(65534)
            code = main([*argv, "--quiet"])
        except BaseException:  # the parent's assertions show it: the child must not escape
            traceback.print_exc()
            code = 71
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as stream:
        err = stream.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), err
