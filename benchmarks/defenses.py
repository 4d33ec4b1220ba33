"""The paper's defense grid (Tables 3 and 11) against the cpu-bench attackers, with utility.

For every defense: the clean attackers of benchmarks/trace_vs_lti.py attacked zero-shot (the
paper's protocol), and with --adaptive-minutes M > 0 adaptive ones: each clean attacker
fine-tuned for about M minutes on training-scene gradients under the same defense (Learning to
Invert trains from scratch; fine-tuning fits a CPU budget, and says so in the results). Scores:
MSE, PSNR, SSIM, action accuracy, action-histogram TV for aggregation, and the defense's cost to
the victim's update. Writes benchmarks/results/defenses.{json,md,png}.

    python benchmarks/defenses.py [--work runs/bench-attack] [--max-windows 100]
        [--adaptive-minutes 0] [--only quant:4,noise:0.1]

With --exact the training-free attack (`gradleak attack training-free`) is scored beside the learned
ones on the first --baseline-windows windows of the same defended capture; --attacker
NAME=DIR names attackers other than the cpu-bench ones (e.g. the demo's, under runs/demo):

    python benchmarks/defenses.py --work runs/demo --preset cpu-quick --exact \
        --attacker TRACE=runs/demo/trace --attacker LtI=runs/demo/lti \
        --results benchmarks/results/defenses_demo.json --only "none;noise:1e-06;..."
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

from gradleak.defenses import parse_defense
from gradleak.errors import ConfigError
from gradleak.evaluation.reconstructions import evaluate
from gradleak.io import atomic_path
from gradleak.presets import load_preset
from gradleak.report.tables import fixed, markdown_table
from gradleak.training.checkpoint import META
from gradleak.training.fit import fine_tune_under_defense

RESULTS = Path(__file__).parent / "results" / "defenses.json"
GRID = ["none", "cast:bfloat16", "cast:float16", "quant:8", "quant:4", "quant:2", "prune:0.9",
        "prune:0.5", "prune:0.1", "noise:0.001", "noise:0.01", "noise:0.1", "dpsgd:eps=10",
        "dpsgd:eps=5", "dpsgd:eps=1", "agg:4", "agg:8"]
ATTACKERS = {"TRACE": ("trace", "TRACE-T=8"), "LtI": ("lti", "LtI")}
METRICS = ("mse", "psnr", "psnr_gain_over_mean_image", "ssim", "lpips", "action_accuracy",
           "histogram_tv", "frames")


def slug(spec: str) -> str:
    return spec.replace(":", "-").replace("=", "").replace(",", "_").replace("+", "__")


def adapt(preset: Any, kind: str, clean: Path, spec: str, minutes: float, train: Path,
          out: Path) -> str:
    fine_tune_under_defense(kind, copy.deepcopy(getattr(preset.attack, kind)),
                            copy.deepcopy(getattr(preset.attack, f"{kind}_fit")), clean, spec,
                            minutes, [str(train)], out)
    return str(out)


def rows_of(spec: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, row in result["methods"].items():
        if row["kind"] == "reference" and name not in ("uniform 1/K histogram",
                                                       "mean training image"):
            continue
        rows.append({"defense": spec, "method": name, "mode": row.get("defense_mode", "-"),
                     **{m: row.get(m) for m in METRICS},
                     "utility_cosine": (result.get("utility") or {}).get("cosine"),
                     "utility_relative_error": (result.get("utility") or {}).get(
                         "relative_norm_error")})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    table = [{"defense": r["defense"], "method": r["method"], "mode": r["mode"],
              "MSE": fixed(r["mse"], 4), "PSNR": fixed(r["psnr"], 2),
              "gain vs mean image": fixed(r.get("psnr_gain_over_mean_image"), 2),
              "SSIM": fixed(r["ssim"], 3), "LPIPS": fixed(r.get("lpips"), 3),
              "action acc.": fixed(r["action_accuracy"], 3),
              "hist. TV": fixed(r["histogram_tv"], 3),
              "update cos": fixed(r["utility_cosine"], 3),
              "update rel. err": fixed(r["utility_relative_error"], 3),
              "frames": r.get("frames", "-")} for r in rows]
    return markdown_table(table, list(table[0])) if table else ""


def bar_chart(rows: list[dict[str, Any]], path: Path) -> None:
    from gradleak.report.plots import plot_grouped_bars

    series = {}
    for row in rows:
        if row["psnr"] is not None and row["mode"] != "-":
            series.setdefault(f"{row['method']} ({row['mode']})", {})[row["defense"]] = row["psnr"]
        elif row["psnr"] is not None and row["defense"] == "none":
            series.setdefault(f"{row['method']} (zero-shot)", {})["none"] = row["psnr"]
    plot_grouped_bars(series, path, categories=list(dict.fromkeys(r["defense"] for r in rows)))


def clean_attackers(args: argparse.Namespace, parser: argparse.ArgumentParser
                    ) -> dict[str, Path]:
    if not args.attacker:
        return {name: args.work / folder for name, (_, folder) in ATTACKERS.items()
                if (args.work / folder / META).exists()}
    clean = {}
    for item in args.attacker:
        name, _, folder = item.partition("=")
        if name not in ATTACKERS or not (Path(folder) / META).is_file():
            parser.error(f"--attacker {item}: expected NAME=DIR with NAME one of "
                         f"{', '.join(ATTACKERS)} and DIR an attacker run ({META} in it)")
        clean[name] = Path(folder)
    return clean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, default=Path("runs/bench-attack"))
    parser.add_argument("--preset", default="cpu-bench")
    parser.add_argument("--max-windows", type=int, default=100)
    parser.add_argument("--adaptive-minutes", type=float, default=0.0)
    parser.add_argument("--only", default=None,
                        help="defenses separated by ';' (a spec may hold commas)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--exact", action="store_true",
                        help="score the training-free attack beside the learned ones")
    parser.add_argument("--baseline-windows", type=int, default=2,
                        help="windows the training-free attack reconstructs")
    parser.add_argument("--attacker", action="append", default=[], metavar="NAME=DIR",
                        help="a clean attacker (repeatable; NAME is TRACE or LtI, whose kind "
                        "the adaptive fine-tuning needs); default: the cpu-bench ones in --work")
    args = parser.parse_args()
    preset = load_preset(args.preset)
    grid = args.only.split(";") if args.only else GRID
    heldout, train = args.work / "heldout.h5", args.work / "train.h5"
    clean = clean_attackers(args, parser)
    if not args.results.parent.is_dir():
        parser.error(f"--results {args.results}: its folder does not exist")
    if not heldout.is_file():
        parser.error(f"--work {args.work}: no heldout.h5 in it (a capture of held-out scenes)")
    if args.baseline_windows < 1:
        parser.error("--baseline-windows: expected at least 1 window")
    try:  # every spec checked before any work
        chains = {spec: parse_defense(spec) for spec in grid}
    except ConfigError as error:
        parser.error(f"--only: {error}")
    from gradleak.attacks.exact import NAME as EXACT

    baselines = {EXACT: preset.attack.training_free} if args.exact else None
    rows, runs = [], {}
    for spec, chain in chains.items():
        attackers = {name: str(path) for name, path in clean.items()}
        if args.adaptive_minutes > 0 and spec != "none":
            for name in clean:
                kind = ATTACKERS[name][0]
                attackers[f"{name} (adaptive)"] = adapt(
                    preset, kind, clean[name], spec, args.adaptive_minutes, train,
                    args.work / "defenses" / slug(spec) / kind)
        out = args.work / "defenses" / slug(spec) / "eval"
        result = evaluate([heldout], attackers, out, max_windows=args.max_windows,
                          defense=None if spec == "none" else chain, baselines=baselines,
                          baseline_windows=args.baseline_windows)
        runs[spec] = {"defense": result["defense"], "utility": result["utility"],
                      "windows": result["windows"], "window": result["window"]}
        rows += rows_of(spec, result)
        print(json.dumps(rows_of(spec, result)))
    summary = {"preset": args.preset, "max_windows": args.max_windows,
               "work": str(args.work), "attackers": {k: str(v) for k, v in clean.items()},
               "training_free_windows": args.baseline_windows if args.exact else 0,
               "adaptive_minutes": args.adaptive_minutes,
               "adaptive_protocol": "fine-tuned from the clean attacker under the defense",
               "runs": runs, "rows": rows}
    with atomic_path(args.results) as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
    with atomic_path(args.results.with_suffix(".md")) as tmp:
        tmp.write_text(markdown(rows) + "\n")
    bar_chart(rows, args.results.with_suffix(".png"))


if __name__ == "__main__":
    main()
