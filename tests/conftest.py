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


def random_init_capture(factory: pytest.TempPathFactory, split: str, steps: int,
                        dtype: str = "float32") -> Path:
    """A capture of a random-init cnn-small; seed 3, so every such capture shares θ0."""
    from gradleak.capture.run import CaptureJob, run_capture

    preset = tiny_preset()
    preset.capture.gradient_dtype = dtype
    out = factory.mktemp("capture") / f"{split}.h5"
    run_capture(CaptureJob(victim="cnn-small", random_init=True, split=split, steps=steps,
                           out=out, preset=preset, progress=False, seed=3))
    return out


@pytest.fixture(scope="session")
def random_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Held-out scenes, 50 steps."""
    return random_init_capture(tmp_path_factory, "heldout", 50)


@pytest.fixture(scope="session")
def float16_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`random_capture`'s steps, stored in float16 (the lossy storage option)."""
    return random_init_capture(tmp_path_factory, "heldout", 50, "float16")


@pytest.fixture(scope="session")
def train_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Training scenes, 240 steps, the same victim as `random_capture`."""
    return random_init_capture(tmp_path_factory, "train", 240)


@pytest.fixture(scope="session")
def train_shards(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Training scenes captured as two shards (one scene each), the same victim as
    `train_capture`."""
    from gradleak.capture.run import CaptureJob, run_capture

    root = tmp_path_factory.mktemp("shards")
    return [Path(run_capture(CaptureJob(victim="cnn-small", random_init=True, split="train",
                                        steps=120, out=root / "train.h5", preset=tiny_preset(),
                                        shard=(index, 2), progress=False, seed=3))["out"])
            for index in range(2)]


def tiny_attack_settings(kind: str):
    """A few-second TRACE or LtI configuration for the 32x32 test captures."""
    preset = tiny_preset()
    model, fit = preset.attack.learned(kind)
    if kind == "trace":
        model.window, model.encoder_width, model.latent, model.image_channels = 4, 64, 64, 8
        model.layers, model.heads = 1, 4
        fit.rollout_steps = 2
    else:
        model.hidden = 64
    fit.epochs, fit.workers, fit.max_train_windows, fit.max_val_windows = 2, 0, 24, 8
    fit.normaliser_rows = 64
    return model, fit


@pytest.fixture(scope="session")
def trained_attackers(tmp_path_factory: pytest.TempPathFactory, train_capture: Path
                      ) -> dict[str, Path]:
    from gradleak.training.fit import fit_attacker

    root = tmp_path_factory.mktemp("attackers")
    for kind in ("trace", "lti"):
        model, fit = tiny_attack_settings(kind)
        fit_attacker(kind, model, fit, [str(train_capture)], root / kind, progress=False)
    return {"trace": root / "trace", "lti": root / "lti"}


@pytest.fixture(scope="session", params=["ppo", "a2c"])
def float32_capture(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                    ) -> Path:
    """12 held-out steps with gradients stored exactly (float32), for PPO and for A2C."""
    from gradleak.capture.run import CaptureJob, run_capture

    preset = tiny_preset()
    preset.capture.gradient_dtype = "float32"
    out = tmp_path_factory.mktemp(request.param) / "heldout.h5"
    run_capture(CaptureJob(victim="cnn-small", random_init=True, algorithm=request.param,
                           split="heldout", steps=12, out=out, preset=preset, progress=False,
                           seed=5))
    return out
