"""`gradleak closed-form` (also read as `analytic`): closed-form recovery of layer inputs, π,
V, a, A, R, and frames through the conv stack."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gradleak.cli.common import common_flags, emit, nonfinite_flag
from gradleak.metrics.lpips import PIP_COMMAND
from gradleak.names import COMMAND_ALIASES


def conv_stack_lines(conv: dict[str, Any]) -> list[str]:
    errors = ", ".join(f"{name} {v['median_relative_error']:.1e}"
                       for name, v in conv["layers"].items())
    solves = conv["solves"]
    return [f"  through the conv stack ({conv['frames']} steps, "
            f"{1000 * conv['recovery_seconds_per_frame']:.0f} ms/frame), conv inputs (median "
            f"relative error): {errors}",
            f"  frames from the first conv's equations ({conv['equations_per_unknown']:.2f} per "
            f"unknown): PSNR {conv['psnr']:.2f} dB, SSIM {conv['ssim']:.3f}{lpips_text(conv)} "
            f"({conv['frame_seconds_per_frame']:.2f} s/frame); from the true map "
            f"{conv['psnr_from_true_map']:.2f} / {conv['ssim_from_true_map']:.3f}; without the "
            f"weight-gradient equations {solves['without_weight_gradient']['psnr']:.2f}; their "
            f"mean image "
            f"{conv['psnr_of_their_mean_image']:.2f} / {conv['ssim_of_their_mean_image']:.3f}"]


def lpips_text(scores: dict[str, Any]) -> str:
    return f", LPIPS {scores['lpips']:.3f}" if "lpips" in scores else \
        f" (LPIPS unavailable: {PIP_COMMAND})"


def summary_lines(path: str, r: dict[str, Any]) -> list[str]:
    layers = ", ".join(f"{name} {v['median_relative_error']:.2e}"
                       for name, v in r["layer_inputs"].items())
    lines = [f"{path}: {r['rows']} steps; action {100 * r['action_accuracy']:.2f}%; "
             f"max |Δπ| {r['probs_max_abs_error']:.2e}, |ΔV| {r['values_max_abs_error']:.2e}, "
             f"|ΔA| {r['advantage_max_abs_error']:.2e}, |ΔR| {r['returns_max_abs_error']:.2e}; "
             f"layer inputs (median relative error): {layers}"]
    if "feature_inversion" in r:
        inv = r["feature_inversion"]
        lines.append(f"  frames from the conv features by optimisation ({inv['frames']}): PSNR "
                     f"{inv['psnr']:.2f} dB (their mean image "
                     f"{inv['psnr_of_their_mean_image']:.2f}), SSIM {inv['ssim']:.3f}"
                     f"{lpips_text(inv)}, "
                     f"{inv['seconds_per_frame']:.2f} s/frame")
    if "conv_stack" in r:
        lines += conv_stack_lines(r["conv_stack"])
    return lines


def run(args: argparse.Namespace) -> None:
    from gradleak.evaluation.analytic import evaluate_analytic

    results = evaluate_analytic(args.files, args.max_rows, args.invert, args.conv,
                                args.skip_nonfinite, say=lambda line: None if args.quiet else
                                print(f"closed-form: {line}", file=sys.stderr, flush=True))
    emit(args, results, "\n".join(line for path, r in results.items()
                                  for line in summary_lines(path, r)))


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("closed-form", aliases=COMMAND_ALIASES["closed-form"],
                       help="closed-form recovery of layer inputs, π, V, a, A, R")
    common_flags(p)
    nonfinite_flag(p)
    p.add_argument("files", nargs="+", help="capture files")
    p.add_argument("--max-rows", type=int, default=None)
    p.add_argument("--invert", type=int, default=0, metavar="N",
                   help="also reconstruct N frames from the recovered conv features")
    p.add_argument("--conv", type=int, default=0, metavar="N",
                   help="also recover every determined conv input on N steps, and frames "
                        "from the deepest")
    p.set_defaults(func=run)
