"""Capture files: what is stored equals what a client sends; crash safety; bad files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import tiny_preset
from helpers import interruptible

from gradleak.capture.grads import StepBatch, per_step_gradients
from gradleak.capture.layout import read_gradients
from gradleak.capture.reader import CaptureFile
from gradleak.capture.run import CaptureJob, run_capture
from gradleak.capture.shards import concat_observations, open_captures
from gradleak.capture.writer import CaptureWriter
from gradleak.errors import CaptureFileError, CheckpointError, ConfigError
from gradleak.io import save_victim
from gradleak.rl.losses import LossCoefficients
from gradleak.victims import VictimConfig, create_victim

TINY_FLAGS = ["--preset", "cpu-quick", "--set", "env.doomnav.frame_size=32",
              "--set", "env.doomnav.max_steps=20", "--set", "env.heldout_maps=MAP05",
              "--set", "env.max_regions_per_map=2"]


def victim_from_file(capture: CaptureFile) -> torch.nn.Module:
    victim = create_victim(capture.victim)
    victim.load_state_dict({k: torch.from_numpy(v) for k, v in capture.theta0().items()})
    return victim.eval()


def test_stored_gradients_are_the_clients_gradients(random_capture: Path) -> None:
    with CaptureFile(random_capture) as capture:
        assert capture.num_rows == 50
        observation, target = capture.observation(), capture.target()
        victim = victim_from_file(capture)
        columns = {name: capture.private_column(name) for name in ("log_probs", "goals")}
        loss = json.loads(capture.attrs["loss"])
    batch = StepBatch(torch.from_numpy(target.images), torch.from_numpy(target.actions),
                      torch.from_numpy(target.advantages), torch.from_numpy(target.returns),
                      torch.from_numpy(columns["log_probs"]), torch.from_numpy(columns["goals"]))
    coefficients = LossCoefficients(loss["value"], loss["entropy"], loss["clip"])
    fresh = per_step_gradients(victim, batch, coefficients, list(observation.layers)).numpy()
    # float32, what the client sends: equal up to the order float32 sums ran in (the capture
    # batches steps per episode, this call all 50 at once)
    relative = (np.linalg.norm(observation.gradients - fresh, axis=1)
                / np.linalg.norm(fresh, axis=1))
    assert relative.max() < 1e-5


def test_float16_storage_differs_from_float32_by_its_rounding_alone(
        random_capture: Path, float16_capture: Path) -> None:
    """The same steps stored both ways: float16 holds exactly the float32 gradients rounded to
    float16, every other column is identical, and the rounding is what float16 promises
    (2^-11 relative, subnormals aside)."""
    with CaptureFile(random_capture) as exact, CaptureFile(float16_capture) as rounded:
        wide, narrow = exact.read("gradients"), rounded.read("gradients")
        assert wide.dtype == np.float32 and narrow.dtype == np.float16
        np.testing.assert_array_equal(narrow, wide.astype(np.float16))
        for name in ("images", "actions", "advantages", "returns"):
            np.testing.assert_array_equal(exact.private_column(name),
                                          rounded.private_column(name))
    np.testing.assert_allclose(narrow.astype(np.float32), wide, rtol=2**-11, atol=6e-8)


def test_advantages_follow_the_capture_protocol(random_capture: Path) -> None:
    with CaptureFile(random_capture) as capture:
        episodes = capture.column("episode_ids")
        advantages = capture.private_column("advantages")
        raw = capture.private_column("advantages_raw")
        returns, values = capture.private_column("returns"), capture.private_column("values")
        summary = capture.validate()
    assert summary["episodes"] == len(np.unique(episodes)) >= 2
    np.testing.assert_allclose(returns, raw + values, rtol=1e-5, atol=1e-6)
    for episode in np.unique(episodes):
        a = advantages[episodes == episode]
        if len(a) > 1:
            assert a.mean() == pytest.approx(0.0, abs=1e-5)
            assert a.std() == pytest.approx(1.0, abs=1e-4)


def test_heldout_capture_uses_only_heldout_maps(random_capture: Path) -> None:
    with CaptureFile(random_capture) as capture:
        scenes = capture.scenes
        used = {scenes[i] for i in np.unique(capture.column("scene_ids"))}
    assert used and all(scene.startswith("MAP05/") for scene in used)


def test_components_subset_stores_only_those_layers(tmp_path: Path) -> None:
    preset = tiny_preset()
    preset.capture.components = ["heads"]
    out = tmp_path / "heads.h5"
    run_capture(CaptureJob(victim="cnn-small", random_init=True, split="train", steps=10,
                           out=out, preset=preset, progress=False))
    with CaptureFile(out) as capture:
        assert [layer.component for layer in capture.layers] == ["heads"] * 4
        assert capture.observation().gradients.shape == (10, 5 * 257 + 257)


def test_a_restricted_copy_is_the_capture_of_those_components(tmp_path: Path) -> None:
    """Cutting the CNN's columns out of a full capture gives what `--components cnn` records
    on the same seed, byte for byte; the copy opens as a capture; what it lacks is refused."""
    from gradleak.capture.subset import restrict_components

    preset = tiny_preset()
    full, cnn = tmp_path / "full.h5", tmp_path / "cnn.h5"
    run_capture(CaptureJob(victim="cnn-small", random_init=True, split="train", steps=12,
                           out=full, preset=preset, progress=False))
    preset.capture.components = ["cnn"]
    run_capture(CaptureJob(victim="cnn-small", random_init=True, split="train", steps=12,
                           out=cnn, preset=preset, progress=False))
    cut = tmp_path / "cut" / "cnn.h5"
    result = restrict_components(full, ["cnn"], cut)
    with CaptureFile(cnn) as direct, CaptureFile(cut) as restricted:
        assert restricted.layers == direct.layers
        assert result["gradient_dim"] == direct.attrs["gradient_dim"]
        np.testing.assert_array_equal(restricted.observation().gradients,
                                      direct.observation().gradients)
        np.testing.assert_array_equal(restricted.private_column("images"),
                                      direct.private_column("images"))
        assert json.loads(restricted.attrs["settings"]) == json.loads(direct.attrs["settings"])
    with pytest.raises(ConfigError, match="not of fc"):
        restrict_components(cnn, ["fc"], tmp_path / "fc.h5")
    with pytest.raises(CaptureFileError, match="already exists"):
        restrict_components(full, ["heads"], cut)
    assert not (tmp_path / "fc.h5").exists() and sorted(p.name for p in cut.parent.iterdir()) \
        == ["cnn.h5"]


# docs/data-format.md's reader of a row with h5py and numpy alone (factored weights included)
PLAIN_ROW_READER = """import json
import numpy as np

