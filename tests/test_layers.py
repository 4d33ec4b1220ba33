"""Dependencies point one way: each package imports only packages in layers below its own.

Every import counts: module level, inside functions, and under TYPE_CHECKING, since each
of those is a way for one stage to load another's code."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "gradleak"
LAYERS = [
    {"errors"},
    {"registry", "config"},
    {"victims", "metrics", "plugins"},
    {"threat", "io", "envs"},
    {"report"},
    {"rl"},
    {"capture"},
    {"attacks", "defenses", "fedavg", "integrations"},
    {"training"},
    {"evaluation"},
    {"presets"},
    {"demo"},
    {"cli"},
]
LAYER = {package: level for level, packages in enumerate(LAYERS) for package in packages}


def package_of(path: Path) -> str:
    return path.relative_to(SOURCE).parts[0].removesuffix(".py")


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
            [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        found |= {name.split(".")[1] for name in names
                  if name.startswith("gradleak.") and len(name.split(".")) > 1}
    return found


def test_every_package_has_a_layer() -> None:
    packages = {package_of(path) for path in SOURCE.rglob("*.py")} - {"__init__"}
    assert packages <= set(LAYER), sorted(packages - set(LAYER))


def test_no_package_imports_one_above_or_beside_it() -> None:
    wrong = []
    for path in sorted(SOURCE.rglob("*.py")):
        source = package_of(path)
        if source == "__init__":
            continue
        for target in imported_packages(path) - {source}:
            if LAYER[target] >= LAYER[source]:
                wrong.append(f"{path.relative_to(SOURCE)} ({source}, layer {LAYER[source]}) "
                             f"imports {target} (layer {LAYER[target]})")
    assert not wrong, "\n".join(wrong)
