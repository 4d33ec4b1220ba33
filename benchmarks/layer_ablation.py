"""What each layer adds: the same decoder family on each conv input the gradient determines.

The closed-form recursion (`gradleak.inversion.conv_recovery`) reaches the FC input (32×4×4 for
cnn-small at 64×64), the inputs of the last two convs (32×8×8) and the second conv's input
(16×16×16). Decoders trained identically on each (the cpu-bench captures' 19,400 frames, no
rendered frames, 2 epochs, widest stage 32 channels, no dense path) and scored together on
--max-windows held-out windows as `gradleak evaluate` scores them say how much each step down
the stack is worth. Writes benchmarks/results/layer_ablation.{json,md}.

Train the decoders with `gradleak train-decoder --data runs/bench-attack/train.h5 --preset
cpu-bench --extra-frames 0 --epochs 2 --set attack.decoder.global_channels=0 --set
attack.decoder.channels=32 [--set attack.decoder.feature_module=encoder.6|encoder.3] --out DIR`.

    python benchmarks/layer_ablation.py [--work runs/bench-attack] [--max-windows 100]
        [--decoders decoder-fc-2ep,decoder-conv6-2ep,decoder-conv-2ep]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

import torch

from gradleak.evaluation.reconstructions import evaluate
from gradleak.io import atomic_path, read_json
from gradleak.report.tables import fixed, markdown_table
from gradleak.training.checkpoint import META

RESULTS = Path(__file__).parent / "results" / "layer_ablation.json"
DEFAULT = "decoder-fc-2ep,decoder-conv6-2ep,decoder-conv-2ep"


def label(meta: dict[str, Any]) -> str:
    model = meta["model"]
    return f"{model['feature_module']} input ({'×'.join(map(str, model['feature_shape']))})"


def row(name: str, meta: dict[str, Any], scores: dict[str, Any]) -> dict[str, Any]:
    return {"decoder": name, "input": label(meta), "psnr": scores["psnr"],
            "ssim": scores["ssim"], "gain": scores["psnr_gain_over_mean_image"],
            "action_accuracy": scores["action_accuracy"], "parameters": scores["parameters"],
            "train_minutes": sum(r["train_minutes"] for r in meta["history"]),
            "validation_psnr": meta["history"][-1]["val_psnr"],
            "ms_per_frame": scores["ms_per_frame"]}


def markdown(rows: list[dict[str, Any]], mean: dict[str, Any]) -> str:
    cells = [{"input the decoder reads": r["input"], "PSNR": fixed(r["psnr"], 2),
              "SSIM": fixed(r["ssim"], 3), "gain (dB)": fixed(r["gain"], 2),
              "action acc.": fixed(r["action_accuracy"], 3),
              "parameters": f"{r['parameters']:,}", "train min": fixed(r["train_minutes"], 1),
              "ms/frame": fixed(r["ms_per_frame"], 1)} for r in rows]
    cells.append({"input the decoder reads": "mean training image",
                  "PSNR": fixed(mean["psnr"], 2), "SSIM": fixed(mean["ssim"], 3)})
    return markdown_table(cells, list(cells[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, default=Path("runs/bench-attack"))
    parser.add_argument("--decoders", default=DEFAULT)
    parser.add_argument("--max-windows", type=int, default=100)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    names = [n for n in args.decoders.split(",") if n]
    metas = {name: read_json(args.work / name / META, "decoder run") for name in names}
    result = evaluate([args.work / "heldout.h5"], {n: str(args.work / n) for n in names},
                      args.work / "eval-layers", max_windows=args.max_windows)
    rows = [row(n, metas[n], result["methods"][n]) for n in names]
    mean = result["methods"]["mean training image"]
    summary = {"max_windows": args.max_windows, "rows": rows,
               "mean_image": {"psnr": mean["psnr"], "ssim": mean["ssim"]},
               "fits": {n: metas[n]["fit"] for n in names},
               "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch "
                          f"{torch.__version__}"}
    with atomic_path(args.results) as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
    with atomic_path(args.results.with_suffix(".md")) as tmp:
        tmp.write_text(markdown(rows, mean) + "\n")
    print(markdown(rows, mean))


if __name__ == "__main__":
    main()