def gradient_row(f, i):
    factored = json.loads(f.attrs.get("factored_layers", "[]"))
    stored, factors, parts, at, spot = f["gradients"][i], None, [], 0, 0
    for layer in json.loads(f.attrs["layer_table"]):
        size = int(np.prod(layer["shape"]))
        if layer["name"] in factored:
            out, inputs = layer["shape"]
            factors = f["gradient_factors"][i] if factors is None else factors
            g, a = factors[spot:spot + out], factors[spot + out:spot + out + inputs]
            parts.append(np.outer(g, a).ravel())
            spot += out + inputs
        else:
            parts.append(stored[at:at + size])
            at += size
    return np.concatenate(parts)
"""


def gradient_filter(path: Path) -> int:
    with h5py.File(path, "r") as handle:
        return handle["gradients"].id.get_create_plist().get_filter(0)[0]


def test_captures_are_lz4_and_plain_h5py_reads_them_with_hdf5plugin(random_capture: Path,
                                                                    tmp_path: Path) -> None:
    """The filter is recorded and is HDF5's registered LZ4 (id 32004): a reader with h5py and
    `import hdf5plugin` gets the rows, one without it cannot decode them; a copy of the file
    (`gradleak defend`) keeps the filter; an unknown filter is refused before any compute."""
    with CaptureFile(random_capture) as capture:
        assert capture.attrs["compression"] == "lz4"
        expected = capture.observation().gradients[3]
    assert gradient_filter(random_capture) == 32004
    read = "import sys, h5py@\n" + PLAIN_ROW_READER + (
        "f = h5py.File(sys.argv[1], 'r')\nsys.stdout.buffer.write(gradient_row(f, 3).tobytes())")
    plain = subprocess.run([sys.executable, "-c", read.replace("@", ", hdf5plugin"),
                            str(random_capture)], capture_output=True, check=True)
    assert np.array_equal(np.frombuffer(plain.stdout, expected.dtype), expected)
    bare = subprocess.run([sys.executable, "-c", read.replace("@", ""), str(random_capture)],
                          capture_output=True, env={**os.environ, "HDF5_PLUGIN_PATH": "/none"})
    assert bare.returncode != 0 and b"read data" in bare.stderr
    from gradleak.defenses import parse_defense
    from gradleak.defenses.files import defend_capture

    defend_capture(random_capture, parse_defense("quant:8"), tmp_path / "q.h5")
    assert gradient_filter(tmp_path / "q.h5") == 32004
    preset = tiny_preset()
    preset.capture.compression = "lzf"  # as every capture was written before LZ4
    run_capture(CaptureJob(victim="cnn-small", random_init=True, split="heldout", steps=50,
                           out=tmp_path / "lzf.h5", preset=preset, progress=False, seed=3))
    with CaptureFile(tmp_path / "lzf.h5") as older:
        assert np.array_equal(older.observation().gradients[3], expected)
    assert gradient_filter(tmp_path / "lzf.h5") == h5py.h5z.FILTER_LZF
    preset.capture.compression = "snappy"
    with pytest.raises(ConfigError, match="capture.compression='snappy': expected one of lz4"):
        run_capture(CaptureJob(victim="cnn-small", random_init=True, split="train", steps=4,
                               out=tmp_path / "never.h5", preset=preset, progress=False))
    assert not (tmp_path / "never.h5").exists()


def captures_with_and_without(folder: Path, setting: str, steps: int) -> dict[bool, Path]:
    """The same capture with capture.`setting` on and off."""
    files = {}
    for value in (True, False):
        preset = tiny_preset()
        setattr(preset.capture, setting, value)
        files[value] = folder / f"{setting}-{value}.h5"
        run_capture(CaptureJob(victim="cnn-small", random_init=True, split="train", steps=steps,
                               out=files[value], preset=preset, progress=False))
    return files


@pytest.mark.slow
def test_overlapped_rollouts_write_the_same_file_and_report_their_errors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Episodes rolled out in the child process (the default) give the file the in-process
    loop gives; an error in the child is raised here as itself, and a failure
    no resume would fix leaves no partial file."""
    files = captures_with_and_without(tmp_path, "overlap", 45)
    with h5py.File(files[True], "r") as child, h5py.File(files[False], "r") as here:
        for name in here:
            if isinstance(here[name], h5py.Dataset) and name not in ("gradients",
                                                                     "gradient_factors"):
                assert np.array_equal(here[name][()], child[name][()]), name
        # the gradients here were formed on one thread fewer (the rollout holds a core):
        # sums in another order, equal to float32 rounding
        ours, theirs = read_gradients(here), read_gradients(child)
        assert np.abs(ours - theirs).max() <= 1e-6 * np.abs(ours).max()

    def broken(*args, **kwargs):
        raise ConfigError("the scene cannot be loaded")

    monkeypatch.setattr("gradleak.capture.run.run_episode", broken)  # the child is forked
    out = tmp_path / "broken.h5"
    with pytest.raises(ConfigError, match="the scene cannot be loaded"):
        run_capture(CaptureJob(victim="cnn-small", random_init=True, split="train", steps=10,
                               out=out, preset=tiny_preset(), progress=False))
    assert not out.exists() and not (tmp_path / "broken.h5.partial").exists()


