"""Evaluation tables with reference rows, the offline HTML report in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_preset

from gradleak.capture.run import CaptureJob, run_capture
from gradleak.cli import main
from gradleak.defenses import parse_defense
from gradleak.errors import CaptureFileError
from gradleak.evaluation.reconstructions import evaluate
from gradleak.evaluation.scoring import MEAN_COLOUR, MEAN_IMAGE, control_name
from gradleak.metrics.lpips import PIP_COMMAND, package_weights

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def evaluation(trained_attackers, random_capture: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eval")
    argv = ["evaluate", "--attacker", str(trained_attackers["trace"]), "--attacker",
            str(trained_attackers["lti"]), "--data",
            str(random_capture), "--baselines", "ig,dlg-probe", "--iters", "3",
            "--baseline-windows", "1", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    return out


@pytest.mark.slow
def test_every_method_and_both_reference_rows_are_scored(evaluation: Path) -> None:
    result = json.loads((evaluation / "metrics.json").read_text())
    methods = result["methods"]
    controls = {control_name("TRACE"), control_name("LtI")}  # each fed other steps' gradients
    assert set(methods) == {"TRACE", "LtI", "IG", "DLG (probe loss)", "action rule (odd-sign)",
                            MEAN_IMAGE, MEAN_COLOUR} | controls
    assert all(methods[c]["kind"] == "control" and methods[c]["frames"] == methods["TRACE"][
        "frames"] for c in controls)
    for name in ("IG", "DLG (probe loss)"):  # slow: only the first window's 4 frames
        assert methods[name]["kind"] == "optimisation" and methods[name]["frames"] == 4
        assert methods[name]["ms_per_frame"] > 0 and 0 <= methods[name]["action_accuracy"] <= 1
    assert methods["TRACE"]["frames"] == methods[MEAN_IMAGE]["frames"] > 4
    assert result["baselines"]["IG"]["iterations"] == 3
    assert result["baselines"]["DLG (probe loss)"]["matching"]["loss"] == "probe"
    assert methods[MEAN_IMAGE]["psnr_gain_over_mean_image"] == 0.0
    # IG saw the first window only: its gain is over the mean image on those same frames
    samples = np.load(evaluation / "samples.npz")
    names = list(samples["methods"])
    mean_frames = samples[f"method_{names.index(MEAN_IMAGE)}"][:1].astype(np.float64) / 255
    truth = samples["truth"][:1].astype(np.float64) / 255
    first_window = float(np.mean(10 * np.log10(1 / ((mean_frames - truth) ** 2).mean((2, 3, 4)))))
    ig = methods["IG"]
    assert ig["mean_image_psnr_same_frames"] == pytest.approx(first_window, abs=0.05)
    assert ig["mean_image_psnr_same_frames"] != pytest.approx(methods[MEAN_IMAGE]["psnr"],
                                                              abs=0.05)
    assert ig["psnr_gain_over_mean_image"] == pytest.approx(
        ig["psnr"] - ig["mean_image_psnr_same_frames"])
    assert "mean_image_psnr_same_frames" not in methods["TRACE"]
    for name in ("TRACE", "LtI"):
        row = methods[name]
        assert len(row["psnr_by_t"]) == result["window"] == 4
        assert row["ms_per_frame"] > 0 and row["parameters"] > 0 and "psnr_std" in row
    assert methods["action rule (odd-sign)"]["action_accuracy"] >= 0.9
    if package_weights() is None:
        assert "lpips" not in methods["TRACE"] and PIP_COMMAND in result["lpips"]
    else:  # a distance per method, references included, and the mean image is far from each frame
        assert result["lpips"] == "available"
        assert all(0 < methods[name]["lpips"] < 1 for name in ("TRACE", "LtI", MEAN_IMAGE))
    table = (evaluation / "metrics.md").read_text()
    assert "| TRACE |" in table and "mean colour (oracle)" in table and "t=4" in table
    assert table.index("| LtI |") < table.index("| IG |") < table.index("| action rule")
    for name in ("reconstructions.png", "psnr_by_t.png"):
        assert (evaluation / name).stat().st_size > 1000


@pytest.mark.slow
def test_a_shorter_window_attacker_sees_each_span_afresh(trained_attackers, train_capture,
                                                         random_capture: Path,
                                                         tmp_path: Path) -> None:
    from conftest import tiny_attack_settings

    from gradleak.training.fit import fit_attacker

    model, fit = tiny_attack_settings("trace")
    model.window, fit.rollout_steps, fit.stride, fit.epochs = 1, 0, 1, 1
    fit_attacker("trace", model, fit, [str(train_capture)], tmp_path / "t1", progress=False)
    result = evaluate([random_capture], {"TRACE (T=4)": str(trained_attackers["trace"]),
                                         "TRACE (T=1)": str(tmp_path / "t1")}, tmp_path / "e")
    assert result["window"] == 4
    assert len(result["methods"]["TRACE (T=1)"]["psnr_by_t"]) == 4
    # each one-step span is reconstructed as if alone: the same frames as one window per step,
    # and a change to step 3's gradient changes nothing at steps 0-2
    import torch

    from gradleak.evaluation.reconstructions import reconstruct_in_spans
    from gradleak.threat import ObservedWindows
    from gradleak.training.checkpoint import load_attacker
    from gradleak.training.data import WindowDataset

    model, _ = load_attacker(tmp_path / "t1")
    model.eval()
    window = WindowDataset([random_capture], window=4, stride=4, part="all")[0].gradients
    with torch.no_grad():
        spans, _ = reconstruct_in_spans(model, ObservedWindows(window[None]))
        alone = [model.reconstruct(ObservedWindows(window[None, t:t + 1])).images[0, 0]
                 for t in range(4)]
        changed = window.clone()
        changed[3] = changed[3] * 2 + 1
        moved, _ = reconstruct_in_spans(model, ObservedWindows(changed[None]))
    for t in range(4):
        assert np.array_equal(spans[0, t], alone[t])
    assert np.array_equal(moved[0, :3], spans[0, :3]) and not np.array_equal(moved[0, 3],
                                                                             spans[0, 3])


def test_an_attacker_is_not_run_against_another_victims_gradients(trained_attackers,
                                                                   tmp_path: Path) -> None:
    other = tmp_path / "other.h5"
    run_capture(CaptureJob(victim="cnn-small", random_init=True, split="heldout", steps=20,
                           out=other, preset=tiny_preset(), progress=False, seed=8))
    with pytest.raises(CaptureFileError, match="θ0 hash"):
        evaluate([other], {"TRACE": str(trained_attackers["trace"])}, tmp_path / "eval")
    assert not (tmp_path / "eval").exists()


def test_training_scenes_are_not_test_data(trained_attackers, train_capture: Path,
                                           tmp_path: Path) -> None:
    with pytest.raises(CaptureFileError, match="expected 'heldout'"):
        evaluate([train_capture], {"TRACE": str(trained_attackers["trace"])}, tmp_path / "e")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run "
                    "installs it)")
def test_report_renders_offline_with_every_table_and_image(evaluation: Path,
                                                           tmp_path: Path) -> None:
    assert main(["report", str(evaluation), "--quiet"]) == 0
    report = evaluation / "report.html"
    html = report.read_text()
    assert "http://" not in html and "https://" not in html  # nothing to fetch
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND",
               f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000",
               "--dump-dom", report.as_uri()]
    dom = subprocess.run(command, capture_output=True, text=True, timeout=120).stdout
    body = re.search(r"<body([^>]*)>", dom)
    assert body, dom[:500]
    attrs = dict(re.findall(r'data-([\w-]+)="(\d+)"', body.group(1)))
    assert attrs["tables"] == "2"
    assert int(attrs["images"]) >= 2 and attrs["images-loaded"] == attrs["images"]


def test_report_compares_evaluations_side_by_side(evaluation: Path, trained_attackers,
                                                  random_capture: Path, tmp_path: Path,
                                                  capsys) -> None:
    other = tmp_path / "defended"
    evaluate([random_capture], {"LtI": str(trained_attackers["lti"])}, other, max_windows=2,
             defense=parse_defense("quant:4"))
    out = tmp_path / "side-by-side"
    assert main(["report", str(evaluation), str(other), "--out", str(out), "--quiet"]) == 0
    page = (out / "report.html").read_text()
    assert page.count("<table>") == 1 and (out / "comparison.png").stat().st_size > 1000
    for label in (evaluation.name, "defended"):  # each run's rows, labelled
        assert f"<td>{label}</td>" in page
    # the head, then both runs' methods (each learned attacker with its control)
    assert "quant:4" in page and page.count("<tr>") == 1 + 9 + 5
    assert main(["report", str(evaluation), str(other), "--out", str(out), "--quiet"]) == 0
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "report.html").write_text("mine")
    capsys.readouterr()
    assert main(["report", str(evaluation), str(other), "--out", str(foreign)]) == 2
    assert "from something else than a comparison" in capsys.readouterr().err
    assert (foreign / "report.html").read_text() == "mine" and len(list(foreign.iterdir())) == 1
    assert main(["report", str(evaluation), str(other)]) == 2
    assert "--out DIR" in capsys.readouterr().err


def test_report_without_an_evaluation(tmp_path: Path, capsys) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "has no metrics.json" in capsys.readouterr().err


@pytest.mark.slow
def test_the_mean_image_reference_comes_from_the_data_not_the_attacker_order(
        trained_attackers, train_capture: Path, random_capture: Path, tmp_path: Path) -> None:
    """Both attackers sampled their own mean image from the training windows; the reference
    row is the exact mean of every training frame, the same in either order."""
    from gradleak.capture.reader import CaptureFile

    with CaptureFile(train_capture) as capture:
        frames = capture.private_column("images").astype(np.float64) / 255.0
    truth = frames.mean(axis=(0, 1, 2, 3))
    first, second = (evaluate([random_capture], dict(order), tmp_path / name, max_windows=2)
                     for name, order in (
                         ("a", [("TRACE", str(trained_attackers["trace"])),
                                ("LtI", str(trained_attackers["lti"]))]),
                         ("b", [("LtI", str(trained_attackers["lti"])),
                                ("TRACE", str(trained_attackers["trace"]))])))
    assert first["methods"]["mean training image"] == second["methods"]["mean training image"]
    assert first["mean_image_source"].startswith("every frame of the training captures (240")
    import torch

    from gradleak.evaluation.scoring import mean_frame

    mean, count = mean_frame([train_capture])
    assert count == len(frames) and abs(float(mean.mean()) - truth) < 1e-6
    assert torch.allclose(mean, torch.from_numpy(frames.mean(0)).permute(2, 0, 1).float())
