"""`evaluate` and `report`: no score from a diverged attacker or from NaN gradients, a broken
metrics file named, and nothing from a file reaching the HTML report unescaped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gradleak.cli import main

from .conftest import copy_capture, poison_rows

EVAL = ["--max-windows", "4"]


def test_an_attacker_with_nan_weights_is_refused(refused, tmp_path: Path,
                                                 trained_attackers: dict[str, Path],
                                                 random_capture: Path) -> None:
    attacker = tmp_path / "att"
    shutil.copytree(trained_attackers["lti"], attacker)
    for name in ("attacker.safetensors", "best.safetensors"):
        if (attacker / name).exists():
            state = load_file(str(attacker / name))
            first = sorted(state)[0]
            state[first] = torch.full_like(state[first], float("nan"))
            save_file(state, str(attacker / name))
    refused(["evaluate", "--attacker", str(attacker), "--data", str(random_capture), "--out",
             str(tmp_path / "eval"), *EVAL], "holds NaN/Inf", "diverged")


@pytest.mark.slow
def test_a_nan_row_is_refused_or_skipped_when_asked(capsys, refused, tmp_path: Path,
                                                    trained_attackers: dict[str, Path],
                                                    random_capture: Path) -> None:
    data = poison_rows(copy_capture(random_capture, tmp_path / "in", "heldout.h5"), [9])
    argv = ["evaluate", "--attacker", str(trained_attackers["lti"]), "--data", str(data),
            *EVAL]
    refused([*argv, "--out", str(tmp_path / "eval")], str(data), "1 row(s): 9")
    assert main([*argv, "--out", str(tmp_path / "eval"), "--skip-nonfinite", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["skipped_nonfinite_rows"] == 1
    clean = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert clean["methods"]["action rule (odd-sign)"]["action_accuracy"] == 1.0


def test_a_missing_prior_for_the_exact_baseline_is_named_before_any_work(
        refused, tmp_path: Path, trained_attackers: dict[str, Path],
        random_capture: Path) -> None:
    refused(["evaluate", "--attacker", str(trained_attackers["lti"]), "--data",
             str(random_capture), "--out", str(tmp_path / "eval"), "--baselines", "training-free",
             "--prior", str(tmp_path / "no-prior"), *EVAL], "no-prior", "gradleak train-prior")


def test_a_directory_given_as_data_is_called_a_directory(refused, tmp_path: Path,
                                                         trained_attackers) -> None:
    (tmp_path / "heldout.h5").mkdir()
    refused(["evaluate", "--attacker", str(trained_attackers["lti"]), "--data",
             str(tmp_path / "heldout.h5"), "--out", str(tmp_path / "eval"), *EVAL],
            "is a directory")


@pytest.mark.parametrize("text, fragment", [
    ('{"methods": {', "not readable JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"methods": []}', "field 'methods'"),
    ('{"methods": {"x": {"kind": "learned", "psnr": "high"}}}', "methods['x'].psnr"),
    ('{"methods": {"x": {"kind": "magic"}}}', "'kind' of"),
    ('{"methods": {"x": {"kind": "learned", "psnr": 20}}}', "no psnr_std"),
])
def test_report_on_a_broken_metrics_file_names_it(refused, tmp_path: Path, text: str,
                                                  fragment: str) -> None:
    run = tmp_path / "eval"
    run.mkdir()
    (run / "metrics.json").write_text(text)
    refused(["report", str(run)], "metrics.json", fragment)


def test_the_report_escapes_everything_that_comes_from_a_file(tmp_path: Path) -> None:
    run = tmp_path / "eval"
    run.mkdir()
    hostile = "<script>alert(1)</script>"
    methods = {hostile: {"kind": "learned", "psnr": 20.0, "psnr_std": 1.0, "psnr_by_t": [20.0],
                         "order": 0},
               "mean training image": {"kind": "reference", "psnr": 19.0, "psnr_std": 1.0,
                                       "order": 1}}
    (run / "metrics.json").write_text(json.dumps({
        "windows": hostile, "window": "<img src=x onerror=alert(2)>", "data": [hostile],
        "lpips": hostile, "methods": methods}))
    assert main(["report", str(run), "--quiet"]) == 0
    page = (run / "report.html").read_text()
    assert "<script>alert" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