def test_the_engine_reads_the_maps_the_plan_read(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The WAD and its maps' geometry are read once, by the plan: the engine's environment (in
    the forked child by default; here, with the rollout in this process, to count) is handed
    the plan's catalog rather than reading them again (0.1 s of the child's start)."""
    from gradleak.envs.scenes import SceneCatalog

    built = []
    original = SceneCatalog.__init__

    def counted(self, *args, **kwargs):
        built.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(SceneCatalog, "__init__", counted)
    preset = tiny_preset()
    preset.capture.overlap = False
    run_capture(CaptureJob(victim="cnn-small", random_init=True, split="train", steps=4,
                           out=tmp_path / "once.h5", preset=preset, progress=False))
    assert len(built) == 1


@pytest.mark.slow
def test_background_writes_give_the_same_file_and_raise_the_writers_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Episodes written in a thread (the default) while the next one's gradients are formed:
    the file is the one written in line, bit for bit (the rows handed over are not overwritten
    by the next episode's gradients), and a failed write is raised as itself, the file
    discarded."""
    files = captures_with_and_without(tmp_path, "background_write", 60)
    with h5py.File(files[True], "r") as threaded, h5py.File(files[False], "r") as inline:
        assert inline.attrs["num_episodes"] >= 3  # buffers reused at least once
        for name in inline:
            if isinstance(inline[name], h5py.Dataset):
                assert np.array_equal(inline[name][()], threaded[name][()]), name

    original = CaptureWriter.append_episode

    def full_disk(self, rows, gradients, factors=None):
        if self.num_episodes == 1:
            raise CaptureFileError("no space left on the device")
        return original(self, rows, gradients, factors)

    monkeypatch.setattr(CaptureWriter, "append_episode", full_disk)
    out = tmp_path / "full.h5"
    with pytest.raises(CaptureFileError, match="no space left"):
        run_capture(CaptureJob(victim="cnn-small", random_init=True, split="train", steps=60,
                               out=out, preset=tiny_preset(), progress=False))
    assert not out.exists() and not (tmp_path / "full.h5.partial").exists()


