"""The public API: `import gradleak` names it (dir, editors), and docs/api.md's example runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import gradleak
from gradleak.errors import ConfigError

API = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def test_the_public_names_are_listed_and_load() -> None:
    assert set(gradleak.__all__) <= set(dir(gradleak))
    for name in gradleak.__all__:
        assert getattr(gradleak, name) is not None
    assert callable(gradleak.audit)  # a function, not a module of the same name


def test_the_documented_audit_example_runs(random_capture: Path, tmp_path: Path, capsys) -> None:
    code = re.search(r"## Audit a capture\n\n```python\n(.*?)```", API.read_text(),
                     re.S).group(1)
    code = code.replace("runs/mine/heldout.h5", str(random_capture)).replace(
        "runs/mine/audit", str(tmp_path / "audit"))
    exec(compile(code, str(API), "exec"), {})  # noqa: S102 (our own documentation)
    printed = capsys.readouterr().out
    verdict = gradleak.audit(random_capture, out=tmp_path / "audit",
                             defenses=["quant:8", "prune:0.1"], budget_minutes=10)  # resumed
    assert verdict.headline[0] in printed and str(verdict.report) in printed
    assert verdict.report.is_file() and verdict.results.is_file()
    assert verdict.frames_psnr == verdict.details["frames"]["psnr"]
    assert [o["spec"] for o in verdict.details["defenses"]] == ["quant:8", "prune:0.1"]


def test_an_unknown_setting_is_named_before_any_work(random_capture: Path, tmp_path: Path
                                                     ) -> None:
    with pytest.raises(ConfigError, match="unknown setting.*max_window"):
        gradleak.audit(random_capture, out=tmp_path / "a", max_window=4)
    assert not (tmp_path / "a").exists()
