"""`gradleak experiment NAME`: a registered grid of cells, resumable, shardable, merged."""

from __future__ import annotations

import argparse
from pathlib import Path

from gradleak.cli.common import common_flags, emit, progress, set_flag

RESULTS = Path("benchmarks") / "results"
# the registered experiments, named in --help without importing them (a second per call);
# tests/test_cli.py checks this against gradleak.experiments.EXPERIMENTS
NAMES = ("table1", "fewshot", "context", "components", "losses", "auxscale", "defense-figure")


def run(args: argparse.Namespace) -> None:
    from gradleak.experiments import ExperimentSettings, merge_experiment, run_experiment

    out = Path(args.out)
    if args.merge:
        paths = merge_experiment(out, Path(args.results), allow_partial=args.allow_partial)
        emit(args, {"json": str(paths[0]), "markdown": str(paths[1])},
             f"merged {out} -> {paths[0]}, {paths[1]}")
        return
    settings = ExperimentSettings(args.name, seeds=args.seeds,
                                  budget_minutes=args.budget_minutes, clock=args.clock,
                                  preset=args.preset, overrides=list(args.set or []))
    result = run_experiment(settings, out, resume=args.resume, shard=args.shard,
                            progress=progress(args),
                            shared=Path(args.shared) if args.shared else None,
                            import_from=Path(args.import_cells) if args.import_cells else None,
                            where=args.where)
    emit(args, result, f"{args.name} shard {result['shard']}: imported "
                       f"{len(result['imported'])}, "
                       f"ran {len(result['ran'])} of "
                       f"{result['cells_in_shard']} cells"
                       + (f" ({len(result['running_elsewhere'])} running in another process)"
                          if result["running_elsewhere"] else "")
                       + f"; {len(result['missing_in_grid'])} missing in the whole grid -> {out}")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("experiment", help="run a registered experiment grid cell by cell "
                       "(--resume, --shard I/N), or --merge it into benchmarks/results")
    common_flags(p)
    p.add_argument("name", help=f"the experiment: {', '.join(NAMES)}, or one a --plugin "
                   "registers (see docs/experiments.md)")
    p.add_argument("--out", required=True, help="the run folder, e.g. runs/exp/NAME")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--budget-minutes", type=float, default=5.0,
                   help="per cell, for what it trains (default 5)")
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                   help="what the budget counts: this process's CPU time (default), or wall")
    p.add_argument("--preset", default="cpu-bench",
                   help="cpu-quick, cpu-bench (default) or paper")
    set_flag(p)
    p.add_argument("--resume", action="store_true", help="run only the missing cells")
    p.add_argument("--import-cells", metavar="RESULTS_JSON",
                   help="first take the finished cells of an earlier session's merged result "
                   "(benchmarks/results/NAME.json, same settings) and run only the rest")
    p.add_argument("--shard", metavar="I/N", help="run every N-th cell from the I-th (one "
                   "process or machine per shard, same --out)")
    p.add_argument("--where", action="append", metavar="AXIS=V1,V2",
                   help="run only the cells with these values on that axis (repeatable), e.g. "
                   "--where defense=noise:0.01,noise:0.1 --where window=1,8; a slice first, "
                   "the rest later into the same --out")
    p.add_argument("--shared", help="where victims and captures cells share live (default "
                   "OUT/shared); one root for several experiments trains each victim once "
                   "(keyed by the preset's env, train and capture sections)")
    p.add_argument("--merge", action="store_true",
                   help="write RESULTS/NAME.json and .md from the finished cells")
    p.add_argument("--allow-partial", action="store_true",
                   help="with --merge: merge although cells are missing (named in the files)")
    p.add_argument("--results", default=str(RESULTS))
    p.set_defaults(func=run)