def test_shards_split_the_scenes_and_read_as_one(tmp_path: Path) -> None:
    preset = tiny_preset()
    outs = []
    for index in range(2):
        result = run_capture(CaptureJob(victim="cnn-small", random_init=True, split="train",
                                        steps=30, out=tmp_path / "train.h5", preset=preset,
                                        shard=(index, 2), progress=False))
        outs.append(Path(result["out"]))
    assert [p.name for p in outs] == ["train.shard-0-of-2.h5", "train.shard-1-of-2.h5"]
    files = open_captures(outs)
    scene_sets = [set(json.loads(f.attrs["scenes"])) for f in files]
    observation = concat_observations([f.observation() for f in files])
    for f in files:
        f.close()
    assert not scene_sets[0] & scene_sets[1]
    assert len(observation) == 30  # 15 + 15
    assert len(np.unique(observation.episode_ids)) == sum(
        len(np.unique(CaptureFile(p).column("episode_ids"))) for p in outs)


def cli_capture(out: Path, steps: int, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "gradleak.cli", "capture", "--victim", "cnn-small",
               "--random-init", "--scenes", "heldout", "--steps", str(steps), "--out", str(out),
               "--quiet", "--seed", "5", *TINY_FLAGS, *extra]
    # A session of its own, so the kill below takes the engine process too, as a job
    # scheduler preempting the job would; SIGINT as a terminal's, however the suite started.
    return subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            start_new_session=True, preexec_fn=interruptible)


