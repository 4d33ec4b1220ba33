"""The training-free attack's ReLU decisions under defenses: the posterior rule's ambiguous units
settled by the fitted δ alone (nearer its on-value than 0) against by their posterior odds times
that δ's evidence (`layers.relu.likelier_on`), side by side on the same defended steps.

The paper's `cnn` at 84×84 trained with PPO (the held-out float32 capture of
`benchmarks/exact_frames.py`), --frames evenly spaced held-out steps defended as the audit
defends them; per defense and rule set: the exact attack's mean PSNR and each frame's, the action
accuracy and the seconds it took. "nearer": the walks and the deepest block's second decision
by the fitted δ alone (the rules before this change); "odds + nearer": the rules now
(`conv_recovery.MASK_RULES`, `DEEPEST_RULES`). Writes benchmarks/results/mask_rules.{json,md}.

    python benchmarks/mask_rules.py [--work runs/exact-frames] [--frames 8]
        [--defenses "none;cast:bfloat16;..."]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from exact_frames import Case, capture
from host import machine

import gradleak.attacks.exact as exact_module
from gradleak.attacks.conv_inputs import observed_conv_inputs
from gradleak.attacks.exact import ExactAttack
from gradleak.capture.reader import CaptureFile
from gradleak.defenses import parse_defense
from gradleak.defenses.base import row_keys
from gradleak.inversion.conv_recovery import DEEPEST_RULES, MASK_RULES
from gradleak.inversion.layers.relu import MaskRule
from gradleak.io import atomic_path
from gradleak.metrics.images import psnr
from gradleak.report.tables import fixed, markdown_table

RESULTS = Path(__file__).parent / "results" / "mask_rules.json"
DEFENSES = "none;cast:bfloat16;quant:12;noise:1e-05;noise:0.0001;prune:0.1"
RULE_SETS = {
    "nearer": ((MaskRule(None, rounds=1, odds=False), MaskRule(10.0), MaskRule(20.0)),
               (MaskRule(None, rounds=4, odds=False),)),
    "odds + nearer": (MASK_RULES, DEEPEST_RULES),
}


def attack(observation: Any, rules: tuple[Any, Any]) -> tuple[np.ndarray, np.ndarray, float]:
    walk = functools.partial(observed_conv_inputs, rules=rules[0], deepest_rules=rules[1])
    with mock.patch.object(exact_module, "observed_conv_inputs", walk):
        start = time.perf_counter()
        found = ExactAttack(observation).reconstruct()
        return found.images, found.actions, time.perf_counter() - start


def frame_psnrs(images: np.ndarray, truth: np.ndarray) -> list[float]:
    guess, real = (torch.from_numpy(x).permute(0, 3, 1, 2).float() / 255 for x in (images, truth))
    return [float(psnr(guess[i:i + 1], real[i:i + 1])) for i in range(len(guess))]


def run(work: Path, frames: int, defenses: list[str]) -> dict[str, Any]:
    case = Case("cnn 84×84, PPO", "runs/victims/cnn84-ppo", "paper", False)
    path = capture(case, "float32", 64, work)
    with CaptureFile(path) as file:
        rows = np.linspace(0, file.num_rows - 1, frames).round().astype(int)
        clean, target = file.observation(rows), file.target(rows)
        keys = row_keys(dict(file.attrs), 0, file.num_rows)[rows]
    out = []
    for spec in defenses:
        observed = clean if spec == "none" else replace(clean, gradients=parse_defense(
            spec).gradients(torch.from_numpy(clean.gradients), keys).numpy())
        for name, rules in RULE_SETS.items():
            images, actions, seconds = attack(observed, rules)
            each = frame_psnrs(images, target.images)
            out.append({"defense": spec, "rules": name, "psnr": float(np.mean(each)),
                        "psnr_each": each, "min_psnr": min(each),
                        "action_accuracy": float(np.mean(actions == target.actions)),
                        "seconds": seconds})
            print(json.dumps(out[-1]), flush=True)
    return {"machine": machine(), "victim": case.name, "frames": frames, "rows": out}


def markdown(results: dict[str, Any]) -> str:
    rows = []
    for row in results["rows"]:
        rows.append({"defense": row["defense"], "rules": row["rules"],
                     "PSNR": fixed(row["psnr"], 2), "min PSNR": fixed(row["min_psnr"], 2),
                     "per frame": " ".join(f"{v:.1f}" for v in row["psnr_each"]),
                     "actions": fixed(row["action_accuracy"], 2),
                     "s": fixed(row["seconds"], 0)})
    return (f"# The posterior rule's ambiguous units: the fitted δ alone or its odds "
            f"({results['machine']})\n\n{results['victim']}, {results['frames']} evenly spaced "
            "held-out steps, float32 wire; the training-free (exact, defense-blind) attack's "
            "PSNR (dB). \"nearer\": the rules before (each ambiguous unit on where its fitted δ "
            "is nearer its on-value than 0); \"odds + nearer\": the rules now (its posterior "
            "odds times the fitted δ's evidence, and the former as one more walk). Seconds: "
            "wall clock, with other work beside it.\n\n"
            + markdown_table(rows, ["defense", "rules", "PSNR", "min PSNR", "per frame",
                                    "actions", "s"]) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("runs/exact-frames"))
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--defenses", default=DEFENSES)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results = run(args.work, args.frames, args.defenses.split(";"))
    with atomic_path(RESULTS) as tmp:
        tmp.write_text(json.dumps(results, indent=1))
    with atomic_path(RESULTS.with_suffix(".md")) as tmp:
        tmp.write_text(markdown(results))


if __name__ == "__main__":
    main()
