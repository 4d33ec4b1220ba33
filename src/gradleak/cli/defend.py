"""`gradleak defend`: a defended copy of a capture file."""

from __future__ import annotations

import argparse

from gradleak.cli.common import (
    common_flags,
    defense_flags,
    defense_from_args,
    emit,
    nonfinite_flag,
    progress,
)


def run(args: argparse.Namespace) -> None:
    from gradleak.defenses.files import defend_capture

    result = defend_capture(args.input, defense_from_args(args), args.out, args.overwrite,
                            progress=progress(args), skip_nonfinite=args.skip_nonfinite)
    last = result["defenses"][-1]
    extras = "".join(f", {t['name']}: σ = {t['sigma']:.4g}, ε = {t['achieved_eps']:.3g}"
                     for t in last["transforms"] if t["name"] == "dpsgd")
    emit(args, result, f"{result['rows']} gradients defended with {last['spec']}{extras} -> "
         f"{result['out']}")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("defend", help="write a defended copy of a capture file")
    common_flags(p)
    nonfinite_flag(p)
    p.add_argument("input", help="a capture file")
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true")
    defense_flags(p, required=True)
    p.set_defaults(func=run)