def capture_until_written(out: Path, steps: int, size: int
                          ) -> tuple[subprocess.Popen, Path]:
    """A CLI capture, returned once its partial file holds `size` bytes (still running)."""
    process = cli_capture(out, steps)
    partial = out.with_name(out.name + ".partial")
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if partial.exists() and partial.stat().st_size > size:
            break
        time.sleep(0.02)
    assert process.poll() is None, "the capture finished before it could be killed"
    return process, partial


@pytest.mark.slow
def test_resume_after_a_killed_capture_matches_an_uninterrupted_one(tmp_path: Path) -> None:
    steps = 400
    assert cli_capture(tmp_path / "clean.h5", steps).wait(timeout=300) == 0
    process, partial = capture_until_written(tmp_path / "killed.h5", steps, 4 * 2**20)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert partial.exists() and not (tmp_path / "killed.h5").exists()
    with pytest.raises(CaptureFileError, match="--resume"):
        run_capture(CaptureJob(victim="cnn-small", random_init=True, split="heldout",
                               steps=steps, out=tmp_path / "killed.h5", preset=tiny_preset(),
                               progress=False, seed=5))
    assert cli_capture(tmp_path / "killed.h5", steps, "--resume").wait(timeout=300) == 0
    assert not partial.exists()
    with h5py.File(tmp_path / "clean.h5", "r") as clean, \
            h5py.File(tmp_path / "killed.h5", "r") as resumed:
        assert resumed.attrs["num_rows"] == clean.attrs["num_rows"] == steps
        for name in clean:
            if isinstance(clean[name], h5py.Dataset):
                assert np.array_equal(clean[name][()], resumed[name][()]), name


@pytest.mark.slow
def test_a_killed_capture_leaves_no_rollout_or_engine_behind(tmp_path: Path) -> None:
    """Only the capture's own process is killed (SIGKILL, not its group): the rollout process
    it forked dies with it, and that one's game engine with it, so nothing keeps running or
    keeps the lock; the partial file resumes."""
    process, _ = capture_until_written(tmp_path / "killed.h5", 400, 2 * 2**20)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert session_ends(process.pid, 20), "processes of the killed capture are still running"
    assert cli_capture(tmp_path / "killed.h5", 400, "--resume").wait(timeout=300) == 0


