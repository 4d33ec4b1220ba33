"""README's results table is the one benchmarks/readme_results.py renders from the JSON."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "readme_results.py"


def _module():
    spec = importlib.util.spec_from_file_location("readme_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_and_the_results_page_show_exactly_what_the_results_json_holds() -> None:
    module = _module()
    for page, parts in module.blocks().items():
        text = page.read_text()
        for block, begin, end in parts:
            assert module.readme_block(text, begin, end) == block, (
                f"{page.name}'s block {begin!r} is stale: run python "
                "benchmarks/readme_results.py --write")


def test_every_results_json_has_a_row() -> None:
    module = _module()
    files = {path.name for path in module.RESULTS.glob("*.json")}
    assert files - set(module.ROWS) <= {"scene_survey.json"}  # a survey, not a result


def test_readme_is_a_page_a_newcomer_reads_in_five_minutes() -> None:
    """At most 150 lines, none over 300 characters, and at most 8 headline rows: the full
    results live in docs/results.md."""
    module = _module()
    lines = module.README.read_text().splitlines()
    assert len(lines) <= 150
    assert max(len(line) for line in lines) <= 300
    assert len(module.HEADLINE) <= 8


def test_a_row_shows_lpips_only_where_it_was_measured_and_says_so() -> None:
    module = _module()
    measured = {"LtI": {"psnr": 24.571, "ssim": 0.5191, "lpips": 0.6027},
                "mean training image": {"psnr": 21.3, "ssim": 0.46, "lpips": None}}
    assert module.quality(measured) == ("LtI 24.57 / 0.519 / 0.603, "
                                        "mean training image 21.30 / 0.460")
    assert module.measures(measured) == "PSNR / SSIM / LPIPS"
    unmeasured = {name: {**row, "lpips": None} for name, row in measured.items()}
    assert module.quality(unmeasured) == "LtI 24.57 / 0.519, mean training image 21.30 / 0.460"
    assert module.measures(unmeasured) == "PSNR / SSIM"
