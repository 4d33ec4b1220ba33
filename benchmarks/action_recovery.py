"""Closed-form action recovery on held-out captures: a trained victim and a random-init one.

    python benchmarks/action_recovery.py --victim runs/victim-ppo-bench [--steps 4000]

The trained victim comes from `gradleak train-victim --algo ppo --preset cpu-bench --out
runs/victim-ppo-bench`. Prints JSON and writes benchmarks/results/action_recovery.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from gradleak.capture.run import CaptureJob, run_capture
from gradleak.evaluation import evaluate_action_rules
from gradleak.io import atomic_path, read_json
from gradleak.presets import load_preset

RESULTS = Path(__file__).parent / "results" / "action_recovery.json"
RULES = ("odd-sign", "sign-agnostic", "sign-aware")


def evaluate(job: CaptureJob) -> dict[str, object]:
    result = run_capture(job)
    scores = evaluate_action_rules([result["out"]], RULES)
    return {"victim": job.victim, "random_init": job.random_init, "steps": job.steps,
            "episodes": result["episodes"], "rules": scores}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--victim", default="runs/victim-ppo-bench")
    parser.add_argument("--steps", type=int, default=4000)
    args = parser.parse_args()
    preset = load_preset("cpu-bench")
    meta = read_json(Path(args.victim) / "victim.json", "victim config")
    results = {"preset": "cpu-bench", "split": "heldout",
               "trained_victim_updates": meta.get("update"), "captures": []}
    with tempfile.TemporaryDirectory() as tmp:
        for job in (CaptureJob(victim=args.victim, split="heldout", steps=args.steps,
                               out=Path(tmp) / "trained.h5", preset=preset, progress=False),
                    CaptureJob(victim="cnn-small", random_init=True, split="heldout",
                               steps=args.steps, out=Path(tmp) / "random.h5", preset=preset,
                               progress=False)):
            results["captures"].append(evaluate(job))
    text = json.dumps(results, indent=2)
    print(text)
    with atomic_path(RESULTS) as tmp_file:
        tmp_file.write_text(text + "\n")


if __name__ == "__main__":
    main()
