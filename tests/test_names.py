"""One name per thing (gradleak.names): the old spellings a user's scripts and saved files hold
still read as the things they named, and what gradleak writes uses only the new names."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gradleak.cli import build_parser
from gradleak.cli.evaluate import baseline_configs
from gradleak.names import (
    DISPLAY_ALIASES,
    SECTION_ALIASES,
    SOLVE_FIELDS,
    display,
    section_path,
)
from gradleak.presets import load_preset, preset_from_dict


def test_old_section_names_set_the_renamed_sections() -> None:
    old = load_preset("cpu-quick", ["attack.exact.iterations=7", "attack.refiner.width=4",
                                    "attack.refiner_fit.max_frames=24"])
    new = load_preset("cpu-quick", ["attack.training_free.solve.iterations=7",
                                    "attack.prior.width=4", "attack.prior_fit.max_frames=24"])
    assert old == new and new.attack.training_free.solve.iterations == 7
    assert new != load_preset("cpu-quick")  # the overrides did set something
    assert section_path("attack.exactly.x") == "attack.exactly.x"  # a prefix, not a section


def test_a_config_saved_with_the_old_section_names_reads_back_the_same() -> None:
    preset = load_preset("cpu-quick", ["attack.training_free.solve.iterations=7",
                                       "attack.prior.width=4"])
    saved = json.loads(json.dumps(preset.to_dict()))
    for old, new in SECTION_ALIASES.items():
        saved["attack"][old.removeprefix("attack.")] = saved["attack"].pop(
            new.removeprefix("attack."))
    saved["attack"]["exact"].update(saved["attack"]["exact"].pop("solve"))  # one level up
    assert preset_from_dict(saved) == preset_from_dict(preset.to_dict())
    assert preset_from_dict(saved).attack.training_free.solve.iterations == 7


def test_the_moved_solve_settings_are_the_frame_solves_own() -> None:
    from gradleak.inversion.frame_solve import FrameSolve

    assert set(SOLVE_FIELDS) == {f.name for f in dataclasses.fields(FrameSolve)}
    preset = load_preset("cpu-quick", ["attack.training_free.solve.rounds=0"])
    assert preset.attack.training_free.solve.rounds == 0  # a frozen section, set by a copy
    assert load_preset("cpu-quick").attack.training_free.solve.rounds > 0


def test_new_names_only_in_what_is_written() -> None:
    sections = set(load_preset("cpu-quick").to_dict()["attack"])
    assert not sections & {old.removeprefix("attack.") for old in SECTION_ALIASES}
    from gradleak.attacks.defense_aware import NAME as AWARE
    from gradleak.attacks.exact import NAME, WITH_PRIOR
    from gradleak.attacks.frame_refiner import FrameRefiner
    from gradleak.experiments.table1 import LEARNED

    written = {NAME, WITH_PRIOR, AWARE, FrameRefiner.name, *LEARNED.values()}
    assert not written & set(DISPLAY_ALIASES)
    assert set(DISPLAY_ALIASES.values()) <= written | {"feature decoder"}
    assert display("exact (training-free)") == NAME and display("IG") == "IG"


def test_old_command_and_method_names_reach_the_same_code() -> None:
    parser = build_parser()
    old = parser.parse_args(["analytic", "x.h5", "--conv", "2"])
    new = parser.parse_args(["closed-form", "x.h5", "--conv", "2"])
    assert old.func is new.func and old.conv == new.conv == 2
    assert "closed-form (analytic)" in parser.format_help()
    audit = ["audit", "--capture", "x.h5", "--out", "o"]
    assert parser.parse_args([*audit, "--exact-windows", "3"]).training_free_windows == 3
    evaluate = parser.parse_args(["evaluate", "--attacker", "a", "--data", "x.h5", "--out", "o",
                                  "--baselines", "exact,ig"])
    assert list(baseline_configs(evaluate)) == ["training-free", "IG"]


@pytest.mark.parametrize("command", [["attack", "--help"], ["evaluate", "--help"]])
def test_help_offers_the_new_method_name(command: list[str],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(command)
    assert "training-free" in capsys.readouterr().out
