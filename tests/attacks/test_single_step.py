"""The single-step attacks' registry: one decorator registers an attack everywhere a user picks
one, its settings name it, and what it needs of the threat model is refused before any work."""

from __future__ import annotations

from collections.abc import Iterator
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gradleak.attacks.catalogue import attack_for, build, choices, run
from gradleak.attacks.single_step import SINGLE_STEP, Context, single_step
from gradleak.capture.reader import CaptureFile
from gradleak.cli import build_parser
from gradleak.cli.evaluate import baseline_configs
from gradleak.errors import ConfigError
from gradleak.evaluation.reconstructions import evaluate
from gradleak.evaluation.single_steps import attack_steps
from gradleak.presets import AttackConfig


API = Path(__file__).resolve().parents[2] / "docs" / "api.md"


@pytest.fixture
def grey() -> Iterator[dict[str, Any]]:
    """docs/api.md's example of a user's own attack, registered as a plugin would be."""
    code = re.search(r"## Your own single-step attack\n.*?```python\n(.*?)```",
                     API.read_text(), re.S).group(1)
    namespace: dict[str, Any] = {}
    exec(compile(code, str(API), "exec"), namespace)  # noqa: S102 (our own documentation)
    yield namespace
    SINGLE_STEP.drop("grey")


def test_every_choice_s_settings_name_the_attack_that_offers_them() -> None:
    offered = choices(AttackConfig())
    assert {"training-free", "defense-aware", "dlg", "ig", "dlg-probe", "ig-probe"} <= \
        set(offered)
    for name, (attack, settings) in offered.items():
        assert attack_for(settings) is attack, name
    kinds = {name: attack.kind for name, (attack, _) in offered.items()}
    assert kinds["training-free"] == kinds["defense-aware"] == "training-free"
    assert kinds["ig"] == kinds["dlg-probe"] == "optimisation"


@pytest.mark.slow
def test_one_decorator_puts_a_user_s_attack_in_every_command(
        grey: dict[str, Any], random_capture: Path, tmp_path: Path) -> None:
    assert "grey" in choices(AttackConfig())
    args = build_parser().parse_args(["evaluate", "--attacker", "a", "--data", "x.h5",
                                      "--out", "o", "--baselines", "grey,ig"])
    assert list(baseline_configs(args)) == ["grey 128", "IG"]
    result = evaluate([random_capture], {}, tmp_path / "e", max_windows=1,
                      baselines={"grey 128": grey["GreyConfig"]()}, baseline_windows=1,
                      reference_data=[random_capture])
    row = result["methods"]["grey 128"]
    assert row["kind"] == "training-free" and row["frames"] > 0
    steps = attack_steps(random_capture, [0, 3], "grey", grey["GreyConfig"](), tmp_path / "a")
    assert [step["advantage"] for step in steps["steps"]] == [None, None]  # it reads none
    assert Path(steps["picture"]).is_file()


def test_what_an_attack_needs_is_refused_before_it_is_built(
        grey: dict[str, Any], random_capture: Path) -> None:
    with CaptureFile(random_capture) as capture:
        observation = capture.observation(np.arange(2))
    built = []
    single_step("counted", type("CountedConfig", (grey["GreyConfig"],), {}),
                kind="training-free",
                needs=("theta0", "loss"), choices=lambda section: {})(
        lambda observation, settings, context: built.append(1))
    try:
        counted = SINGLE_STEP.get("counted").settings()
        with pytest.raises(ConfigError, match="θ0"):
            build(replace(observation, theta0={}), counted)
        with pytest.raises(ConfigError, match="loss coefficients"):
            build(replace(observation, hyperparameters={}), counted)
        assert not built
        build(observation, counted, Context())
        assert built == [1]
    finally:
        SINGLE_STEP.drop("counted")
    aware = choices(AttackConfig())["defense-aware"][1]
    with pytest.raises(ConfigError, match="a defense the stream went through"):
        build(observation, aware)  # an undefended stream: nothing for it to model
    with pytest.raises(ConfigError, match="grey.level 300"):
        build(observation, grey["GreyConfig"](level=300))


def test_a_result_the_tables_cannot_read_is_refused_naming_the_attack(
        grey: dict[str, Any], random_capture: Path) -> None:
    with CaptureFile(random_capture) as capture:
        observation = capture.observation(np.arange(2))
    flat = grey["Grey"]

    class Floats(flat):
        def reconstruct(self):  # noqa: ANN202
            result = super().reconstruct()
            return replace(result, images=result.images / 255.0)

    single_step("floats", type("FloatsConfig", (grey["GreyConfig"],), {}), kind="training-free",
                needs=(), choices=lambda section: {})(
        lambda observation, settings, context: Floats(observation, settings))
    try:
        with pytest.raises(ConfigError, match="floats attack returned images float64"):
            run(observation, SINGLE_STEP.get("floats").settings())
    finally:
        SINGLE_STEP.drop("floats")
    result, seconds = run(observation, grey["GreyConfig"]())
    assert result.images.shape[0] == 2 and seconds >= 0


def test_a_declaration_the_framework_cannot_check_is_refused() -> None:
    def builder(observation, settings, context):  # noqa: ANN001, ANN202
        return None

    with pytest.raises(ConfigError, match="needs the labels"):
        single_step("oracle", AttackConfig, kind="training-free", needs=("the labels",),
                    choices=lambda section: {})(builder)
    with pytest.raises(ConfigError, match="kind 'learned'"):
        single_step("oracle", AttackConfig, kind="learned", needs=(),
                    choices=lambda section: {})(builder)
    with pytest.raises(ConfigError, match="must be a dataclass"):
        single_step("oracle", object, kind="training-free", needs=(),
                    choices=lambda section: {})(builder)
    with pytest.raises(ConfigError, match="already name the training-free attack"):
        single_step("again", type(choices(AttackConfig())["training-free"][1]),
                    kind="training-free", needs=(), choices=lambda section: {})(builder)
    assert "oracle" not in SINGLE_STEP and "again" not in SINGLE_STEP
