"""The command line: JSON contracts, one-line errors with exit status 2, the demo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import SHORT_AUDIT, TINY, as_flags

from gradleak.cli import main


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> object:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_recover_actions_prints_accuracy_n_and_breakdown(capsys, random_capture: Path) -> None:
    data = run_json(capsys, "recover-actions", str(random_capture), "--rule", "odd-sign")
    assert set(data) >= {"accuracy", "n", "by_confidence"}
    assert data["n"] == 50 and 0.9 <= data["accuracy"] <= 1.0
    assert sum(row["n"] for row in data["by_confidence"] if row["by"] == "max_pi") == 50


def test_info_summarises_and_validates(capsys, random_capture: Path) -> None:
    data = run_json(capsys, "info", str(random_capture))
    assert data["rows"] == 50 and data["victim"] == "cnn-small" and data["split"] == "heldout"
    assert data["validation"]["finite"] is True


@pytest.mark.slow
def test_scenes_split_is_fixed_and_disjoint(capsys) -> None:
    data = run_json(capsys, "scenes")
    train = {row["map"] for row in data["maps"] if row["split"] == "train"}
    heldout = {row["map"] for row in data["maps"] if row["split"] == "heldout"}
    assert heldout == {"MAP05", "MAP11", "MAP17", "MAP23", "MAP29"} and not train & heldout
    assert {"MAP02", "MAP30"} == set(data["excluded"]) and not {"MAP02", "MAP30"} & train
    assert data["train_scenes"] > 100 and data["heldout_scenes"] > 40


@pytest.mark.parametrize("argv, message", [
    (["train-victim", "--out", "x", "--preset", "gpu-huge"], "unknown preset 'gpu-huge'"),
    (["capture", "--victim", "vit", "--random-init", "--scenes", "train", "--steps", "5",
      "--out", "x.h5"], "needs a victim name"),
    (["info", "missing.h5"], "capture file missing.h5 does not exist"),
    (["recover-actions", "missing.h5", "--rule", "psychic"], "unknown action rule 'psychic'"),
    (["capture", "--victim", "runs/none", "--scenes", "train", "--steps", "5", "--out",
      "x.h5"], "victim config runs/none/victim.json does not exist"),
    (["train-victim", "--out", "x", "--wad", "nowhere.wad"], "--wad nowhere.wad: no such file"),
    (["train-victim", "--out", "x", "--set", "train.updates=many"], "train.updates='many'"),
    (["capture", "--victim", "cnn-small", "--random-init", "--scenes", "train", "--steps", "5",
      "--out", "x.h5", "--shard", "3/2"], "--shard '3/2'"),
    (["capture", "--victim", "cnn-small", "--random-init", "--scenes", "train", "--steps", "5",
      "--out", "x.h5", "--set", "capture.gradient_dtype=float64"],
     "capture.gradient_dtype='float64'"),
    (["attack", "fgsm", "--data", "x.h5", "--index", "0", "--out", "o"],
     "attack 'fgsm': expected one of"),
    (["evaluate", "--attacker", "a", "--data", "x.h5", "--out", "o", "--baselines", "ig,gan"],
     "--baselines 'gan'"),
    (["evaluate", "--attacker", "a", "--data", "x.h5", "--out", "o", "--baselines", "lti"],
     "LtI is a learned attacker: pass its directory with --attacker"),
])
def test_errors_are_one_line_with_status_2(capsys, tmp_path: Path, monkeypatch, argv,
                                           message: str) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gradleak: error: ") and message in err and "\n" not in err
    assert not list(tmp_path.iterdir())  # nothing half-written


@pytest.mark.slow
def test_demo_runs_end_to_end_and_reports_heldout_recovery(capsys, tmp_path: Path) -> None:
    out = tmp_path / "demo"
    data = run_json(capsys, "demo", "--out", str(out), *TINY, "--set",
                    "capture.steps_train=40", "--set", "capture.steps_heldout=40",
                    *as_flags(SHORT_AUDIT))
    recovery = data["action_recovery_heldout"]
    assert recovery["odd-sign"]["n"] == 40 and recovery["odd-sign"]["accuracy"] >= 0.9
    assert recovery["sign-aware"]["oracle_advantage_sign"] is True
    methods = data["evaluation"]["methods"]
    assert {"TRACE", "LtI", "mean training image", "mean colour (oracle)"} <= set(methods)
    exact = methods["training-free"]  # the demo leads with the attack needing no training
    assert exact["kind"] == "training-free" and exact["action_accuracy"] == 1.0
    assert exact["psnr"] > methods["mean training image"]["psnr"]
    assert data["verdict"]["actions"]["accuracy"] >= 0.9 and data["verdict"]["headline"]
    # the training-free frames came before any attacker training, and the audit after it
    assert data["exact"]["methods"]["training-free"]["frames"] > 0
    assert data["exact_seconds_into_demo"] < data["seconds"]
    for name in ("config.json", "results.json", "train.h5", "heldout.h5", "train.h5.json",
                 "heldout_actions.png", "audit/report.html", "audit/results.json",
                 "exact/metrics.md", "audit/eval/none/reconstructions.png",
                 "trace/attacker.safetensors", "lti/attacker.safetensors",
                 "victim-ppo/victim.safetensors", "victim-ppo/learning_curve.png"):
        assert (out / name).exists(), name


def test_attack_inverts_single_steps_and_draws_the_history(capsys, tmp_path: Path,
                                                           random_capture: Path) -> None:
    data = run_json(capsys, "attack", "ig", "--data", str(random_capture), "--index", "7",
                    "--index", "2", "--iters", "4", "--restarts", "2", "--out",
                    str(tmp_path / "ig"))
    assert [step["index"] for step in data["steps"]] == [2, 7]
    assert data["config"]["restarts"] == 2 and data["iterations"] == [4]
    # the optimisation did something: each step's chosen run lowered its matching loss after
    # its first step (which also projects the random start into the box); measured when
    # written: 0.207 → 0.200 and 0.148 → 0.142, and with attack.ig.lr=1e-12 no change at all.
    # The action IG reads off the gradient (the odd-sign rule's) is the taken one.
    assert all(step["matching_loss"] < step["matching_loss_after_first_step"] - 1e-4
               for step in data["steps"])
    assert all(step["action"] == step["true_action"] for step in data["steps"])
    assert (tmp_path / "ig" / "history.png").is_file()
    saved = json.loads((tmp_path / "ig" / "attack.json").read_text())
    assert saved["config"]["matching"]["loss"] == "victim"


def test_attack_rejects_a_row_outside_the_capture(capsys, tmp_path: Path,
                                                  random_capture: Path) -> None:
    assert main(["attack", "dlg", "--data", str(random_capture), "--index", "50", "--out",
                 str(tmp_path / "o")]) == 2
    assert "--index 50" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_analytic_reports_exact_recovery_and_feature_inversion(capsys,
                                                              random_capture: Path) -> None:
    data = run_json(capsys, "closed-form", str(random_capture), "--invert", "2")
    result = data[str(random_capture)]
    assert result["rows"] == 50 and result["action_accuracy"] == 1.0
    assert result["layer_inputs"]["fc"]["median_relative_error"] <= 1e-3
    assert result["feature_inversion"]["frames"] == 2
    # better than where the optimisation starts (a flat grey frame), scored independently here
    import numpy as np

    from gradleak.capture.reader import CaptureFile
    from gradleak.metrics.images import psnr, to_unit_tensor

    with CaptureFile(random_capture) as capture:
        frames = to_unit_tensor(capture.private_column("images")[np.linspace(0, 49, 2).astype(int)])
    grey = float(psnr(torch.full_like(frames, 0.5), frames).mean())
    assert result["feature_inversion"]["psnr"] > grey + 8.0  # 20.8 vs 9.0 dB when written


@pytest.mark.slow
def test_train_decoder_then_evaluate_recovers_every_action(capsys, tmp_path: Path,
                                                           train_capture: Path,
                                                           random_capture: Path) -> None:
    trained = run_json(capsys, "train-decoder", "--preset", "cpu-quick", *TINY, "--data",
                       str(train_capture), "--out", str(tmp_path / "dec"), "--epochs", "1",
                       "--extra-frames", "32", "--set", "attack.decoder.channels=16",
                       "--set", "attack.decoder_fit.max_val_frames=16")
    assert trained["train_frames"] == {"captured": trained["train_frames"]["captured"],
                                       "rendered": 32} and trained["epochs"] == 1
    result = run_json(capsys, "evaluate", "--attacker", str(tmp_path / "dec"), "--data",
                      str(random_capture), "--out", str(tmp_path / "eval"), "--max-windows",
                      "4")
    row = result["methods"]["feature decoder"]
    assert row["action_accuracy"] == 1.0 and row["frames"] == 32


@pytest.mark.slow
def test_analytic_recovers_the_conv_inputs_and_frames_beneath(capsys,
                                                              random_capture: Path) -> None:
    assert main(["closed-form", str(random_capture), "--conv", "6", "--json"]) == 0
    printed = capsys.readouterr()
    data = json.loads(printed.out)
    # every stage says when it starts, on stderr beside the JSON: the solves take minutes
    assert "the closed form on" in printed.err and "conv stack on 6 steps" in printed.err
    solves = printed.err.count("frames of 6 steps, solve ")
    assert solves >= 5 and f"solve {solves} of {solves}: from true map" in printed.err
    conv = data[str(random_capture)]["conv_stack"]
    assert list(conv["layers"]) == ["encoder.9", "encoder.6", "encoder.3"]
    for layer in conv["layers"].values():  # float32, as the client sent it
        assert layer["median_relative_error"] <= 1e-4
    assert conv["frames_from"] == "encoder.3"
    assert conv["psnr"] >= conv["psnr_of_their_mean_image"] + 3.0


@pytest.mark.parametrize("command, flags, assignments", [
    (["train-attacker", "--kind", "lti", "--data", "c.h5", "--out", "o"],
     ["--epochs", "3", "--lpips-weights", "w.pth"],
     ["attack.lti_fit.epochs=3", "attack.lti_fit.lpips_weights=w.pth"]),
    (["train-decoder", "--data", "c.h5", "--out", "o"], ["--minutes", "2.5", "--extra-frames", "0"],
     ["attack.decoder_fit.time_limit_minutes=2.5", "attack.decoder_fit.extra_frames=0"]),
    (["attack", "ig", "--data", "c.h5", "--index", "0", "--out", "o"], ["--iters", "7"],
     ["attack.ig.iterations=7", "attack.dlg.iterations=7"]),
    (["train-victim", "--out", "o"], ["--algo", "a2c", "--updates", "4"],
     ["train.algo=a2c", "train.updates=4"]),
])
def test_a_shorthand_flag_is_the_set_assignment_it_names(command: list[str], flags: list[str],
                                                         assignments: list[str]) -> None:
    """One way to override a preset: each convenience flag goes through --set's typed path,
    so the preset it gives equals the --set one, field types included, and differs from the
    plain preset."""
    from gradleak.cli import build_parser
    from gradleak.cli.common import preset_from_args
    from gradleak.presets import load_preset

    parser = build_parser()
    via_flags = preset_from_args(parser.parse_args([*command, *flags]))
    via_set = preset_from_args(parser.parse_args(
        [*command, *[word for a in assignments for word in ("--set", a)]]))
    assert via_flags.to_dict() == via_set.to_dict()
    assert via_flags.to_dict() != load_preset("cpu-quick").to_dict()
    if command[0] == "attack":
        assert via_flags.attack.ig.iterations == via_flags.attack.dlg.iterations == 7


def test_attack_exact_recovers_chosen_steps_without_training(capsys, tmp_path: Path,
                                                             random_capture: Path) -> None:
    """`attack exact` on a float32 capture: the taken actions, the true A and R, and frames
    within 1e-2 of the truth, with the first conv's equations fitted (rows 2 and 7)."""
    data = run_json(capsys, "attack", "training-free", "--data", str(random_capture), "--index",
                    "7", "--index", "2", "--out", str(tmp_path / "exact"))
    assert [step["index"] for step in data["steps"]] == [2, 7]
    for step in data["steps"]:
        assert step["action"] == step["true_action"]
        assert abs(step["advantage"] - step["true_advantage"]) < 1e-4
        assert abs(step["return"] - step["true_return"]) < 1e-4
        assert step["psnr"] >= 25.0 and step["residual_weight_gradient"] < 1e-2
    assert (tmp_path / "exact" / "reconstructions.png").is_file()
    assert json.loads((tmp_path / "exact" / "attack.json").read_text())["method"] == "training-free"


