"""`gradleak recover-actions`: the closed-form action rules and their accuracy."""

from __future__ import annotations

import argparse
from typing import Any

from gradleak.cli.common import common_flags, emit, nonfinite_flag


def action_table(results: dict[str, dict[str, Any]]) -> str:
    from gradleak.report.tables import text_table

    rows = [{"rule": rule + (" (oracle sign of A)" if r["oracle_advantage_sign"] else ""),
             "accuracy": r["accuracy"], "n": r["n"]} for rule, r in results.items()]
    return text_table(rows, ["rule", "accuracy", "n"])


def run(args: argparse.Namespace) -> None:
    from gradleak.evaluation import evaluate_action_rules
    from gradleak.report.tables import text_table

    rules = [r for r in args.rule.split(",") if r]
    results = evaluate_action_rules(args.files, rules, args.skip_nonfinite)
    data = results[rules[0]] if len(rules) == 1 else results
    text = action_table(results) + "\n\n" + text_table(
        [row for row in results[rules[0]]["by_confidence"]], ["by", "low", "high", "n",
                                                             "accuracy"])
    emit(args, data, text)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recover-actions", help="closed-form action recovery and its accuracy")
    common_flags(p)
    nonfinite_flag(p)
    p.add_argument("files", nargs="+")
    p.add_argument("--rule", default="odd-sign",
                   help="odd-sign, sign-agnostic, sign-aware (oracle sign), comma-separated")
    p.set_defaults(func=run)
