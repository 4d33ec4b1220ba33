"""Named presets: what is saved beside every output reads back as the same preset, a `--set`
override gets the field's declared type, and a preset states only what differs from the
defaults."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from gradleak import presets
from gradleak.errors import ConfigError
from gradleak.presets import PRESETS, load_preset, preset_from_dict


@pytest.mark.parametrize("name", PRESETS.names())
def test_every_named_preset_survives_its_own_json(name: str) -> None:
    preset = load_preset(name)
    assert preset_from_dict(preset.to_dict()) == preset


def test_overrides_take_the_declared_type_of_the_field() -> None:
    preset = load_preset("cpu-quick", ["attack.decoder.feature_shape=16,8,8",
                                       "attack.trace_fit.max_train_windows=64",
                                       "attack.trace_fit.time_limit_minutes=1.5",
                                       "attack.trace_fit.lpips_weights=none"])
    assert preset.attack.decoder.feature_shape == [16, 8, 8]  # ints, not strings
    assert preset.attack.trace_fit.max_train_windows == 64
    assert isinstance(preset.attack.trace_fit.max_train_windows, int)
    assert preset.attack.trace_fit.time_limit_minutes == 1.5
    assert preset.attack.trace_fit.lpips_weights is None
    with pytest.raises(ConfigError, match="feature_shape='16,x'"):
        load_preset("cpu-quick", ["attack.decoder.feature_shape=16,x"])
    with pytest.raises(ConfigError, match="max_train_windows='many'"):
        load_preset("cpu-quick", ["attack.trace_fit.max_train_windows=many"])
    with pytest.raises(ConfigError, match="perceptual='resnet': expected one of vgg, alex, ssim"):
        load_preset("cpu-quick", ["attack.trace_fit.perceptual=resnet"]).validate()


def test_a_learned_attackers_settings_are_reached_one_way() -> None:
    attack = load_preset("cpu-quick", ["attack.lti_fit.epochs=3"]).attack
    model, fit = attack.learned("lti")
    assert model is attack.lti and fit is attack.lti_fit and fit.epochs == 3
    assert attack.learned("decoder") == (attack.decoder, attack.decoder_fit)
    with pytest.raises(ConfigError, match="learned attacker 'prior': expected one of decoder, lti"):
        attack.learned("prior")


def restated_defaults(source: str, namespace: dict) -> list[str]:
    """Every `Config(field=literal)` in `source` (or `**spread` of a `dict(...)` it names) whose
    literal is the field's own default: a setting said twice, which drifts when one changes."""
    tree = ast.parse(source)
    spreads = {node.targets[0].id: node.value for node in ast.walk(tree)
               if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
               and isinstance(node.value, ast.Call)
               and getattr(node.value.func, "id", "") == "dict"}
    found = []
    for node in ast.walk(tree):
        cls = namespace.get(getattr(node.func, "id", "")) if isinstance(node, ast.Call) else None
        if not dataclasses.is_dataclass(cls):
            continue
        defaults = {f.name: f.default if f.default is not dataclasses.MISSING else
                    f.default_factory() if f.default_factory is not dataclasses.MISSING else None
                    for f in dataclasses.fields(cls)}
        keywords = [k for k in node.keywords if k.arg is not None]
        for k in node.keywords:
            if k.arg is None and isinstance(k.value, ast.Name) and k.value.id in spreads:
                keywords += spreads[k.value.id].keywords
        for keyword in keywords:
            try:
                value = ast.literal_eval(keyword.value)
            except ValueError:
                continue
            if keyword.arg in defaults and defaults[keyword.arg] == value:
                found.append(f"line {node.lineno}: {cls.__name__}({keyword.arg}={value!r})")
    return found


def test_presets_state_only_what_differs_from_the_defaults() -> None:
    assert restated_defaults(Path(presets.__file__).read_text(), vars(presets)) == []
    assert restated_defaults("TrainConfig(num_envs=8, updates=3)", vars(presets)) == \
        ["line 1: TrainConfig(num_envs=8)"]  # the check sees a restated default
