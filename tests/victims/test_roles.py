"""Roles: what the attacks read instead of parameter names, found by one forward pass."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from gradleak.errors import ConfigError
from gradleak.victims import create_victim
from gradleak.victims.roles import Roles
from gradleak.victims.transform import InputTransform

SOURCE = Path(__file__).resolve().parents[2] / "src" / "gradleak"
# parameter and module names of gradleak's own victims, which no attack may look up
VICTIM_NAMES = {"policy_head", "value_head", "fc", "encoder", "goal_encoder", "gru", "fusion"}


@pytest.mark.parametrize("name, linears, feature_linear, chain", [
    ("cnn-small", ("fc", "policy_head", "value_head"), "fc", True),
    ("nature-cnn", ("fc", "policy_head", "value_head"), "fc", True),
    ("impala-small", ("fc", "policy_head", "value_head"), "fc", False),  # residual additions
    ("cnn-gru-small", ("fc", "gru.input", "gru.state", "policy_head", "value_head"), "fc", True),
    ("multimodal-small", ("fc", "goal_encoder.0", "goal_encoder.2", "fusion", "policy_head",
                          "value_head"), "fc", True),
    ("vit-tiny-small", ("policy_head", "value_head"), None, False),  # token-wise layers: no
])
def test_each_victims_roles_come_from_its_forward_pass(name: str, linears: tuple[str, ...],
                                                       feature_linear: str | None,
                                                       chain: bool) -> None:
    size = 64
    roles = create_victim(name, frame_size=size).roles()
    assert roles.linears == linears and roles.feature_linear == feature_linear
    assert roles.conv_chain == chain
    assert Roles.from_json(roles.to_json(), "test") == roles  # what the capture stores


def test_the_input_transform_inverts_and_refuses_nonsense() -> None:
    transform = InputTransform(4, 6, 3, mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.4))
    frames = torch.randint(0, 256, (2, 4, 6, 3), dtype=torch.uint8)
    assert transform.apply(frames).shape == (2, 3, 4, 6)
    assert torch.allclose(transform.invert(transform.apply(frames)), frames.float(), atol=1e-4)
    with pytest.raises(ConfigError, match="5 channels in a stack of 2"):
        InputTransform(4, 4, 5, stack=2)
    with pytest.raises(ConfigError, match="mean has 2 values"):
        InputTransform(4, 4, 3, mean=(0.1, 0.2))


def _string_constants(path: Path) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


@pytest.mark.parametrize("package", ["attacks", "evaluation", "training", "report"])
def test_no_attack_looks_a_parameter_up_by_name(package: str) -> None:
    """String literals naming a victim's modules ("policy_head", "fc.weight", "encoder.3")
    would tie an attack to gradleak's own victims; attacks read roles instead."""
    found = []
    for path in sorted((SOURCE / package).rglob("*.py")):
        for text in _string_constants(path):
            head = text.split(".")[0]
            if head in VICTIM_NAMES and (text == head or text[len(head):len(head) + 1] == "."):
                found.append(f"{path.relative_to(SOURCE)}: {text!r}")
    assert not found, found
