"""Recovery through the conv stack on the cpu-bench held-out capture, beside the FC-level decoder.

On --frames evenly spaced held-out steps: each conv input the gradients determine (relative
error against the truth), frames from the deepest one by the smoothness-prior solve, the same
solve from the true map (its ceiling), their mean image, and, on exactly the same frames, the
trained feature decoder that reads only the FC input (--decoder). With --attackers, the learned
decoders are also scored on --max-windows held-out windows as `gradleak evaluate` scores them,
clean and zero-shot under each of --defenses. Writes benchmarks/results/conv_recovery.{json,md}.

    python benchmarks/conv_recovery.py [--frames 64] [--capture runs/bench-attack/heldout.h5]
        [--decoder runs/bench-attack/decoder]
        [--attackers "feature decoder (conv stack)=runs/bench-attack/decoder-conv,..."]
        [--defenses "noise:0.001;agg:4"] [--max-windows 100]

Train the conv-stack decoder with `python benchmarks/structured_vs_dense.py --variants
decoder-conv` or `gradleak train-decoder --set attack.decoder.feature_module=encoder.3 ...`.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradleak.capture.reader import CaptureFile
from gradleak.defenses import parse_defense
from gradleak.evaluation.analytic import score_conv_stack
from gradleak.evaluation.reconstructions import evaluate
from gradleak.io import atomic_path
from gradleak.metrics.images import psnr, ssim, to_unit_tensor
from gradleak.report.tables import markdown_table
from gradleak.training.checkpoint import load_attacker

RESULTS = Path(__file__).parent / "results" / "conv_recovery.json"


def decoder_scores(path: Path, gradients: np.ndarray, images: np.ndarray) -> dict[str, float]:
    model, _ = load_attacker(path)
    with torch.no_grad():
        frames = model(model.recovered_features(torch.from_numpy(gradients).float()))
    truth = to_unit_tensor(images)
    return {"psnr": float(psnr(frames, truth).mean()), "ssim": float(ssim(frames, truth).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--capture", type=Path, default=Path("runs/bench-attack/heldout.h5"))
    parser.add_argument("--decoder", type=Path, default=Path("runs/bench-attack/decoder"))
    parser.add_argument("--attackers", default="", help="NAME=DIR,NAME=DIR: learned decoders")
    parser.add_argument("--defenses", default="", help="';'-separated, zero-shot")
    parser.add_argument("--max-windows", type=int, default=100)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    with CaptureFile(args.capture) as capture:
        observation, target = capture.observation(), capture.target()
    conv = score_conv_stack(observation, target, args.frames)
    rows = np.linspace(0, len(observation) - 1, args.frames).astype(int)
    result = {"capture": str(args.capture), "machine": f"{platform.machine()}, "
              f"{torch.get_num_threads()} torch threads, torch {torch.__version__}",
              "rows": rows.tolist(), **conv}
    if args.decoder.exists():
        result["fc_decoder"] = {"path": str(args.decoder), **decoder_scores(
            args.decoder, observation.gradients[rows], target.images[rows])}
    if args.attackers:
        attackers = dict(item.split("=", 1) for item in args.attackers.split(","))
        result["learned"] = learned_scores(args, attackers)
    print(json.dumps(result, indent=2))
    write(args.results, result)


def learned_scores(args: argparse.Namespace, attackers: dict[str, str]) -> dict[str, Any]:
    """PSNR, SSIM, actions, parameters and ms/frame of each decoder, clean and defended."""
    out = args.capture.parent / "eval-conv"
    scores = {}
    for spec in ["none", *[s for s in args.defenses.split(";") if s]]:
        defense = None if spec == "none" else parse_defense(spec)
        methods = evaluate([args.capture], attackers, out / spec.replace(":", "-"),
                           max_windows=args.max_windows, defense=defense)["methods"]
        scores[spec] = {name: {key: methods[name].get(key) for key in (
            "psnr", "ssim", "action_accuracy", "parameters", "ms_per_frame", "frames",
            "psnr_gain_over_mean_image")} for name in [*attackers, "mean training image"]}
    return scores


def write(path: Path, result: dict) -> None:
    layers = [{"conv input": name, "shape": "×".join(map(str, v["shape"])),
               "median relative error": f"{v['median_relative_error']:.2e}",
               "max relative error": f"{v['max_relative_error']:.2e}"}
              for name, v in result["layers"].items()]
    frames = [{"frames from": f"recovered {result['frames_from']} input (smoothness prior)",
               "PSNR": result["psnr"], "SSIM": result["ssim"]},
              {"frames from": f"true {result['frames_from']} input (its ceiling)",
               "PSNR": result["psnr_from_true_map"], "SSIM": result["ssim_from_true_map"]},
              {"frames from": "their mean image", "PSNR": result["psnr_of_their_mean_image"],
               "SSIM": result["ssim_of_their_mean_image"]}]
    if "fc_decoder" in result:
        frames.insert(2, {"frames from": "FC input, learned decoder (feature decoder)",
                          "PSNR": result["fc_decoder"]["psnr"],
                          "SSIM": result["fc_decoder"]["ssim"]})
    for row in frames:
        row["PSNR"], row["SSIM"] = f"{row['PSNR']:.2f}", f"{row['SSIM']:.3f}"
    text = (f"# Recovery through the conv stack ({result['frames']} held-out frames of "
            f"{result['capture']}; {result['machine']})\n\n"
            + markdown_table(layers, list(layers[0])) + "\n\n"
            + markdown_table(frames, list(frames[0])) + "\n\n"
            f"Recovery {1000 * result['recovery_seconds_per_frame']:.0f} ms/frame, frame solve "
            f"{result['frame_seconds_per_frame']:.2f} s/frame.\n")
    if "learned" in result:
        rows = [{"defense": spec, "method": name, "PSNR": f"{v['psnr']:.2f}",
                 "SSIM": f"{v['ssim']:.3f}",
                 "actions": "-" if v["action_accuracy"] is None
                 else f"{100 * v['action_accuracy']:.1f}%",
                 "parameters": "-" if v["parameters"] is None else f"{v['parameters']:,}",
                 "ms/frame": f"{v['ms_per_frame']:.1f}", "frames": v["frames"]}
                for spec, methods in result["learned"].items() for name, v in methods.items()]
        text += ("\n## Learned decoders on held-out windows (zero-shot under defenses)\n\n"
                 + markdown_table(rows, list(rows[0])) + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(result, indent=2) + "\n")
    with atomic_path(path.with_suffix(".md")) as tmp:
        tmp.write_text(text)


if __name__ == "__main__":
    main()
