"""Learned attackers learn, resume exactly, scale out with DDP, and refuse bad input."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_attack_settings

from gradleak.attacks.lti import LearningToInvert, LtiConfig
from gradleak.attacks.trace import Trace, TraceConfig
from gradleak.errors import CheckpointError, ConfigError
from gradleak.io import load_tensors
from gradleak.metrics.images import psnr
from gradleak.metrics.lpips import PIP_COMMAND, package_weights
from gradleak.training.checkpoint import load_attacker
from gradleak.training.data import WindowDataset, collate
from gradleak.training.fit import (
    Budget,
    EpochSampler,
    FitConfig,
    fine_tune_under_defense,
    fit_attacker,
    rank_files,
    scheduled_sampling_beta,
    warmup_cosine,
)
from gradleak.training.objectives import LossWeights, LtiObjective, Perceptual, TraceObjective

MSE_ONLY = LossWeights(mse=1.0, l1=0.0, action=0.01, perceptual=0.0, rollout=0.0)


def overfit(objective: torch.nn.Module, batch, steps: int, lr: float) -> tuple[float, float]:
    optimiser = torch.optim.Adam(objective.parameters(), lr)
    first = None
    for _ in range(steps):
        loss, _ = objective(batch.observed.gradients, batch.images, batch.actions, 0.0)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        first = first if first is not None else float(loss.detach())
    return first, float(loss.detach())


@pytest.mark.slow
def test_a_tiny_trace_overfits_a_tiny_capture(train_capture: Path) -> None:
    data = WindowDataset([train_capture], window=4, stride=4)
    batch = collate([data[i] for i in range(4)])
    torch.manual_seed(0)
    model = Trace(TraceConfig(gradient_dim=data.gradient_dim, frame_size=32, window=4,
                              encoder_width=64, encoder_blocks=1, latent=64, layers=1, heads=4,
                              image_channels=8, dropout=0.0))
    model.gradient_encoder.input.fit(data.gradient_rows(64))
    with torch.no_grad():
        before = psnr(model.decode(batch.observed.gradients)[0].flatten(0, 1),
                      batch.images.flatten(0, 1)).mean()
    first, last = overfit(TraceObjective(model, MSE_ONLY, Perceptual("ssim"), 0), batch, 150, 3e-3)
    with torch.no_grad():
        after = psnr(model.decode(batch.observed.gradients)[0].flatten(0, 1),
                     batch.images.flatten(0, 1)).mean()
    assert first / last >= 10 and after > before + 10


def test_a_tiny_lti_overfits_a_tiny_capture(train_capture: Path) -> None:
    data = WindowDataset([train_capture], window=4, stride=4)
    batch = collate([data[i] for i in range(4)])
    torch.manual_seed(0)
    model = LearningToInvert(LtiConfig(gradient_dim=data.gradient_dim, frame_size=32, hidden=128))
    model.input.fit(data.gradient_rows(64))
    first, last = overfit(LtiObjective(model, MSE_ONLY, Perceptual("ssim")), batch, 150, 1e-3)
    assert first / last >= 10


def test_the_perceptual_term_is_the_named_lpips_or_says_why_it_fell_back(monkeypatch) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.rand(2, 4, 3, 32, 32, generator=g, requires_grad=True)
    b = torch.rand(2, 4, 3, 32, 32, generator=g)
    ssim_term = Perceptual("ssim")
    assert ssim_term.name == "1-ssim" and ssim_term.reason is None
    if package_weights("alex") is not None:
        alex = Perceptual("alex")
        assert alex.name == "lpips-alex"
        alex(a, b).backward()  # a training loss: gradients reach the prediction
        assert a.grad is not None and a.grad.abs().sum() > 0
        assert alex(b, b).item() == pytest.approx(0.0, abs=1e-6)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    fallback = Perceptual("vgg")
    assert fallback.name == "1-ssim" and PIP_COMMAND in fallback.reason
    assert fallback(a, b).item() == pytest.approx(ssim_term(a, b).item())


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run(train_capture: Path, tmp_path: Path) -> None:
    model, fit = tiny_attack_settings("trace")
    fit_attacker("trace", model, fit, [str(train_capture)], tmp_path / "straight",
                 progress=False)
    fit.epochs = 1
    fit_attacker("trace", model, fit, [str(train_capture)], tmp_path / "resumed",
                 progress=False)
    with pytest.raises(ConfigError, match="--resume"):
        fit_attacker("trace", model, fit, [str(train_capture)], tmp_path / "resumed",
                     progress=False)
    fit.epochs = 2
    fit_attacker("trace", model, fit, [str(train_capture)], tmp_path / "resumed",
                 resume=True, progress=False)
    straight = load_tensors(tmp_path / "straight" / "attacker.safetensors", "weights")
    resumed = load_tensors(tmp_path / "resumed" / "attacker.safetensors", "weights")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    meta = json.loads((tmp_path / "resumed" / "attacker.json").read_text())
    assert meta["epoch"] == 2 and [h["epoch"] for h in meta["history"]] == [1, 2]
    assert (tmp_path / "resumed" / "best.safetensors").exists()
    assert any((tmp_path / "resumed" / "tensorboard").iterdir())  # scalars and sample grids


def test_a_time_limit_stops_at_the_step_that_spends_it_and_resume_starts_the_next_epoch(
        train_capture: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget is read before each epoch and after every optimiser step: spent at the
    second of six steps, the run saves that epoch as a third of one, marked as stopped by the
    limit (an epoch-end check would have run all six); a resumed run with a fresh budget starts
    epoch 2."""
    readings = iter([False, False, True])
    monkeypatch.setattr("gradleak.training.loop.Budget.spent", lambda self: next(readings, True))
    model, fit = tiny_attack_settings("lti")
    fit.batch_size, fit.accumulation, fit.epochs, fit.time_limit_minutes = 4, 1, 3, 1.0
    out = tmp_path / "limited"
    fit_attacker("lti", model, fit, [str(train_capture)], out, progress=False)
    meta = json.loads((out / "attacker.json").read_text())
    assert meta["epoch"] == 1 and len(meta["history"]) == 1
    assert meta["history"][0]["epoch_fraction"] == pytest.approx(2 / 6)
    assert meta["history"][0]["time_limit_reached"]
    assert meta["history"][0]["train_cpu_minutes"] >= 0
    monkeypatch.setattr("gradleak.training.loop.Budget.spent", lambda self: False)
    fit_attacker("lti", model, fit, [str(train_capture)], out, resume=True, progress=False)
    meta = json.loads((out / "attacker.json").read_text())
    assert [h["epoch"] for h in meta["history"]] == [1, 2, 3]
    assert [h["epoch_fraction"] for h in meta["history"][1:]] == [1.0, 1.0]
    assert not any(h["time_limit_reached"] for h in meta["history"][1:])