def session_ends(leader: int, seconds: float) -> bool:
    """Whether every process of the session `leader` started is gone within `seconds`."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            os.killpg(leader, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_an_interrupted_capture_closes_its_engine_before_it_exits(tmp_path: Path) -> None:
    """Ctrl-C while the rollout process waits for the writer: the child is asked to stop, closes
    its engine, and the capture exits leaving nothing running (no orphan engine holding a core
    after the job), and its partial file resumes."""
    process, partial = capture_until_written(tmp_path / "stopped.h5", 400, 2 * 2**20)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) != 0
    assert session_ends(process.pid, 10), "the interrupted capture left processes running"
    assert partial.exists()


def test_resume_with_other_settings_is_refused(tmp_path: Path, random_capture: Path) -> None:
    partial = tmp_path / "x.h5.partial"
    shutil.copy(random_capture, partial)
    with pytest.raises(CaptureFileError, match="other settings.*seed"):
        run_capture(CaptureJob(victim="cnn-small", random_init=True, split="heldout", steps=60,
                               out=tmp_path / "x.h5", preset=tiny_preset(), resume=True,
                               progress=False, seed=4))


def test_existing_output_is_not_overwritten_silently(tmp_path: Path, random_capture: Path) -> None:
    out = tmp_path / "x.h5"
    shutil.copy(random_capture, out)
    with pytest.raises(CaptureFileError, match="--overwrite"):
        run_capture(CaptureJob(victim="cnn-small", random_init=True, split="heldout", steps=10,
                               out=out, preset=tiny_preset(), progress=False))


def test_a_diverged_checkpoint_fails_and_leaves_nothing(tmp_path: Path) -> None:
    victim = create_victim(VictimConfig("cnn-small", frame_size=32)).eval()
    with torch.no_grad():
        victim.fc.weight.fill_(float("nan"))
    save_victim(tmp_path / "victim", victim)
    out = tmp_path / "out.h5"
    with pytest.raises(CheckpointError, match="fc.weight holds NaN/Inf"):
        run_capture(CaptureJob(victim=str(tmp_path / "victim"), split="train", steps=10,
                               out=out, preset=tiny_preset(), progress=False))
    assert not out.exists() and not (tmp_path / "out.h5.partial").exists()


def test_capture_arguments_are_checked(tmp_path: Path) -> None:
    job = dict(random_init=True, out=tmp_path / "x.h5", preset=tiny_preset(), progress=False)
    with pytest.raises(ConfigError, match="--scenes 'test'"):
        run_capture(CaptureJob(victim="cnn-small", split="test", steps=5, **job))
    with pytest.raises(ConfigError, match="unknown victim|needs a victim name"):
        run_capture(CaptureJob(victim="resnet", split="train", steps=5, **job))
    with pytest.raises(ConfigError, match="--steps 0"):
        run_capture(CaptureJob(victim="cnn-small", split="train", steps=0, **job))


# -- bad files ---------------------------------------------------------------------------------
def copy_with(random_capture: Path, tmp_path: Path, edit) -> Path:
    path = tmp_path / "edited.h5"
    shutil.copy(random_capture, path)
    with h5py.File(path, "a") as handle:
        edit(handle)
    return path


def test_truncated_file(tmp_path: Path, random_capture: Path) -> None:
    path = tmp_path / "cut.h5"
    path.write_bytes(random_capture.read_bytes()[: random_capture.stat().st_size // 2])
    with pytest.raises(CaptureFileError, match="cut.h5 is not a readable HDF5"):
        CaptureFile(path)


def test_foreign_hdf5_file(tmp_path: Path) -> None:
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as handle:
        handle["data"] = np.zeros(3)
    with pytest.raises(CaptureFileError, match="not a gradleak capture: attribute 'format'"):
        CaptureFile(path)


def test_gradient_width_that_does_not_match_the_layer_table(tmp_path: Path,
                                                            random_capture: Path) -> None:
    def shrink_table(handle: h5py.File) -> None:
        table = json.loads(handle.attrs["layer_table"])[:-1]
        handle.attrs["layer_table"] = json.dumps(table)

    with pytest.raises(CaptureFileError, match="'gradients' has \\d+ columns but the layer_table"):
        CaptureFile(copy_with(random_capture, tmp_path, shrink_table))


def test_rows_missing_from_a_dataset(tmp_path: Path, random_capture: Path) -> None:
    def drop_rows(handle: h5py.File) -> None:
        handle["actions"].resize(10, axis=0)

    with pytest.raises(CaptureFileError, match="'actions' has 10 rows, attribute num_rows says"):
        CaptureFile(copy_with(random_capture, tmp_path, drop_rows))


def test_non_finite_gradients_are_reported_with_their_row(tmp_path: Path,
                                                          random_capture: Path) -> None:
    def poison(handle: h5py.File) -> None:
        handle["gradients"][7, 3] = np.inf

    with CaptureFile(copy_with(random_capture, tmp_path, poison)) as capture:
        with pytest.raises(CaptureFileError, match=r"NaN/Inf in 1 row\(s\): 7 "):
            capture.validate()
        with pytest.raises(CaptureFileError, match=r"NaN/Inf in 1 row\(s\): 7 "):
            capture.observation(slice(5, 20))  # rows counted in the file, not the slice
        assert capture.usable_rows(skip_nonfinite=True).tolist() == [i != 7 for i in range(50)]


def test_the_scan_reads_wide_rows_in_bounded_blocks_and_misses_none(
        tmp_path: Path, random_capture: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of at most SCAN_BYTES (here three rows' worth; a wide victim's rows made 256-row
    blocks cost a gigabyte): bad rows on both sides of block edges are all found."""
    import gradleak.capture.reader as reader

    def poison(handle: h5py.File) -> None:
        for row in (2, 3, 40, 49):
            handle["gradients"][row, 11] = np.nan

    path = copy_with(random_capture, tmp_path, poison)
    with h5py.File(path, "r") as handle:
        monkeypatch.setattr(reader, "SCAN_BYTES", 3 * int(handle.attrs["gradient_dim"]) * 4)
    blocks = []
    real_read = reader.CaptureFile.read
    monkeypatch.setattr(reader.CaptureFile, "read", lambda self, name, rows=slice(None), *a:
                        blocks.append(rows) or real_read(self, name, rows, *a))
    with CaptureFile(path) as capture:
        assert capture.nonfinite_rows().tolist() == [2, 3, 40, 49]
    assert max(block.stop - block.start for block in blocks) == 3 and len(blocks) == 17


