"""The threat boundary, checked where it is crossed: evaluation hands every attack what the
server saw (gradient rows, and for the optimisation baselines θ0, roles and the declared
loss), never the frames, actions, advantages, returns or values it scores them against."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

import gradleak.evaluation.reconstructions as reconstructions
from gradleak.capture.reader import CaptureFile
from gradleak.threat import Observation, ObservedWindows


def test_the_server_view_types_hold_nothing_private() -> None:
    assert [f.name for f in dataclasses.fields(ObservedWindows)] == ["gradients"]
    assert {f.name for f in dataclasses.fields(Observation)} == {
        "gradients", "layers", "victim", "hyperparameters", "episode_ids", "step_in_episode",
        "theta0", "roles", "defense"}
    # the defense as the server that set it knows it: kinds and parameters, never the seed
    # that drew its noise
    from gradleak.defenses import parse_defense
    from gradleak.threat import declared

    told = declared(parse_defense("prune:0.1+noise:0.01", seed=7).describe()["transforms"])
    assert told == ({"name": "prune", "keep": 0.1}, {"name": "noise", "sigma": 0.01})


def test_evaluation_gives_the_attacks_captured_gradients_and_nothing_else(
        monkeypatch, trained_attackers, random_capture: Path, tmp_path: Path) -> None:
    received: list[tuple[str, object, tuple, dict]] = []
    real_load = reconstructions.load_attacker

    def spying_load(path):  # noqa: ANN001, ANN202
        model, meta = real_load(path)
        original = model.reconstruct

        def reconstruct(observed, *args, **kwargs):  # noqa: ANN001, ANN202
            received.append(("learned", observed, args, kwargs))
            return original(observed, *args, **kwargs)

        model.reconstruct = reconstruct
        return model, meta

    real_run = reconstructions.run

    def spying_run(observation, settings, context):  # noqa: ANN001, ANN202
        received.append(("single-step", observation, (settings, context), {}))
        return real_run(observation, settings, context)

    monkeypatch.setattr(reconstructions, "load_attacker", spying_load)
    monkeypatch.setattr(reconstructions, "run", spying_run)
    from gradleak.attacks.optim.config import baseline_config

    reconstructions.evaluate([random_capture], {"LtI": str(trained_attackers["lti"])},
                             tmp_path / "e", max_windows=2, baseline_windows=1,
                             baselines={"IG": baseline_config("ig", iterations=1)})
    with CaptureFile(random_capture) as capture:
        captured = capture.read("gradients").astype(np.float32)
    kinds = {kind for kind, *_ in received}
    assert kinds == {"learned", "single-step"}
    for kind, observed, args, kwargs in received:
        if kind == "learned":
            assert type(observed) is ObservedWindows and not args and not kwargs
            rows = observed.gradients.reshape(-1, captured.shape[1]).numpy()
        else:
            assert type(observed) is Observation
            assert all(not isinstance(a, np.ndarray) for a in (*args, *kwargs.values()))
            rows = observed.gradients
        # every row handed over is a captured gradient row, nothing else
        assert all((captured == row).all(1).any() for row in rows)


ATTACK_MODULES = [*sorted((Path(__file__).resolve().parents[1] / "src" / "gradleak" / "attacks")
                          .rglob("*.py")),
                  *(Path(__file__).resolve().parents[1] / "src" / "gradleak" / "fedavg" / name
                    for name in ("attacks.py", "labels.py", "invert.py", "forward.py",
                                 "update_file.py"))]
PRIVATE_PATHS = ("gradleak.capture", "gradleak.evaluation", "gradleak.training",
                 "gradleak.fedavg.datasets", "gradleak.fedavg.experiment")


def test_no_attack_module_reaches_a_private_data_path() -> None:
    """Attack code (RL and FedAvg alike) imports none of the modules that read private data
    (capture files, training windows, the FedAvg datasets and experiment), and calls no
    `.target(` or `.column(` reader."""
    import ast

    found = []
    for path in ATTACK_MODULES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.name} imports {name}" for name in names
                      if name.startswith(PRIVATE_PATHS)]
            if isinstance(node, ast.Attribute) and node.attr in ("target", "column") and \
                    isinstance(getattr(node, "ctx", None), ast.Load):
                found.append(f"{path.name} reads .{node.attr}")
    assert not found, found
