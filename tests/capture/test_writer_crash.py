"""The partial file survives its writer's SIGKILL at the worst moment: an episode's rows are on
disk, its commit is not."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest

from gradleak.capture.schema import GRADIENTS, Column
from gradleak.capture.writer import COMMITTED, CaptureWriter
from gradleak.errors import CaptureFileError
from gradleak.victims.base import LayerInfo, layers_to_json

COLUMNS = (Column("episode_ids", "int64", private=False), Column("images", "uint8", (2, 2, 3)))
WIDTH = 6
ATTRS = {"format": "gradleak-capture", "settings": '{"seed": 1}',
         "layer_table": layers_to_json([LayerInfo("w", (WIDTH,), 0, "heads")])}


def episode(number: int, length: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(number)
    steps = {"episode_ids": np.full(length, number, np.int64),
             "images": rng.integers(0, 255, (length, 2, 2, 3), dtype=np.uint8)}
    return steps, rng.standard_normal((length, WIDTH)).astype(np.float32)


def writer(path: Path, resume: bool = False) -> CaptureWriter:
    return CaptureWriter(path, ATTRS, COLUMNS, WIDTH, {"w": np.zeros(WIDTH, np.float32)},
                         resume=resume)


def run_killed(path: Path, then: str) -> None:
    """A writer of `path` in a child process that runs `then` and is SIGKILLed by it."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_writer_crash import CaptureWriter, episode, writer
        from pathlib import Path
        path = Path({str(path)!r})
        kill = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
    """) + textwrap.dedent(then)
    assert subprocess.run([sys.executable, "-c", script]).returncode == -9


def killed_before_the_third_commit(path: Path) -> None:
    """Two episodes committed; the third's rows written and flushed; SIGKILL before its commit
    (the writer never closes, so HDF5's "open for write" flag stays in the file)."""
    run_killed(path, """
        w = writer(path)
        w.append_episode(*episode(0, 5))
        w.append_episode(*episode(1, 3))
        CaptureWriter._commit = kill
        w.append_episode(*episode(2, 4))
    """)


def resumes_with_two_episodes_then_finishes(out: Path) -> None:
    """The resumed writer holds the two committed episodes, takes the third again and finishes
    a file identical to one never killed."""
    resumed = writer(out, resume=True)
    assert (resumed.num_rows, resumed.num_episodes) == (8, 2)
    resumed.append_episode(*episode(2, 4))
    resumed.close()
    resumed.finish()
    with h5py.File(out, "r") as done:
        assert COMMITTED not in done
        assert (done.attrs["num_rows"], done.attrs["num_episodes"]) == (12, 3)
        assert done.attrs["complete"]
        expected = np.concatenate([episode(n, length)[1] for n, length in ((0, 5), (1, 3), (2, 4))])
        np.testing.assert_array_equal(done[GRADIENTS][:], expected)
        np.testing.assert_array_equal(done["episode_ids"][:], [0] * 5 + [1] * 3 + [2] * 4)


@pytest.mark.slow
def test_a_writer_killed_mid_episode_resumes_from_its_last_commit(tmp_path: Path) -> None:
    out = tmp_path / "x.h5"
    killed_before_the_third_commit(out)
    resumes_with_two_episodes_then_finishes(out)


@pytest.mark.slow
def test_a_writer_killed_before_its_rows_are_flushed_resumes_intact(tmp_path: Path) -> None:
    """Killed while an episode's rows are still unflushed: HDF5 had already written blocks
    past the end of allocation its superblock records (an episode large enough that its cache
    evicts them), and a resume that handed out space from that stale end wrote over them
    ("addr overflow" on the next resize)."""
    out = tmp_path / "x.h5"
    run_killed(out, """
        import h5py
        w = writer(path)
        w.append_episode(*episode(0, 5))
        w.append_episode(*episode(1, 3))
        h5py.File.flush = kill
        w.append_episode(*episode(2, 200_000))
    """)
    partial = tmp_path / "x.h5.partial"
    recorded_end = int.from_bytes(partial.read_bytes()[28:36], "little")  # superblock v3's EOA
    assert recorded_end < partial.stat().st_size  # the state a kill mid-episode leaves
    resumes_with_two_episodes_then_finishes(out)


def test_a_partial_without_a_commit_marker_is_refused_not_guessed(tmp_path: Path) -> None:
    out = tmp_path / "x.h5"
    w = writer(out)
    w.append_episode(*episode(0, 5))
    w.close()
    with h5py.File(tmp_path / "x.h5.partial", "a") as handle:
        del handle[COMMITTED]
    with pytest.raises(CaptureFileError, match="commit marker.*--overwrite"):
        writer(out, resume=True)


@pytest.mark.slow
def test_a_writer_killed_while_laying_out_leaves_no_partial_to_resume(tmp_path: Path) -> None:
    out = tmp_path / "x.h5"
    run_killed(out, """
        def half_laid_out(self, handle, *args):
            handle.create_dataset("images", shape=(0, 2, 2, 3), maxshape=(None, 2, 2, 3),
                                  dtype="uint8", chunks=(1, 2, 2, 3))
            handle.flush()
            kill()
        CaptureWriter._lay_out = half_laid_out
        writer(path)
    """)
    assert not (tmp_path / "x.h5.partial").exists()
    assert (tmp_path / "x.h5.partial.new").exists()
    fresh = writer(out, resume=True)  # nothing to resume: a new file over the leftover
    fresh.append_episode(*episode(0, 5))
    fresh.close()
    fresh.finish()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["x.h5"]


def test_a_reader_following_the_capture_delays_its_end_then_leaves_it_resumable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SWMR lets another process follow the partial file; one still holding it when the capture
    ends gets a clear message, and the capture finishes on --resume once it is closed."""
    monkeypatch.setattr("gradleak.capture.writer.READER_WAIT_SECONDS", 0.5)
    out = tmp_path / "x.h5"
    w = writer(out)
    w.append_episode(*episode(0, 5))
    follow = (f"import h5py, sys\nf = h5py.File({str(tmp_path / 'x.h5.partial')!r}, 'r', "
              "swmr=True)\nprint(f['committed_rows'][-1], flush=True)\nsys.stdin.read()")
    reader = subprocess.Popen([sys.executable, "-c", follow], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "5"
        w.close()
        with pytest.raises(CaptureFileError, match="another process has it open.*--resume"):
            w.finish()
    finally:
        reader.communicate("")
    resumed = writer(out, resume=True)
    assert resumed.num_rows == 5
    resumed.close()
    resumed.finish()
    with h5py.File(out, "r") as done:
        assert done.attrs["num_rows"] == 5 and done.attrs["complete"]