def test_partial_and_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(CaptureFileError, match="interrupted capture.*--resume"):
        CaptureFile(tmp_path / "x.h5.partial")
    with pytest.raises(CaptureFileError, match="does not exist"):
        CaptureFile(tmp_path / "x.h5")


def test_shards_of_different_captures_are_not_mixed(tmp_path: Path, random_capture: Path) -> None:
    other = tmp_path / "other.h5"
    run_capture(CaptureJob(victim="cnn-small", random_init=True, split="heldout", steps=5,
                           out=other, preset=tiny_preset(), progress=False, seed=99))
    with pytest.raises(CaptureFileError, match="differ in 'theta0_sha256'"):
        open_captures([random_capture, other])


def test_checkpoint_and_environment_must_agree(tmp_path: Path) -> None:
    save_victim(tmp_path / "victim", create_victim(VictimConfig("cnn-small", frame_size=32,
                                                                num_actions=10)).eval())
    with pytest.raises(ConfigError, match="has 10 actions but the environment has 5"):
        run_capture(CaptureJob(victim=str(tmp_path / "victim"), split="train", steps=5,
                               out=tmp_path / "x.h5", preset=tiny_preset(), progress=False))
    preset = tiny_preset()
    preset.env.doomnav.frame_size = 64
    with pytest.raises(ConfigError, match="takes 32x32 frames but the preset renders 64x64"):
        run_capture(CaptureJob(victim=str(tmp_path / "victim"), split="train", steps=5,
                               out=tmp_path / "x.h5", preset=preset, progress=False))


def test_private_columns_are_served_only_by_their_named_readers(tmp_path: Path) -> None:
    """`Column.private` is read: column() and read() serve what the server sees (ids and
    gradients); frames, actions, advantages and the rest only through private_column() or
    target(), the readers for scoring and for an attacker's own training captures."""
    from gradleak.capture.reader import PRIVATE_COLUMNS
    from gradleak.capture.schema import step_columns

    out = tmp_path / "c.h5"
    run_capture(CaptureJob(victim="cnn-small", random_init=True, split="heldout", steps=12,
                           out=out, preset=tiny_preset(), progress=False, seed=3))
    declared = {c.name for c in step_columns((32, 32, 3), 5, 0) if c.private}
    assert PRIVATE_COLUMNS >= declared and "episode_ids" not in PRIVATE_COLUMNS
    with CaptureFile(out) as capture:
        assert len(capture.column("episode_ids")) == 12
        assert capture.read("gradients").shape[0] == 12
        for name in ("images", "actions", "advantages", "returns", "values"):
            with pytest.raises(CaptureFileError, match=f"column '{name}' is private"):
                capture.column(name)
            with pytest.raises(CaptureFileError, match="private_column"):
                capture.read(name)
        assert capture.private_column("actions").shape == (12,)
        assert capture.target().images.shape == (12, 32, 32, 3)


