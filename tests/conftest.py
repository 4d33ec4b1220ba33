"""Shared fixtures. The geometry cache goes to a temporary folder, never the user's home."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("GRADLEAK_CACHE", tempfile.mkdtemp(prefix="gradleak-test-cache-"))

from gradleak.presets import Preset, load_preset


def tiny_preset() -> Preset:
    """32x32 frames, 20-step episodes, two maps: seconds, not minutes."""
    preset = load_preset("cpu-quick", [
        "env.doomnav.frame_size=32", "env.doomnav.max_steps=20", "env.train_maps=MAP01",
        "env.heldout_maps=MAP05", "env.max_regions_per_map=2", "train.num_envs=2",
        "train.rollout_steps=16", "train.updates=1", "train.minibatch=16", "train.epochs=2"])
    return preset


@pytest.fixture
def preset() -> Preset:
    return tiny_preset()


@pytest.fixture(scope="session")
def random_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small capture of a random-init cnn-small on held-out scenes (50 steps)."""
    from gradleak.capture.run import CaptureJob, run_capture

    out = tmp_path_factory.mktemp("capture") / "heldout.h5"
    run_capture(CaptureJob(victim="cnn-small", random_init=True, split="heldout", steps=50,
                           out=out, preset=tiny_preset(), progress=False, seed=3))
    return out
