"""Named presets: what is saved beside every output reads back as the same preset, and a
`--set` override gets the field's declared type."""

from __future__ import annotations

import pytest

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
    with pytest.raises(ConfigError, match="learned attacker 'prior': expected one of trace"):
        attack.learned("prior")
