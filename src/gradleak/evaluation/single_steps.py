"""`gradleak attack`: invert chosen steps of a capture, score them and draw them: DLG or IG
(with how the optimisation got there), or the training-free attack."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from gradleak.attacks.exact import ExactConfig
from gradleak.attacks.optim.config import OptimConfig
from gradleak.attacks.optim.solve import GradientMatchingAttack
from gradleak.capture.reader import CaptureFile
from gradleak.errors import ConfigError
from gradleak.io import check_output, write_json
from gradleak.metrics.images import psnr, ssim, to_unit_tensor
from gradleak.names import TRAINING_FREE
from gradleak.threat import Observation, Reconstruction, Target
from gradleak.training.refiner_fit import check_prior, exact_attack


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
    """Per step: the frame's PSNR and SSIM, the action, A and R beside their truth."""
    truth, recovered = to_unit_tensor(target.images), to_unit_tensor(result.images)
    return [{"index": int(row), "psnr": float(p), "ssim": float(s), "action": int(a),
             "true_action": int(t), "advantage": float(adv), "true_advantage": float(true_adv),
             "return": float(ret), "true_return": float(true_ret)}
            for row, p, s, a, t, adv, true_adv, ret, true_ret in zip(
                rows, psnr(recovered, truth), ssim(recovered, truth), result.actions,
                target.actions, result.extras["advantages"], target.advantages,
                result.extras["returns"], target.returns, strict=True)]


def attack_steps(data: str | os.PathLike[str], indices: list[int], name: str,
                 config: OptimConfig, out: Path, progress: bool = False) -> dict[str, Any]:
    """DLG or IG on the chosen steps, with the picture of how the optimisation got there."""
    from gradleak.report.plots import plot_optimisation_history  # matplotlib is slow to import

    check_output(out, "--out", directory=True)
    rows, observation, target = read_steps(data, indices)
    config.snapshots = config.snapshots or 6
    result = GradientMatchingAttack(observation, config, progress).reconstruct()
    steps = [{**step, "matching_loss": float(loss), "matching_loss_after_first_step": float(start)}
             for step, loss, start in zip(step_scores(rows, result, target),
                                          result.extras["matching_loss"],
                                          result.extras["matching_loss_after_first_step"],
                                          strict=True)]
    summary = {"command": "attack", "method": name, "data": str(data), "config": asdict(config),
               "steps": steps, "seconds_per_frame": result.extras["seconds_per_frame"],
               "iterations": result.extras["iterations"]}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "attack.json", summary)
    plot_optimisation_history(target.images, result.extras["snapshots"],
                              result.extras["history"], result.extras["restart"],
                              config.restarts, out / "history.png", name)
    return summary


def exact_steps(data: str | os.PathLike[str], indices: list[int], config: ExactConfig,
                out: Path) -> dict[str, Any]:
    """The training-free attack on the chosen steps: frames, actions, A and R, and the first
    conv's equation residuals; a picture of the private frames above the recovered ones."""
    from gradleak.report.plots import plot_private_vs_reconstructed

    config.check()  # settings, the prior, then the output, before any row is read
    check_prior(config)
    check_output(out, "--out", directory=True)
    rows, observation, target = read_steps(data, indices)
    attack = exact_attack(observation, config)
    result = attack.reconstruct()
    steps = [{**step, **{f"residual_{key}": float(values[i])
                         for key, values in result.extras["residuals"].items()}}
             for i, step in enumerate(step_scores(rows, result, target))]
    summary = {"command": "attack", "method": TRAINING_FREE, "data": str(data),
               "config": asdict(config), "steps": steps,
               "seconds_per_frame": result.extras["seconds_per_frame"]}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "attack.json", summary)
    plot_private_vs_reconstructed(to_unit_tensor(target.images), to_unit_tensor(result.images),
                                  out / "reconstructions.png", f"{attack.name}: {data}")
    return summary
