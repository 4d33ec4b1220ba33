"""A setting lives in one place: no config dataclass restates another's field (a field whose
default is read off a same-named field of another class, `smoothness: float =
FrameSolve.smoothness`), since two copies drift apart and a positional rebuild of one from the
other breaks silently when a field moves. Nest the other config instead."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "gradleak"


def restated_fields(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for statement in node.body:
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) \
                    and isinstance(statement.value, ast.Attribute) \
                    and isinstance(statement.value.value, ast.Name) \
                    and statement.value.attr == statement.target.id:
                found.append(f"{node.name}.{statement.target.id} = "
                             f"{statement.value.value.id}.{statement.value.attr}")
    return found


def test_no_config_restates_another_configs_field() -> None:
    restated = [f"{path.relative_to(SOURCE)}: {field}" for path in sorted(SOURCE.rglob("*.py"))
                for field in restated_fields(ast.parse(path.read_text()))]
    assert not restated, "\n".join(restated)


def test_the_check_sees_a_restated_field() -> None:
    tree = ast.parse("class A:\n    x: int = B.x\n    y: int = B.z\n    w: int = 3\n")
    assert restated_fields(tree) == ["A.x = B.x"]