@pytest.mark.slow
def test_evaluate_scores_the_training_free_attack_beside_the_learned_ones(
        capsys, tmp_path: Path, trained_attackers, random_capture: Path) -> None:
    result = run_json(capsys, "evaluate", "--attacker", str(trained_attackers["lti"]),
                      "--data", str(random_capture), "--out", str(tmp_path / "eval"),
                      "--baselines", "training-free", "--baseline-windows", "2")
    rows = result["methods"]
    exact = rows["training-free"]
    assert exact["kind"] == "training-free" and exact["frames"] == 2 * result["window"]
    assert exact["action_accuracy"] == 1.0
    assert exact["psnr"] >= rows["mean training image"]["psnr"] + 5.0
    assert exact["psnr"] >= rows["LtI"]["psnr"] + 5.0


def test_attack_exact_checks_its_settings_before_reading_or_writing(capsys, tmp_path: Path,
                                                                    random_capture: Path) -> None:
    assert main(["attack", "training-free", "--data", str(random_capture), "--index", "0", "--out",
                 str(tmp_path / "exact"), "--set", "attack.training_free.solve.iterations=0"]) == 2
    assert "attack.training_free.solve.iterations=0" in capsys.readouterr().err
    assert not (tmp_path / "exact").exists()


def test_experiment_help_lists_every_registered_experiment_and_preset(capsys) -> None:
    from gradleak.cli.experiment import NAMES
    from gradleak.experiments import EXPERIMENTS

    own = [name for name in EXPERIMENTS.names()  # not those a test's plugin registered
           if EXPERIMENTS.get(name).__module__.startswith("gradleak.")]
    assert sorted(NAMES) == sorted(own)
    with pytest.raises(SystemExit):
        main(["experiment", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in NAMES)
    from gradleak.presets import PRESETS

    assert all(name in text for name in PRESETS)  # --preset's choices, named too
