"""`gradleak audit`: every applicable attack and the defense grid on one held-out capture,
within a budget, resumable; report.html opens with the verdict."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from gradleak.cli.common import common_flags, emit, progress, set_flag

# exit status when --fail-if holds (2 is an error, as for every command)
FAIL_IF_STATUS = 1


def defenses_from_args(text: str) -> list[str]:
    from gradleak.auditing import GRID

    if text == "grid":
        return list(GRID)
    if text == "none":
        return []
    return [spec.strip() for spec in text.split(";") if spec.strip()]


def run(args: argparse.Namespace) -> int:
    from gradleak.cli.evaluate import attackers_from_args
    from gradleak.auditing import Audit, AuditConfig
    from gradleak.evaluation.verdict import condition_holds, parse_condition
    from gradleak.report.audit import write_audit_report

    condition = parse_condition(args.fail_if) if args.fail_if is not None else None  # first
    config = AuditConfig(capture=args.capture, out=args.out, train=args.train,
                         attackers=attackers_from_args(args) if args.attacker else {},
                         defenses=defenses_from_args(args.defenses), preset=args.preset,
                         overrides=list(args.set or []),
                         budget_minutes=args.budget_minutes, clock=args.clock,
                         max_windows=args.max_windows,
                         training_free_windows=args.training_free_windows,
                         optimisation_windows=args.optimisation_windows,
                         optimisation=[n for n in args.optimisation.split(",") if n],
                         seed=args.seed)
    quiet = args.quiet or args.json
    summary = Audit(config, progress(args),
                    say=(lambda text: None) if quiet else print).run()
    report = write_audit_report(Path(args.out))
    verdict: dict[str, Any] = {**summary["verdict"], "report": str(report),
                               "minutes": summary["minutes"]}
    status = 0
    if condition is not None:
        held, clauses = condition_holds(condition, verdict)
        verdict["fail_if"] = {"condition": args.fail_if, "held": held, "clauses": clauses}
        if held:
            status = FAIL_IF_STATUS
            print(f"gradleak: audit: --fail-if {args.fail_if!r} holds ({'; '.join(clauses)})",
                  file=sys.stderr)
    emit(args, verdict, "\n".join(verdict["headline"]) + f"\nreport: {report}")
    return status


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("audit", help="what a capture's gradients give away, and which defense "
                       "stops it: every attack, the defense grid, report.html with a verdict")
    common_flags(p)
    p.add_argument("--capture", required=True, help="a held-out capture (what the server saw)")
    p.add_argument("--train", default=None,
                   help="a capture of training scenes: the learned attackers are trained on it "
                   "(unless --attacker gives them) and its mean frame is the reference")
    p.add_argument("--attacker", action="append", default=[],
                   help="a trained attacker run, DIR or NAME=DIR (repeatable)")
    p.add_argument("--defenses", default="grid",
                   help="'grid' (the default grid, light to strong), 'none', or specs "
                   "separated by ';' (e.g. \"quant:8;dpsgd:eps=1\")")
    p.add_argument("--budget-minutes", type=float, default=20.0,
                   help="minutes on --clock; stages past it are skipped and named (a rerun "
                   "with a larger budget completes them)")
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                   help="what the budget counts: wall-clock time, or this process's CPU time "
                   "over all its threads (fair when other jobs share the cores)")
    p.add_argument("--preset", default="cpu-quick",
                   help="settings of the attacks and of attacker training")
    set_flag(p)
    p.add_argument("--max-windows", type=int, default=32,
                   help="held-out windows the learned attackers and the references score")
    p.add_argument("--training-free-windows", "--exact-windows", type=int, default=2,
                   dest="training_free_windows", help="windows the training-free attack "
                   "inverts")
    p.add_argument("--optimisation-windows", type=int, default=1,
                   help="windows DLG and IG invert (0: none)")
    p.add_argument("--optimisation", default="dlg,ig",
                   help="optimisation baselines, comma-separated (dlg, ig, dlg-probe, ig-probe)")
    p.add_argument("--seed", type=int, default=0, help="the defenses' noise")
    p.add_argument("--fail-if", default=None,
                   help="exit 1 when this holds on the clean figures, e.g. \"psnr>25 or "
                   "actions>0.5\" (metrics: psnr, ssim, lpips, gain, actions, advantages, "
                   "returns); a clause whose metric the audit could not measure holds. "
                   "Without it the exit status is 0 whenever the audit ran")
    p.add_argument("--out", required=True)
    p.set_defaults(func=run)
