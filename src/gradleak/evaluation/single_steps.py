"""`gradleak attack`: invert chosen steps of a capture with DLG or IG, score them, and draw how
the optimisation got there."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from gradleak.attacks.optim.config import OptimConfig
from gradleak.attacks.optim.solve import GradientMatchingAttack
from gradleak.capture.reader import CaptureFile
from gradleak.errors import ConfigError
from gradleak.io import check_output, write_json
from gradleak.metrics.images import psnr, ssim, to_unit_tensor


def attack_steps(data: str | os.PathLike[str], indices: list[int], name: str,
                 config: OptimConfig, out: Path, progress: bool = False) -> dict[str, Any]:
    from gradleak.report.plots import plot_optimisation_history  # matplotlib is slow to import

    check_output(out, "--out", directory=True)
    with CaptureFile(data) as capture:
        bad = [i for i in indices if not 0 <= i < len(capture)]
        if bad:
            raise ConfigError(f"--index {bad[0]}: {data} has rows 0..{len(capture) - 1}")
        rows = np.array(sorted(set(indices)))
        observation = capture.observation(rows)
        target = capture.target(rows)  # scoring only: the attack never receives it
    config.snapshots = config.snapshots or 6
    result = GradientMatchingAttack(observation, config, progress).reconstruct()
    truth, recovered = to_unit_tensor(target.images), to_unit_tensor(result.images)
    steps = [{"index": int(row), "psnr": float(p), "ssim": float(s),
              "action": int(a), "true_action": int(t), "advantage": float(adv),
              "true_advantage": float(true_adv), "return": float(ret),
              "true_return": float(true_ret), "matching_loss": float(loss),
              "matching_loss_after_first_step": float(start)}
             for row, p, s, a, t, adv, true_adv, ret, true_ret, loss, start in zip(
                 rows, psnr(recovered, truth), ssim(recovered, truth), result.actions,
                 target.actions, result.extras["advantages"], target.advantages,
                 result.extras["returns"], target.returns, result.extras["matching_loss"],
                 result.extras["matching_loss_after_first_step"], strict=True)]
    summary = {"command": "attack", "method": name, "data": str(data), "config": asdict(config),
               "steps": steps, "seconds_per_frame": result.extras["seconds_per_frame"],
               "iterations": result.extras["iterations"]}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "attack.json", summary)
    plot_optimisation_history(target.images, result.extras["snapshots"],
                              result.extras["history"], result.extras["restart"],
                              config.restarts, out / "history.png", name)
    return summary