@pytest.mark.slow
def test_a_planned_job_array_merges_into_one_capture_without_copying(tmp_path: Path,
                                                                    capsys) -> None:
    """`capture-plan` prints each shard's command (run here as a job array would) and a
    Slurm script; `merge` joins the shards as virtual datasets: the same rows as reading the
    shards together, episode ids unique, a file of kilobytes; a moved or missing shard is
    named, never read as zeros; shards that are not one capture are refused."""
    import shlex

    from gradleak.capture.merge import merge_shards
    from gradleak.cli import main

    out, script = tmp_path / "train.h5", tmp_path / "array.sh"
    plan = ["capture-plan", "--victim", "cnn-small", "--random-init", "--scenes", "train",
            "--steps", "60", "--out", str(out), "--shards", "3", "--slurm", str(script),
            "--json", *TINY_FLAGS]
    assert main(plan) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["commands"]) == 3 and "${SLURM_ARRAY_TASK_ID}/3" in script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert main(plan) == 2  # the script exists: never replaced
    # only the placeholder is the task's shard: a path holding the word keeps it
    named = tmp_path / "SHARD-runs" / "array.sh"
    assert main([*plan[:plan.index("--out") + 1], str(tmp_path / "SHARD-runs" / "c.h5"),
                 "--shards", "3", "--slurm", str(named), "--quiet", *TINY_FLAGS]) == 0
    assert shlex.quote(str(tmp_path / "SHARD-runs" / "c.h5")) in named.read_text()
    for command in reversed(result["commands"]):
        assert main(shlex.split(command)[1:]) == 0
    assert main(shlex.split(result["merge"])[1:]) == 0
    files = open_captures(result["shards"])
    joined = concat_observations([f.observation() for f in files])
    for f in files:
        f.close()
    with CaptureFile(out) as merged:
        observation = merged.observation()
        assert merged.attrs["shard"] == "0/1" and merged.attrs["num_rows"] == 60
        assert np.array_equal(observation.gradients, joined.gradients)
        assert np.array_equal(observation.episode_ids, joined.episode_ids)
        assert len(merged.scenes) == len(json.loads(merged.attrs["scenes"]))
    assert out.stat().st_size < 0.1 * sum(Path(s).stat().st_size for s in result["shards"])
    moved = tmp_path / "moved"
    moved.mkdir()
    for path in [out, *map(Path, result["shards"])]:
        shutil.move(path, moved / path.name)
    with CaptureFile(moved / out.name) as merged:  # shards named relative to the merged file
        assert np.array_equal(merged.observation().gradients, joined.gradients)
    shard = moved / Path(result["shards"][2]).name
    with h5py.File(shard, "r+") as handle:  # replaced by a shard captured at another θ0
        theta0 = handle.attrs["theta0_sha256"]
        handle.attrs["theta0_sha256"] = "f" * 64
    with pytest.raises(CaptureFileError, match="shard-2-of-3.h5 was captured at θ0 ffffffffffff"
                       "…, the merged file at " + str(theta0)[:12]):
        CaptureFile(moved / out.name)
    with h5py.File(shard, "r+") as handle:
        handle.attrs["theta0_sha256"] = theta0
    (moved / Path(result["shards"][1]).name).unlink()
    with pytest.raises(CaptureFileError, match="shard .*shard-1-of-3.h5 is missing"):
        CaptureFile(moved / out.name)
    with pytest.raises(CaptureFileError, match="shard\\(s\\) 1 of 3 are missing"):
        merge_shards([moved / Path(s).name for s in result["shards"][::2]], tmp_path / "m.h5")
    with pytest.raises(CaptureFileError, match="both shard 0"):
        merge_shards([moved / Path(result["shards"][0]).name] * 2, tmp_path / "m.h5")
    assert not (tmp_path / "m.h5").exists()
