"""Dependencies point one way: each package imports only packages in layers below its own.

Every import counts: module level, inside functions, and under TYPE_CHECKING, since each
of those is a way for one stage to load another's code."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "gradleak"
LAYERS = [
    {"errors", "names"},
    {"registry", "config", "safe_pickle", "threads", "plugins"},
    {"victims", "metrics"},
    {"threat", "io", "envs"},
    {"inversion", "report"},  # inversion: the layer inverses both attack families walk
    {"rl"},
    {"capture"},
    {"attacks", "defenses", "fedavg"},
    {"training", "integrations"},  # integrations wrap fedavg and capture for other frameworks
    {"evaluation"},
    {"presets"},
    {"auditing", "experiments"},
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


def imported_modules(path: Path) -> set[str]:
    """The gradleak modules a file imports (`from gradleak.x import y` counts y when y is a
    module of x, else x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gradleak"):
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if module_path(child) else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("gradleak")}
    return {name for name in found if module_path(name)}


def module_path(name: str) -> Path | None:
    base = SOURCE.parent.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_two_modules_import_each_other_even_inside_one_package() -> None:
    """Within a package too: a loop of imports (however deferred) means two modules that
    cannot be read apart, one of them usually holding what belongs to both."""
    graph = {module_name(path): imported_modules(path) for path in SOURCE.rglob("*.py")}
    loops, state = [], {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if nxt == node or nxt.startswith(node + "."):  # a package's face handing names on
                continue
            if state.get(nxt) == "open":
                loops.append(" -> ".join([*trail[trail.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not loops, "\n".join(loops)
