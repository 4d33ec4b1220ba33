"""`gradleak defend`: a defense spec means one thing, and a defended copy is always readable."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import pytest

from gradleak.cli import main

from .conftest import copy_capture, poison_rows


@pytest.mark.parametrize("spec, fragment", [
    ("prune:0.1,0.2", "'keep' is given twice"),
    ("noise:inf", "not a finite number"),
    ("noise:nan", "not a finite number"),
    ("dpsgd:eps=inf", "not a finite number"),
    ("", "defense ''"),
    ("none", "applies nothing"),
    ("quant:8+", "an empty step"),
    ("agg:4", "aggregates steps"),
])
def test_ambiguous_or_empty_specs_are_refused(refused, tmp_path: Path, random_capture: Path,
                                              spec: str, fragment: str) -> None:
    refused(["defend", str(random_capture), "--out", str(tmp_path / "d.h5"), "--defense", spec],
            fragment, watch=(random_capture.parent,))


def test_the_output_location_is_checked_first(refused, tmp_path: Path,
                                              random_capture: Path) -> None:
    (tmp_path / "d.h5").mkdir()
    refused(["defend", str(random_capture), "--out", str(tmp_path / "d.h5"), "--defense",
             "quant:8"], "is a directory")
    (tmp_path / "file").write_text("mine")
    refused(["defend", str(random_capture), "--out", str(tmp_path / "file" / "d.h5"),
             "--defense", "quant:8"], "is a file, not a directory")


def test_nan_rows_are_refused_or_their_episodes_left_out(capsys, refused, tmp_path: Path,
                                                         random_capture: Path) -> None:
    data = poison_rows(copy_capture(random_capture, tmp_path / "in"), [2])
    out = tmp_path / "d.h5"
    refused(["defend", str(data), "--out", str(out), "--defense", "quant:8"], "1 row(s): 2")
    assert main(["defend", str(data), "--out", str(out), "--defense", "quant:8",
                 "--skip-nonfinite", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    with h5py.File(data, "r") as source:
        episode = source["episode_ids"][2]
        expected = int((source["episode_ids"][:] != episode).sum())
    assert result["skipped_nonfinite_rows"] == 1 and result["rows"] == expected
    assert main(["info", str(out), "--quiet"]) == 0  # a valid capture, fully validated