@pytest.mark.slow
def test_each_epoch_records_the_share_of_its_time_spent_waiting_for_data(
        train_capture: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader made slow (80 ms a window of the training batches, in this process) shows as
    most of the epoch spent waiting; the same fit with the usual loader waits a clearly smaller
    share (on a loaded machine the usual loader's share reached 0.50, against 0.94 with 40 ms a
    window)."""
    import time

    model, fit = tiny_attack_settings("lti")
    fit.epochs, fit.batch_size = 1, 4
    fit_attacker("lti", model, fit, [str(train_capture)], tmp_path / "usual", progress=False)
    slow = WindowDataset.__getitems__  # a batch's read (not the mean image's scan before it)

    def sleepy(self, indices):
        time.sleep(0.08 * len(indices))
        return slow(self, indices)

    monkeypatch.setattr(WindowDataset, "__getitems__", sleepy)
    fit_attacker("lti", model, fit, [str(train_capture)], tmp_path / "slow", progress=False)
    usual, starved = (json.loads((tmp_path / name / "attacker.json").read_text())["history"][0]
                      ["data_wait_fraction"] for name in ("usual", "slow"))
    assert starved > 0.8 and starved - usual > 0.25
    # a fit on the CPU keeps full rows (compact ones would move the outer products here)
    assert json.loads((tmp_path / "usual" / "attacker.json").read_text())["compact_rows"] is False


@pytest.mark.slow
def test_an_adaptive_fine_tune_starts_from_the_clean_attacker_and_trains_under_the_defense(
        trained_attackers, train_capture: Path, tmp_path: Path) -> None:
    """At a vanishing learning rate (steps far below float32's resolution of the weights) the
    fine-tuned parameters are the clean ones bit for bit, even when the caller's model config
    names another projection and width: the architecture comes from the clean run. Only the
    input normaliser moves: it is refit on the defended gradients."""
    model, fit = tiny_attack_settings("trace")
    model.projection, model.encoder_width, fit.lr, fit.min_lr = "dense", 32, 3e-30, 0.0
    out = tmp_path / "adaptive"
    result = fine_tune_under_defense("trace", model, fit, trained_attackers["trace"], "quant:8",
                                     1.0, [str(train_capture)], out, progress=False)
    clean, _ = load_attacker(trained_attackers["trace"])
    tuned, _ = load_attacker(out)
    clean_state, tuned_state = clean.state_dict(), tuned.state_dict()
    parameters = dict(clean.named_parameters())
    assert clean_state.keys() == tuned_state.keys()
    assert all(torch.equal(tuned_state[k], clean_state[k]) for k in parameters)
    moved = {k for k in clean_state if not torch.equal(tuned_state[k], clean_state[k])}
    assert moved and all(k.startswith("gradient_encoder.input.") for k in moved)
    meta = json.loads((out / "attacker.json").read_text())
    assert meta["fit"]["defense"] == "quant:8" and result["epochs"] == 1
    assert meta["fit"]["init_from"] == str(trained_attackers["trace"])


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "two-shards"])
def test_two_gloo_processes_end_with_identical_weights(sharded: bool, train_capture: Path,
                                                       train_shards: list[Path],
                                                       tmp_path: Path) -> None:
    """One capture file: the ranks split its windows. A capture in two shards: each rank trains
    on its own shard's windows (as many steps as the smaller holds)."""
    data = [str(p) for p in train_shards] if sharded else [str(train_capture)]
    out = tmp_path / "ddp"
    logs = tmp_path / "logs"  # each rank's own output: the launcher's summary hides why
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "--log-dir", str(logs), "--redirects", "3",
               "-m", "gradleak.cli", "train-attacker", "--kind", "trace",
               "--data", *data, "--out", str(out), "--epochs", "1", "--quiet",
               "--preset", "cpu-quick",
               "--set", "attack.trace.window=4", "--set", "attack.trace.encoder_width=32",
               "--set", "attack.trace.latent=32", "--set", "attack.trace.layers=1",
               "--set", "attack.trace.image_channels=8", "--set", "attack.trace_fit.workers=0",
               "--set", "attack.trace_fit.batch_size=4",
               "--set", "attack.trace_fit.max_val_windows=4",
               "--set", "attack.trace_fit.normaliser_rows=32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    ranks = "\n".join(f"{p.relative_to(logs)}: {p.read_text()[-1500:]}"
                       for p in sorted(logs.rglob("*.log")) if p.stat().st_size)
    assert result.returncode == 0, result.stderr[-1000:] + "\n" + ranks
    meta = json.loads((out / "attacker.json").read_text())
    assert meta["world_size"] == 2
    assert meta["history"][-1]["replica_spread"] == 0.0
    if sharded:
        counts = [len(WindowDataset(data, window=4, part="train", files=[rank], seed=0))
                  for rank in range(2)]
        assert meta["rank_data"] == "files" and meta["train_windows_per_rank"] == counts
        assert meta["train_windows"] == counts[0]
    else:
        assert meta["rank_data"] == "windows"


def test_ranks_take_equal_disjoint_shares_and_whole_files_when_there_are_enough() -> None:
    shares = [list(EpochSampler(20, seed=1, limit=11, rank=r, world=3)) for r in range(3)]
    assert [len(share) for share in shares] == [3, 3, 3]
    drawn = sum(shares, [])
    assert len(set(drawn)) == 9
    assert set(drawn) <= set(EpochSampler(20, seed=1, limit=11))
    assert rank_files("auto", 5, rank=1, world=2) == [1, 3]
    assert rank_files("auto", 1, rank=1, world=2) is None  # fewer files than ranks
    assert rank_files("windows", 5, rank=1, world=2) is None
    assert rank_files("files", 5, rank=0, world=1) is None
    with pytest.raises(ConfigError, match="1 capture file.*2 ranks.*--shard"):
        rank_files("files", 1, rank=0, world=2)
    with pytest.raises(ConfigError, match="rank_data 'shards'"):
        rank_files("shards", 4, rank=0, world=2)


def test_schedules() -> None:
    config = FitConfig(epochs=10, teacher_forcing_epochs=3, beta_start=0.1, beta_end=0.7,
                       lr=1e-3, min_lr=1e-5, warmup_epochs=2)
    betas = [scheduled_sampling_beta(config, e) for e in range(10)]
    assert betas[:3] == [0, 0, 0] and betas[3] == pytest.approx(0.1)
    assert betas[-1] == pytest.approx(0.7) and betas == sorted(betas)
    factor = warmup_cosine(config, steps_per_epoch=5)
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)
    assert factor(50) == pytest.approx(0.01) and factor(49) > factor(50)
    # a time-limited run decays to its budget: half of it spent is half of the cosine, all of
    # it is the floor, however few steps ran; warm-up still counts steps
    spent = [0.5]
    timed = warmup_cosine(config, steps_per_epoch=5, time_progress=lambda: spent[0])
    assert timed(12) == pytest.approx(0.01 + 0.99 * 0.5) and timed(3) == factor(3)
    spent[0] = 1.0
    assert timed(12) == pytest.approx(0.01)
    spent[0] = 0.0
    assert timed(45) == pytest.approx(factor(45))  # steps further along than time win
    assert Budget(None, "cpu").fraction_spent() == 0.0
    assert Budget(1e-12, "wall").fraction_spent() == 1.0


