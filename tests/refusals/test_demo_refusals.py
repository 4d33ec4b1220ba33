"""`gradleak demo` deletes only what a demo made, and checks its arguments first."""

from __future__ import annotations

import json
from pathlib import Path

from gradleak.demo import DEMO_ENTRIES, MARKER, prepare_output


def test_a_bad_preset_leaves_the_working_directory_alone(refused, monkeypatch,
                                                         tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("my notes")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "run.h5").write_bytes(b"precious")
    monkeypatch.chdir(tmp_path)
    refused(["demo", "--out", ".", "--preset", "nope"], "unknown preset 'nope'")
    refused(["demo", "--out", ".", "--set", "train.updates=0"], "train.updates=0")


def test_a_non_empty_directory_that_is_not_a_demo_is_refused(refused, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "thesis.tex").write_text("chapter 1")
    refused(["demo", "--out", str(tmp_path / "out")], "is not empty", MARKER)
    (tmp_path / "file").write_text("mine")
    refused(["demo", "--out", str(tmp_path / "file")], "is a file")


def test_a_previous_demo_loses_only_its_own_entries(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    prepare_output(out)  # a fresh demo directory
    (out / "eval").mkdir()
    (out / "eval" / "report.html").write_text("old report")
    (out / "train.h5").write_bytes(b"old capture")
    (out / "my-notes.txt").write_text("keep me")
    prepare_output(out)
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "my-notes.txt"]
    assert json.loads((out / MARKER).read_text())["entries"] == list(DEMO_ENTRIES)


def test_a_tampered_marker_deletes_nothing(refused, tmp_path: Path) -> None:
    out = tmp_path / "demo"
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"entries": ["../../home"]}))
    (out / "train.h5").write_bytes(b"capture")
    refused(["demo", "--out", str(out)], "field 'entries'")
