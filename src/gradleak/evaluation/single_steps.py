"""`gradleak attack`: invert chosen steps of a capture with any single-step attack, score them
and draw them."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from gradleak.attacks.catalogue import attack_for, run
from gradleak.attacks.optim.config import OptimConfig
from gradleak.attacks.single_step import Context
from gradleak.capture.reader import CaptureFile
from gradleak.errors import ConfigError
from gradleak.io import check_output, write_json
from gradleak.metrics.images import psnr, ssim, to_unit_tensor
from gradleak.threat import Observation, Reconstruction, Target
from gradleak.training.refiner_fit import check_prior, load_prior


def read_steps(data: str | os.PathLike[str], indices: list[int]
               ) -> tuple[np.ndarray, Observation, Target]:
    with CaptureFile(data) as capture:
        bad = [i for i in indices if not 0 <= i < len(capture)]
        if bad:
            raise ConfigError(f"--index {bad[0]}: {data} has rows 0..{len(capture) - 1}")
        rows = np.array(sorted(set(indices)))
        # the target is for scoring only: the attack never receives it
        return rows, capture.observation(rows), capture.target(rows)


def step_scores(rows: np.ndarray, result: Reconstruction, target: Target
                ) -> list[dict[str, Any]]:
    """Per step: the frame's PSNR and SSIM, the action, and A and R beside their truth (None
    where the attack does not recover them)."""
    truth, recovered = to_unit_tensor(target.images), to_unit_tensor(result.images)
    missing = [None] * len(rows)
    return [{"index": int(row), "psnr": float(p), "ssim": float(s), "action": int(a),
             "true_action": int(t), "advantage": _number(adv),
             "true_advantage": float(true_adv), "return": _number(ret),
             "true_return": float(true_ret)}
            for row, p, s, a, t, adv, true_adv, ret, true_ret in zip(
                rows, psnr(recovered, truth), ssim(recovered, truth), result.actions,
                target.actions, result.extras.get("advantages", missing), target.advantages,
                result.extras.get("returns", missing), target.returns, strict=True)]


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def attack_steps(data: str | os.PathLike[str], indices: list[int], choice: str, settings: Any,
                 out: Path, progress: bool = False) -> dict[str, Any]:
    """A single-step attack (`attacks.single_step`) on the chosen steps, scored and drawn:
    with the picture of how its optimisation got there where it keeps snapshots (DLG, IG),
    else the private frames above the recovered ones; its per-step extras (matching loss,
    equation residuals, likelihood) beside the scores."""
    from gradleak.report.plots import plot_optimisation_history, plot_private_vs_reconstructed

    entry = attack_for(settings)  # settings, the prior, then the output, before any row is read
    entry.check(settings)
    prior = entry.prior(settings)
    check_prior(prior)
    check_output(out, "--out", directory=True)
    rows, observation, target = read_steps(data, indices)
    reason = entry.missing(observation)
    if reason:
        raise ConfigError(f"{choice}: {reason}")
    if isinstance(settings, OptimConfig):  # frames along the way, for the history picture
        settings.snapshots = settings.snapshots or 6
    context = Context(progress, load_prior(prior, observation) if prior else None)
    result, seconds = run(observation, settings, context)
    extras = result.extras
    per_step = {key: extras[key] for key in ("matching_loss",
                                              "matching_loss_after_first_step",
                                              "negative_log_likelihood") if key in extras}
    per_step.update({f"residual_{key}": values
                     for key, values in extras.get("residuals", {}).items()})
    steps = [{**step, **{key: float(values[i]) for key, values in per_step.items()}}
             for i, step in enumerate(step_scores(rows, result, target))]
    summary = {"command": "attack", "method": choice, "attack": entry.name, "data": str(data),
               "config": asdict(settings), "steps": steps, "columns": list(per_step),
               "seconds_per_frame": seconds / len(rows), "iterations": extras.get("iterations")}
    out.mkdir(parents=True, exist_ok=True)
    if "snapshots" in extras:
        summary["picture"] = str(out / "history.png")
        plot_optimisation_history(target.images, extras["snapshots"], extras["history"],
                                  extras["restart"], settings.restarts, out / "history.png",
                                  choice)
    else:
        summary["picture"] = str(out / "reconstructions.png")
        plot_private_vs_reconstructed(to_unit_tensor(target.images),
                                      to_unit_tensor(result.images), out / "reconstructions.png",
                                      f"{entry.label(choice, settings)}: {data}")
    write_json(out / "attack.json", summary)
    return summary
