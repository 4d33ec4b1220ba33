"""Structured vs dense gradient input, on the cpu-bench captures of benchmarks/trace_vs_lti.py.

Trains, each for at most --minutes on the same training capture: TRACE with the paper's dense
projection, TRACE with the structured input (exact Linear-layer inputs, deltas, conv-channel
norms), and LtI with the structured input (a learned decoder of the recovered features). Scores
them with the subsample TRACE and LtI already in --work, plus feature inversion by optimisation
on --invert held-out frames. Writes benchmarks/results/structured_vs_dense.{json,md}.

    python benchmarks/structured_vs_dense.py [--work runs/bench-attack] [--minutes 60]
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from gradleak.evaluation.analytic import evaluate_analytic
from gradleak.evaluation.reconstructions import evaluate
from gradleak.io import atomic_path
from gradleak.presets import load_preset
from gradleak.training.checkpoint import META
from gradleak.training.fit import fit_attacker

RESULTS = Path(__file__).parent / "results" / "structured_vs_dense.json"
VARIANTS = {"TRACE-dense": ("trace", "dense"), "TRACE-structured": ("trace", "structured"),
            "LtI-structured": ("lti", "structured")}
EXISTING = {"TRACE (T=8, subsample)": "TRACE-T=8", "LtI (subsample)": "LtI"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, default=Path("runs/bench-attack"))
    parser.add_argument("--preset", default="cpu-bench")
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--invert", type=int, default=32)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    preset = load_preset(args.preset)
    train, heldout = args.work / "train.h5", args.work / "heldout.h5"
    training = {}
    for name, (kind, projection) in VARIANTS.items():
        model = copy.deepcopy(getattr(preset.attack, kind))
        fit = copy.deepcopy(getattr(preset.attack, f"{kind}_fit"))
        model.projection, fit.time_limit_minutes = projection, args.minutes
        out = args.work / name
        training[name] = fit_attacker(kind, model, fit, [str(train)], out,
                                      resume=(out / META).exists(), progress=True)
    attackers = {name: str(args.work / name) for name in VARIANTS}
    attackers.update({name: str(args.work / folder) for name, folder in EXISTING.items()
                      if (args.work / folder / META).exists()})
    result = evaluate([heldout], attackers, args.work / "eval-structured")
    analytic = evaluate_analytic([heldout], invert=args.invert)[str(heldout)]
    summary = {"preset": args.preset, "minutes_budget": args.minutes,
               "training": {name: {k: r[k] for k in ("epochs", "minutes", "parameters")}
                            for name, r in training.items()},
               "evaluation": result, "analytic": analytic}
    with atomic_path(args.results) as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
    with atomic_path(args.results.with_suffix(".md")) as tmp:
        tmp.write_text((args.work / "eval-structured" / "metrics.md").read_text())
    print(json.dumps(summary["training"], indent=2))


if __name__ == "__main__":
    main()
