"""Defended copies of captures, and zero-shot evaluation under a defense."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from gradleak.capture.reader import CaptureFile
from gradleak.cli import main
from gradleak.defenses import parse_defense
from gradleak.defenses.base import row_keys
from gradleak.defenses.files import defend_capture
from gradleak.errors import CaptureFileError, ConfigError
from gradleak.evaluation.reconstructions import evaluate


def test_a_defended_copy_changes_only_the_gradients(random_capture: Path, tmp_path: Path,
                                                    capsys) -> None:
    out = tmp_path / "defended.h5"
    assert main(["defend", str(random_capture), "--defense", "prune:0.2+noise:0.001",
                 "--defense-seed", "7", "--out", str(out), "--quiet"]) == 0
    chain = parse_defense("prune:0.2+noise:0.001", seed=7)
    with CaptureFile(random_capture) as clean, CaptureFile(out) as defended:
        keys = row_keys(clean.attrs, 0, len(clean))
        expected = chain.gradients(clean.observation(with_theta0=False).gradients, keys)
        got = defended.observation(with_theta0=False).gradients
        np.testing.assert_allclose(got, expected.astype(np.float16), rtol=0, atol=0)
        np.testing.assert_array_equal(defended.target().images, clean.target().images)
        assert defended.attrs["theta0_sha256"] == clean.attrs["theta0_sha256"]
        assert defended.summary()["defenses"] == ["prune:0.2+noise:0.001"]
    again = tmp_path / "twice.h5"
    result = defend_capture(out, parse_defense("quant:8"), again)
    assert [d["spec"] for d in result["defenses"]] == ["prune:0.2+noise:0.001", "quant:8"]


def test_defend_refuses_what_it_cannot_do_and_leaves_nothing(random_capture: Path,
                                                             tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="aggregates steps"):
        defend_capture(random_capture, parse_defense("agg:4"), tmp_path / "a.h5")
    with pytest.raises(ConfigError, match="is the input file"):
        defend_capture(random_capture, parse_defense("quant:8"), random_capture)
    (tmp_path / "exists.h5").write_bytes(b"")
    with pytest.raises(CaptureFileError, match="already exists"):
        defend_capture(random_capture, parse_defense("quant:8"), tmp_path / "exists.h5")
    with pytest.raises(CaptureFileError, match="beyond float16's range"):
        defend_capture(random_capture, parse_defense("noise:1e6"), tmp_path / "big.h5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists.h5"]


def test_zero_shot_evaluation_sees_the_defended_gradients(trained_attackers, random_capture: Path,
                                                          tmp_path: Path) -> None:
    attackers = {"TRACE": str(trained_attackers["trace"])}
    clean = evaluate([random_capture], attackers, tmp_path / "clean")
    noisy = evaluate([random_capture], attackers, tmp_path / "noisy",
                     defense=parse_defense("quant:1"))
    assert noisy["defense"]["spec"] == "quant:1" and clean["defense"] is None
    assert 0 < noisy["utility"]["cosine"] < 1 and noisy["utility"]["relative_norm_error"] > 0
    assert noisy["methods"]["TRACE"]["psnr"] != clean["methods"]["TRACE"]["psnr"]
    # the scaled sign keeps every sign, so the odd-sign action rule is untouched
    assert (noisy["methods"]["action rule (odd-sign)"]["action_accuracy"]
            == clean["methods"]["action rule (odd-sign)"]["action_accuracy"])
    table = (tmp_path / "noisy" / "metrics.md").read_text()
    assert "Defense: `quant:1`" in table and "| TRACE [zero-shot] |" in table
    saved = json.loads((tmp_path / "noisy" / "metrics.json").read_text())
    assert saved["defense"]["transforms"][0] == {"name": "quant", "bits": 1}
    with pytest.raises(ConfigError, match="aggregates steps"):
        evaluate([random_capture], attackers, tmp_path / "agg", defense=parse_defense("agg:2"))


def test_the_defended_file_is_a_valid_capture(random_capture: Path, tmp_path: Path) -> None:
    out = tmp_path / "d.h5"
    defend_capture(random_capture, parse_defense("dpsgd:eps=10"), out)
    with CaptureFile(out) as capture:
        assert capture.validate()["finite"]
    with h5py.File(out) as handle:
        chain = json.loads(handle.attrs["defenses"])[0]["transforms"][0]
        assert chain["sigma"] > 0 and chain["achieved_eps"] <= 10.01


def test_an_adaptive_attacker_is_trained_under_the_defense_and_reported_so(
        train_capture: Path, random_capture: Path, tmp_path: Path) -> None:
    from conftest import tiny_attack_settings

    from gradleak.training.data import WindowDataset
    from gradleak.training.fit import fit_attacker

    model, fit = tiny_attack_settings("lti")
    fit.epochs, fit.defense = 1, "quant:2"
    fit_attacker("lti", model, fit, [str(train_capture)], tmp_path / "adaptive", progress=False)
    # the training windows really were defended: 2-bit rows take at most 4 distinct values
    dataset = WindowDataset([train_capture], window=1, stride=1, part="train",
                            defense=parse_defense("quant:2", 1))
    assert len(np.unique(dataset[0]["gradients"].numpy())) <= 4
    result = evaluate([random_capture], {"LtI (adaptive)": str(tmp_path / "adaptive")},
                      tmp_path / "e", defense=parse_defense("quant:2"))
    assert result["methods"]["LtI (adaptive)"]["defense_mode"] == "adaptive"
    other = evaluate([random_capture], {"LtI": str(tmp_path / "adaptive")}, tmp_path / "f",
                     defense=parse_defense("quant:4"))
    assert other["methods"]["LtI"]["defense_mode"] == "zero-shot"


def test_training_and_held_out_files_never_share_noise(train_capture: Path,
                                                       random_capture: Path) -> None:
    with CaptureFile(train_capture) as train, CaptureFile(random_capture) as heldout:
        assert not set(row_keys(train.attrs, 0, 50).tolist()) & set(
            row_keys(heldout.attrs, 0, 50).tolist())
