"""The public API: `import gradleak` names it (dir, editors), and docs/api.md's and README's
examples run."""

from __future__ import annotations

import re
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from helpers import SHORT_AUDIT, smooth_frame

import gradleak
from gradleak.errors import ConfigError

API = Path(__file__).resolve().parents[1] / "docs" / "api.md"
README = API.parents[1] / "README.md"


def test_the_public_names_are_listed_and_load() -> None:
    assert set(gradleak.__all__) <= set(dir(gradleak))
    for name in gradleak.__all__:
        assert getattr(gradleak, name) is not None
    assert callable(gradleak.audit)  # a function, not a module of the same name


@pytest.mark.slow
def test_the_documented_audit_example_runs(random_capture: Path, tmp_path: Path, capsys) -> None:
    code = re.search(r"## Audit a capture\n\n```python\n(.*?)```", API.read_text(),
                     re.S).group(1)
    # the example's plumbing at a fraction of its cost (helpers.SHORT_AUDIT)
    code = code.replace("runs/mine/heldout.h5", str(random_capture)).replace(
        "runs/mine/audit", str(tmp_path / "audit")).replace(
        "budget_minutes=10)", f"budget_minutes=10, overrides={SHORT_AUDIT})")
    exec(compile(code, str(API), "exec"), {})  # noqa: S102 (our own documentation)
    printed = capsys.readouterr().out
    verdict = gradleak.audit(random_capture, out=tmp_path / "audit",
                             defenses=["quant:8", "prune:0.1"], budget_minutes=10,
                             overrides=SHORT_AUDIT)  # resumed
    assert verdict.headline[0] in printed and str(verdict.report) in printed
    assert verdict.report.is_file() and verdict.results.is_file()
    assert verdict.frames_psnr == verdict.details["frames"]["psnr"]
    assert [o["spec"] for o in verdict.details["defenses"]] == ["quant:8", "prune:0.1"]


def test_an_unknown_setting_is_named_before_any_work(random_capture: Path, tmp_path: Path
                                                     ) -> None:
    with pytest.raises(ConfigError, match="unknown setting.*max_window"):
        gradleak.audit(random_capture, out=tmp_path / "a", max_window=4)
    assert not (tmp_path / "a").exists()


class OwnPolicy(torch.nn.Module):
    """A user's policy as README's example assumes it: a conv body, heads `pi` and `v`."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 8, 4), torch.nn.ReLU(), torch.nn.Conv2d(16, 32, 4, 2),
            torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(32 * 6 * 6, 64), torch.nn.ReLU())
        self.pi, self.v = torch.nn.Linear(64, 5), torch.nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.pi(h), self.v(h)


class SmoothScenes(gym.Env):
    """A user's own environment as README's example assumes it: (64, 64, 3) uint8 frames, five
    actions, episodes cut after eight steps."""

    observation_space = gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
    action_space = gym.spaces.Discrete(5)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.scene, self.t = int(self.np_random.integers(1000)), 0
        return self.frame(), {}

    def frame(self) -> np.ndarray:
        return smooth_frame(64, 100 * self.scene + self.t).numpy()

    def step(self, action: int):
        self.t += 1
        return self.frame(), float(action == 2), False, self.t >= 8, {}


@pytest.mark.slow
def test_readmes_own_model_example_audits_a_policy_gradleak_has_not_seen(tmp_path: Path,
                                                                          capsys) -> None:
    """README's lines, as printed there, on a policy and an environment defined here: the
    rollout is recorded, the audit prints its verdict and writes its report."""
    code = re.search(r"## Audit your own model\n.*?```python\n(.*?)```", README.read_text(),
                     re.S).group(1)
    assert "budget_minutes=10" in code and "steps=256" in code
    # half a minute of budget: the stages it does not pay for are named in the verdict, not run;
    # two episodes of 8 steps: the audit's windows are 8 steps long
    code = code.replace("runs/mine", str(tmp_path)).replace(
        "budget_minutes=10", f"budget_minutes=0.5, overrides={SHORT_AUDIT}").replace(
        "steps=256", "steps=16")
    namespace = {"model": OwnPolicy(), "env": SmoothScenes()}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 (our own documentation)
    verdict = namespace["verdict"]
    assert verdict.report.is_file() and (tmp_path / "heldout.h5").is_file()
    assert len(namespace["rollout"]) == 16
    printed = capsys.readouterr().out
    assert verdict.headline[0] in printed
    assert verdict.actions_accuracy is not None
