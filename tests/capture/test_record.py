"""`gradleak.capture.record`: a user's own rollouts become a standard capture, every input
checked before anything is written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from gradleak.capture.reader import CaptureFile
from gradleak.capture.record import record
from gradleak.cli import main
from gradleak.errors import ConfigError, GradleakError
from gradleak.victims import create_victim

LOSS = {"value": 0.5, "entropy": 0.0, "clip": 0.2, "gamma": 0.99, "lam": 0.95}


def rollouts(steps: int = 12, size: int = 32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"images": rng.integers(0, 256, (steps, size, size, 3), dtype=np.uint8),
            "actions": np.arange(steps) % 5, "advantages": rng.normal(size=steps) + 0.1,
            "returns": rng.normal(size=steps), "episode_ids": np.repeat([4, 9, 2], steps // 3)}


def test_a_users_rollouts_become_a_capture_the_attacks_read(capsys, tmp_path: Path) -> None:
    torch.manual_seed(0)
    victim = create_victim("cnn-small", frame_size=32)
    data = rollouts()
    out = tmp_path / "mine.h5"
    result = record(victim, out, loss=LOSS, **data)
    assert result == {"out": str(out), "rows": 12, "episodes": 3}
    with CaptureFile(out) as capture:
        capture.validate()  # episodes contiguous and closed, every chunk decoded
        assert capture.column("step_in_episode").tolist() == [0, 1, 2, 3] * 3
        assert np.array_equal(capture.target().advantages, data["advantages"].astype(np.float32))
        assert json.loads(capture.attrs["loss"])["advantage_normalisation"] == "none (raw GAE)"
    assert main(["closed-form", str(out), "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)[str(out)]
    assert scores["action_accuracy"] == 1.0 and scores["advantage_max_abs_error"] < 1e-3


@pytest.mark.parametrize("change, fragment", [
    ({"images": np.zeros((12, 16, 16, 3), np.uint8)}, "expected uint8 (N, 32, 32, 3)"),
    ({"actions": np.full(12, 7)}, "each in 0..4"),
    ({"advantages": np.r_[np.nan, np.zeros(11)]}, "advantages: holds NaN/Inf"),
    ({"episode_ids": np.array([0, 1, 0] * 4)}, "must be contiguous"),
    ({"returns": np.zeros(5)}, "returns: shape (5,)"),
    ({"loss": {"value": 0.5}}, "missing entropy, clip, gamma, lam"),
    ({"old_log_probs": np.r_[np.nan, np.zeros(11)]}, "old_log_probs: holds NaN/Inf"),
    ({"old_log_probs": np.zeros(1)}, "old_log_probs: shape (1,), expected (12,)"),
    ({"old_log_probs": np.full(12, 0.5)}, "old_log_probs: a log-probability above 0"),
    ({"actions": np.arange(12) % 5 + 0.5}, "actions: 0.5 at step 0 is not a whole number"),
    ({"actions": np.array(list("012340123401"))}, "actions: <U1 values, expected numbers"),
    ({"rewards": np.zeros(40)}, "rewards: shape (40,), expected (12,)"),
    ({"split": "banana"}, "split 'banana': expected one of train, heldout"),
    ({"loss": {**LOSS, "gamma": 7}}, "loss['gamma'] = 7: expected a number in [0, 1]"),
    ({"loss": {**LOSS, "lam": -3}}, "loss['lam'] = -3"),
    ({"loss": {**LOSS, "value": "0.5"}}, "loss['value'] = '0.5'"),
    ({"episode_ids": np.zeros(0)}, "episode_ids: shape (0,)"),
])
def test_bad_rollouts_are_refused_and_nothing_written(tmp_path: Path, change,
                                                      fragment: str) -> None:
    arguments = {**rollouts(), "loss": LOSS, **change}
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        record(create_victim("cnn-small", frame_size=32), tmp_path / "out" / "x.h5",
               **arguments)
    assert not list(tmp_path.iterdir())


def test_a_recurrent_victim_needs_its_states(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pass each step's pre-step state"):
        record(create_victim("cnn-gru-small", frame_size=32), tmp_path / "x.h5", loss=LOSS,
               **rollouts())


def test_float_actions_that_are_whole_numbers_are_kept_exactly(tmp_path: Path) -> None:
    """SB3's rollout buffer holds actions as float32: whole numbers are read as they are."""
    data = rollouts()
    data["actions"] = data["actions"].astype(np.float32)
    out = tmp_path / "f.h5"
    record(create_victim("cnn-small", frame_size=32), out, loss=LOSS, **data)
    with CaptureFile(out) as capture:
        assert capture.private_column("actions").tolist() == (np.arange(12) % 5).tolist()


def test_overwrite_replaces_a_capture_but_never_another_file(tmp_path: Path) -> None:
    victim = create_victim("cnn-small", frame_size=32)
    mine = tmp_path / "notes.h5"
    mine.write_text("not a capture")
    with pytest.raises(GradleakError, match="is not a gradleak capture"):
        record(victim, mine, loss=LOSS, overwrite=True, **rollouts())
    assert mine.read_text() == "not a capture"
    out = tmp_path / "c.h5"
    record(victim, out, loss=LOSS, **rollouts())
    assert record(victim, out, loss=LOSS, overwrite=True, **rollouts())["rows"] == 12


def test_rows_streamed_one_at_a_time_write_the_same_capture(tmp_path: Path, monkeypatch) -> None:
    """Memory does not grow with the rollout: gradients are computed and written in chunks,
    an episode over several of them. One row at a time gives the same file."""
    import gradleak.capture.record as recording

    torch.manual_seed(0)
    victim = create_victim("cnn-small", frame_size=32)
    data = rollouts()
    record(victim, tmp_path / "whole.h5", loss=LOSS, **data)
    monkeypatch.setattr(recording, "CHUNK_BYTES", 1)  # one row per chunk
    assert recording.rows_per_chunk(10 ** 6) == 1
    record(victim, tmp_path / "rows.h5", loss=LOSS, **data)
    with CaptureFile(tmp_path / "whole.h5") as whole, CaptureFile(tmp_path / "rows.h5") as rows:
        assert rows.validate()["episodes"] == 3
        for name in ("step_in_episode", "dones", "actions", "episode_ids"):
            assert np.array_equal(rows.private_column(name), whole.private_column(name)), name
        for name in ("values", "log_probs"):  # a batch of one rounds differently, by an ulp
            torch.testing.assert_close(torch.as_tensor(rows.private_column(name)),
                                       torch.as_tensor(whole.private_column(name)))
        torch.testing.assert_close(torch.as_tensor(rows.read("gradients")),
                                   torch.as_tensor(whole.read("gradients")), rtol=1e-5,
                                   atol=1e-7)
