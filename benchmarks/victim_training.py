"""Summarise a victim training run: success rate and return over the course of training.

    gradleak train-victim --algo ppo --preset cpu-bench --out runs/victim-ppo-bench
    python benchmarks/victim_training.py runs/victim-ppo-bench

Prints JSON and writes benchmarks/results/victim_training_<algo>.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from gradleak.io import atomic_path, read_json


def phase(history: list[dict], start: int, stop: int) -> dict[str, float]:
    rows = [h for h in history[start:stop] if h["episodes"]]
    episodes = sum(h["episodes"] for h in rows)
    return {"updates": f"{start + 1}-{min(stop, len(history))}", "episodes": episodes,
            "success_rate": sum(h["success_rate"] * h["episodes"] for h in rows) / episodes,
            "mean_return": float(np.mean([h["mean_return"] for h in rows])),
            "entropy": float(np.mean([h["entropy"] for h in rows])),
            "steps_per_second": float(np.median([h["steps_per_second"] for h in rows]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run", type=Path)
    args = parser.parse_args()
    meta = read_json(args.run / "trainer.json", "trainer state")
    history, preset = meta["history"], meta["preset"]
    cuts = np.linspace(0, len(history), 5).astype(int)
    result = {"run": str(args.run), "preset": preset["name"], "algo": preset["train"]["algo"],
              "victim": preset["train"]["victim"], "env_steps": meta["env_steps"],
              "phases": [phase(history, a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]}
    text = json.dumps(result, indent=2)
    print(text)
    out = Path(__file__).parent / "results" / f"victim_training_{result['algo']}.json"
    with atomic_path(out) as tmp:
        tmp.write_text(text + "\n")


if __name__ == "__main__":
    main()