def test_corrupt_and_foreign_attacker_checkpoints(trained_attackers, tmp_path: Path) -> None:
    model, meta = load_attacker(trained_attackers["trace"])
    assert meta["kind"] == "trace" and not model.training
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "attacker.json").write_text(
        (trained_attackers["trace"] / "attacker.json").read_text())
    (broken / "attacker.safetensors").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        load_attacker(broken)
    (broken / "attacker.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError, match="expected 'gradleak-attacker'"):
        load_attacker(broken)
    # a model setting this version does not know, or of the wrong type, is named, not dropped
    good = json.loads((trained_attackers["trace"] / "attacker.json").read_text())
    (broken / "attacker.safetensors").write_bytes(
        (trained_attackers["trace"] / "attacker.safetensors").read_bytes())
    for model, message in (({**good["model"], "heads_v2": 16}, "'heads_v2' is not a setting of "
                            "the trace model"),
                           ({**good["model"], "layers": "two"}, "field 'model'.layers is 'two'")):
        (broken / "attacker.json").write_text(json.dumps({**good, "model": model}))
        with pytest.raises((CheckpointError, ConfigError), match=message):
            load_attacker(broken)


def test_every_fit_reports_its_time_the_same_way(train_capture: Path, tmp_path: Path) -> None:
    """minutes = the epochs' training time summed over every session; a resumed run counts
    its first session too, and session_minutes only this one (for the attackers and the
    decoder alike)."""
    from conftest import tiny_attack_settings

    from gradleak.training.fit import fit_attacker

    model, fit = tiny_attack_settings("lti")
    fit.epochs = 1
    first = fit_attacker("lti", model, fit, [str(train_capture)], tmp_path / "a", progress=False)
    fit.epochs = 2
    second = fit_attacker("lti", model, fit, [str(train_capture)], tmp_path / "a", resume=True,
                          progress=False)
    history = json.loads((tmp_path / "a" / "attacker.json").read_text())["history"]
    assert len(history) == 2
    assert abs(second["minutes"] - sum(r["train_minutes"] for r in history)) < 1e-9
    assert second["minutes"] > first["minutes"] and second["session_minutes"] > 0
    assert set(first) >= {"minutes", "cpu_minutes", "session_minutes"}


def test_fractions_of_the_training_episodes_are_nested_with_one_validation_set(
        train_capture: Path) -> None:
    def episodes(part: str, fraction: float) -> set[int]:
        data = WindowDataset([train_capture], window=1, stride=1, part=part, val_fraction=0.2,
                             seed=3, train_fraction=fraction)
        return {int(e) for e in data.rows[:, 2]}

    subsets = [episodes("train", f) for f in (0.3, 0.6, 1.0)]
    assert subsets[0] < subsets[1] < subsets[2]  # nested, and each fraction adds some
    assert all(episodes("val", f) == episodes("val", 1.0) for f in (0.3, 0.6))
    assert not subsets[2] & episodes("val", 1.0)
    with pytest.raises(ConfigError, match="train_episode_fraction 0"):
        WindowDataset([train_capture], window=1, part="train", train_fraction=0.0)
