"""A user's own learned attacker: one decorator on its objective registers it, then
`gradleak train-attacker` fits it, its checkpoint rebuilds it and `evaluate` scores it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from gradleak.attacks.attacker import WindowAttacker
from gradleak.attacks.encoders import GradientInput, subsample_index
from gradleak.cli import main
from gradleak.evaluation.reconstructions import evaluate
from gradleak.io import read_json
from gradleak.presets import AttackConfig
from gradleak.threat import ObservedWindows
from gradleak.training.checkpoint import MODELS, load_attacker
from gradleak.training.fit import FitConfig, fit_attacker
from gradleak.training.objectives import FIT_KINDS, LtiObjective, window_attacker


@dataclass
class BlurConfig:
    gradient_dim: int = 0  # the fit sets these three from the training capture
    frame_size: int = 64
    num_actions: int = 5
    fraction: float = 0.05


class Blur(WindowAttacker):
    """One learned frame for every step, and the action from 5% of the gradient."""

    name = "Blur"

    def __init__(self, config: BlurConfig) -> None:
        super().__init__()
        self.config = config
        self.input = GradientInput(config.gradient_dim,
                                   subsample_index(config.gradient_dim, config.fraction, 0))
        self.frame = nn.Parameter(torch.zeros(3, config.frame_size, config.frame_size))
        self.actions = nn.Linear(self.input.features, config.num_actions)

    @property
    def gradient_input(self) -> GradientInput:
        return self.input

    def forward(self, gradients: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        frames = torch.sigmoid(self.frame).expand(*gradients.shape[:-1], *self.frame.shape)
        return frames, self.actions(self.input(gradients))

    def attack(self, gradients: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self(gradients)


@pytest.fixture
def blur() -> Iterator[None]:
    window_attacker("blur", Blur, BlurConfig, window=lambda config: 1, strided=False,
                    scheduled_sampling=False, adaptive_windows=64)(LtiObjective)
    yield
    MODELS.drop("blur")
    FIT_KINDS.drop("blur")


@pytest.mark.slow
def test_one_decorator_makes_a_learned_attacker_gradleak_trains_and_scores(
        blur: None, train_capture: Path, random_capture: Path, tmp_path: Path) -> None:
    model, fit = AttackConfig().learned("blur")  # its settings' defaults and FitConfig's
    assert isinstance(model, BlurConfig) and isinstance(fit, FitConfig)
    out = tmp_path / "blur"
    fit = FitConfig(epochs=3, batch_size=8, lr=0.1, warmup_epochs=0, max_train_windows=16,
                    max_val_windows=8, normaliser_rows=64, workers=0)
    fit_attacker("blur", model, fit, [str(train_capture)], out, progress=False)
    history = read_json(out / "attacker.json", "attacker")["history"]
    assert history[-1]["val_loss"] < history[0]["val_loss"]  # it learned
    loaded, meta = load_attacker(out)
    assert type(loaded) is Blur and meta["kind"] == "blur"
    result = loaded.reconstruct(ObservedWindows(torch.randn(2, 1, loaded.config.gradient_dim)))
    assert result.images.shape == (2, 1, 32, 32, 3)
    assert (result.images[0] == result.images[1]).all()  # one learned frame for every step
    scored = evaluate([random_capture], {"Blur": str(out)}, tmp_path / "eval", max_windows=2)
    assert scored["methods"]["Blur"]["kind"] == "learned"


def test_the_command_line_fits_a_plugin_attacker_on_its_defaults_and_says_so(
        blur: None, train_capture: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
        ) -> None:
    code = main(["train-attacker", "--kind", "blur", "--data", str(train_capture), "--out",
                 str(tmp_path / "b"), "--epochs", "1", "--quiet"])
    assert code == 2 and "attack.blur_fit" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
