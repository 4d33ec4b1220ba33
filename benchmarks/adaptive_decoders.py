"""Adaptive feature decoders: trained on the features recovered under a defense.

Zero-shot, the feature decoder collapses under noise, quantisation and pruning (it was trained on
exact features; see conv_recovery.md and structured_vs_dense.md). Learning to Invert's protocol
lets the attacker train under the defense it faces. For each of --defenses this trains the
FC-input decoder of the cpu-bench preset on the training capture's frames paired with the
features recovered from their defended gradients (`gradleak train-decoder --defense SPEC
--extra-frames 0`; its own noise draws, seed 1), then scores on --max-windows held-out windows
under that defense (seed 0): the adaptive decoder, the zero-shot decoders, and the adaptive TRACE
and LtI of benchmarks/defenses.py where their runs exist. Writes
benchmarks/results/adaptive_decoders.{json,md}.

    python benchmarks/adaptive_decoders.py [--work runs/bench-attack]
        [--defenses "noise:0.001;quant:8;prune:0.1"] [--epochs 3] [--max-windows 100]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
from pathlib import Path
from typing import Any

import torch

from gradleak.defenses import parse_defense
from gradleak.evaluation.reconstructions import evaluate
from gradleak.io import atomic_path
from gradleak.presets import load_preset
from gradleak.report.tables import fixed, markdown_table
from gradleak.training.checkpoint import META
from gradleak.training.decoder_fit import fit_decoder

RESULTS = Path(__file__).parent / "results" / "adaptive_decoders.json"
ZERO_SHOT = {"feature decoder (FC input)": "decoder",
             "feature decoder (conv stack)": "decoder-conv-3ep"}
# benchmarks/defenses.py's adaptive runs, under runs/bench-attack/defenses/<spec as a folder>
ADAPTIVE_BASELINES = {"TRACE (adaptive)": "trace", "LtI (adaptive)": "lti"}
KEEP = ("psnr", "ssim", "action_accuracy", "psnr_gain_over_mean_image", "parameters",
        "defense_mode")


def folder(spec: str) -> str:
    return spec.replace(":", "-").replace("+", "_")


def train_adaptive(preset: Any, spec: str, epochs: int, train: Path, work: Path
                   ) -> dict[str, Any]:
    fit = copy.deepcopy(preset.attack.decoder_fit)
    fit.defense, fit.extra_frames, fit.epochs = spec, 0, epochs
    out = work / f"decoder@{folder(spec)}"
    return fit_decoder(copy.deepcopy(preset.attack.decoder), fit, [str(train)], out,
                       resume=(out / META).exists(), progress=True)


def attackers_for(spec: str, work: Path) -> dict[str, str]:
    found = {"feature decoder (FC input), adaptive": str(work / f"decoder@{folder(spec)}")}
    found.update({name: str(work / run) for name, run in ZERO_SHOT.items()
                  if (work / run / META).exists()})
    found.update({name: str(work / "defenses" / folder(spec) / run)
                  for name, run in ADAPTIVE_BASELINES.items()
                  if (work / "defenses" / folder(spec) / run / META).exists()})
    return found


def rows(spec: str, result: dict[str, Any], minutes: dict[str, float]) -> list[dict[str, Any]]:
    return [{"defense": spec, "method": name, **{k: row.get(k) for k in KEEP},
             "train_minutes": minutes.get(name)}
            for name, row in result["methods"].items()
            if row["kind"] in ("learned", "rule") or name == "mean training image"]


def markdown(table: list[dict[str, Any]]) -> str:
    cells = [{"defense": r["defense"], "method": r["method"], "mode": r["defense_mode"],
              "PSNR": fixed(r["psnr"], 2), "SSIM": fixed(r["ssim"], 3),
              "gain (dB)": fixed(r["psnr_gain_over_mean_image"], 2),
              "action acc.": fixed(r["action_accuracy"], 3),
              "parameters": None if r["parameters"] is None else f"{r['parameters']:,}",
              "train min": fixed(r["train_minutes"], 1)} for r in table]
    return markdown_table(cells, list(cells[0])) if cells else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, default=Path("runs/bench-attack"))
    parser.add_argument("--preset", default="cpu-bench")
    parser.add_argument("--defenses", default="noise:0.001;quant:8;prune:0.1")
    parser.add_argument("--epochs", type=int, default=3,
                        help="over the captured frames only (about half the preset's frames)")
    parser.add_argument("--max-windows", type=int, default=100)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    preset = load_preset(args.preset)
    train, heldout = args.work / "train.h5", args.work / "heldout.h5"
    specs = [s.strip() for s in args.defenses.split(";") if s.strip()]
    for spec in specs:
        parse_defense(spec)  # a bad spec fails before an hour of training
    table, training, evaluations = [], {}, {}
    for spec in specs:
        result = train_adaptive(preset, spec, args.epochs, train, args.work)
        training[spec] = {k: result[k] for k in ("epochs", "minutes", "parameters", "last")}
        evaluations[spec] = evaluate([heldout], attackers_for(spec, args.work),
                                     args.work / "eval-adaptive" / folder(spec),
                                     max_windows=args.max_windows, defense=parse_defense(spec))
        table += rows(spec, evaluations[spec],
                      {"feature decoder (FC input), adaptive": result["minutes"]})
    summary = {"preset": args.preset, "epochs": args.epochs, "max_windows": args.max_windows,
               "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch "
                          f"{torch.__version__}", "training": training,
               "evaluation": evaluations, "rows": table}
    with atomic_path(args.results) as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
    with atomic_path(args.results.with_suffix(".md")) as tmp:
        tmp.write_text(markdown(table) + "\n")
    print(json.dumps(training, indent=2))


if __name__ == "__main__":
    main()
