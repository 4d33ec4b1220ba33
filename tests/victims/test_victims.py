"""The victim registry: exact sizes, the structure attacks rely on, checkpoints."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gradleak.errors import CheckpointError, ConfigError
from gradleak.io import load_victim, save_victim, theta_sha256
from gradleak.victims import COMPONENTS, create_victim, layer_table


def count(victim: torch.nn.Module) -> int:
    return sum(p.numel() for p in victim.parameters())


def test_paper_cnn_has_936102_parameters_at_84_with_5_actions() -> None:
    assert count(create_victim("cnn", frame_size=84, num_actions=5)) == 936_102


def test_ten_actions_add_one_head_row_per_action() -> None:
    assert count(create_victim("cnn", frame_size=84, num_actions=10)) == 936_102 + 5 * 513


def test_small_cnn_is_a_sixth_of_the_paper_cnn() -> None:
    """The CPU size: about 160k parameters at 64×64, against the paper CNN's 936k at 84×84."""
    small = count(create_victim("cnn-small", frame_size=64, num_actions=5))
    assert 150_000 <= small <= 175_000 and small < 936_102 / 5


@pytest.mark.parametrize("name", ["cnn", "cnn-small"])
def test_structure_the_attacks_rely_on(name: str) -> None:
    victim = create_victim(name, frame_size=64, num_actions=5).eval()
    assert isinstance(victim.policy_head, torch.nn.Linear)
    tags = {n: victim.component_of(n) for n, _ in victim.named_parameters()}
    assert set(tags.values()) == set(COMPONENTS)
    policy = {n for n in tags if n.startswith("policy_head.")}
    value = {n for n in tags if n.startswith("value_head.")}
    assert policy and value and not policy & value
    images = torch.randint(0, 256, (3, 64, 64, 3), dtype=torch.uint8)
    h = victim.features(images)
    assert (h >= 0).all()  # ReLU features: assumption (A3) of Theorem 4.2
    logits, values = victim(images)
    assert torch.allclose(logits, victim.policy_head(h)) and values.shape == (3,)


def test_layer_table_is_contiguous_and_subsets_by_component() -> None:
    victim = create_victim("cnn-small", frame_size=64)
    full = layer_table(victim)
    assert full[0].offset == 0
    assert all(a.offset + a.size == b.offset for a, b in itertools.pairwise(full))
    heads = layer_table(victim, ("heads",))
    assert [layer.name for layer in heads] == ["policy_head.weight", "policy_head.bias",
                                               "value_head.weight", "value_head.bias"]
    assert sum(layer.size for layer in heads) == 5 * 257 + 257
    with pytest.raises(ConfigError, match="component 'conv'"):
        layer_table(victim, ("conv",))


def test_unknown_victim_lists_the_known_ones() -> None:
    known = "cnn, cnn-gru, cnn-gru-small, cnn-k10, cnn-k10-small, cnn-small, impala"
    with pytest.raises(ConfigError, match=f"unknown victim 'resnet'.*{known}"):
        create_victim("resnet")


def test_checkpoint_round_trip_keeps_theta(tmp_path: Path) -> None:
    torch.manual_seed(0)
    victim = create_victim("cnn-small", frame_size=32).eval()
    victim.encoder[2].running_mean.add_(0.5)  # buffers travel too
    save_victim(tmp_path, victim, {"algorithm": "a2c"})
    loaded, meta = load_victim(tmp_path / "victim.safetensors")
    assert theta_sha256(loaded) == theta_sha256(victim) == meta["theta_sha256"]
    assert not loaded.training and meta["algorithm"] == "a2c"


def test_checkpoint_that_does_not_match_its_config_is_named(tmp_path: Path) -> None:
    save_victim(tmp_path, create_victim("cnn-small", frame_size=32))
    (tmp_path / "victim.json").write_text((tmp_path / "victim.json").read_text()
                                          .replace('"frame_size": 32', '"frame_size": 64'))
    with pytest.raises(CheckpointError, match="fc.weight has shape .*expects"):
        load_victim(tmp_path)


def test_missing_and_corrupt_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_victim(tmp_path)
    save_victim(tmp_path, create_victim("cnn-small", frame_size=32))
    (tmp_path / "victim.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        load_victim(tmp_path)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "victim.safetensors"))
    with pytest.raises(CheckpointError, match="missing"):
        load_victim(tmp_path)


def test_outputs_are_written_with_the_usual_permissions(tmp_path: Path) -> None:
    from gradleak.io import write_json

    mask = os.umask(0o022)
    try:
        write_json(tmp_path / "x.json", {"a": 1})
    finally:
        os.umask(mask)
    assert (tmp_path / "x.json").stat().st_mode & 0o777 == 0o644
