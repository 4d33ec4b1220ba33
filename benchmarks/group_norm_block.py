"""The Conv → GroupNorm → ReLU block inverse (`gradleak.inversion.layers.group_norm`) on
one-sample steps: how exactly each step's input and group statistics come back from the float32
gradient, how many Gauss-Newton steps the block's equations take, and how long, at 1, 8 and 32
groups (32: two channels a group, where the conv's bias alone pins the scale).

The block reads a real feature map: 32×32 photo crops (the embedded CIFAR stand-in) through a
random-init 5×5 stride-2 conv and a ReLU, then the block (3×3 conv 32 → 64 on 16×16, GroupNorm
with G groups and a random affine, ReLU) and a Linear head; each step is one image and its
label, its gradient rounded to float32 (the wire). Random init throughout.
Writes benchmarks/results/group_norm_block.{json,md}.

    python benchmarks/group_norm_block.py [--seeds 4] [--steps 4] [--groups 1 8 32]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gradleak.fedavg.datasets import photos
from gradleak.inversion.layers import Known
from gradleak.inversion.layers.group_norm import GroupNormBlock
from gradleak.report.tables import markdown_table

from host import machine, write_results

RESULTS = Path(__file__).parent / "results" / "group_norm_block.json"
GROUPS = (1, 8, 32)
COLUMNS = ["groups G", "input error (median)", "input error (max)", "steps ≤ 1e-5",
           "σ_g error (max)", "Gauss-Newton steps (median / max)", "ms / step"]


@dataclass(frozen=True)
class Layer:
    name: str
    conv: nn.Conv2d
    input_shape: tuple[int, int]


def run(groups: int, seed: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    stem = nn.Conv2d(3, 32, 5, 2, 2).double()
    conv = nn.Conv2d(32, 64, 3, 1, 1).double()
    norm = nn.GroupNorm(groups, 64).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.2, 0.2)
    head = nn.Linear(64 * 16 * 16, 10).double()
    data = photos()
    index = np.random.default_rng(seed).choice(len(data.labels), steps, replace=False)
    images, labels = data.images[index].double(), data.labels[index]
    with torch.no_grad():
        x = F.relu(stem(images))
    outputs, reaching, weight_gradients = [], [], []
    for step in range(steps):
        output = F.relu(norm(conv(x[step:step + 1])))
        loss = F.cross_entropy(head(output.flatten(1)), labels[step:step + 1])
        weight_gradient, at_output = torch.autograd.grad(loss, [conv.weight, output])
        outputs.append(output.detach())
        reaching.append(at_output)
        weight_gradients.append(weight_gradient.float().double())  # the float32 wire
    value = torch.cat(outputs)
    layer = Layer("conv", conv.requires_grad_(False), (16, 16))
    inverse = GroupNormBlock(layer, norm)
    start = time.perf_counter()
    fit = inverse.fit(Known(value, torch.zeros_like(value), torch.cat(reaching)),
                      {"conv.weight": torch.stack(weight_gradients)}.__getitem__)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        true = conv(x).reshape(steps, groups, -1)
    sd = (true.var(2, unbiased=False) + norm.eps).sqrt()
    error = ((fit.input.value - x).flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1))
    return {"groups": groups, "seed": seed, "newton": fit.newton.tolist(),
            "input_error": error.tolist(),
            "sd_error": ((fit.sd - sd).abs() / sd).amax(1).tolist(),
            "residual": fit.residual.tolist(), "ms_per_step": 1000 * seconds / steps}


def markdown(result: dict[str, Any]) -> str:
    rows = []
    for groups in GROUPS:
        runs = [r for r in result["runs"] if r["groups"] == groups]
        if not runs:
            continue
        errors = np.concatenate([r["input_error"] for r in runs])
        newton = np.concatenate([r["newton"] for r in runs])
        rows.append(dict(zip(COLUMNS, [
            f"{groups}", f"{np.median(errors):.1e}", f"{np.max(errors):.1e}",
            f"{int((errors <= 1e-5).sum())} of {len(errors)}",
            f"{max(max(r['sd_error']) for r in runs):.1e}",
            f"{np.median(newton):.0f} / {np.max(newton)}",
            f"{np.median([r['ms_per_step'] for r in runs]):.0f}"], strict=True)))
    table = markdown_table(rows, COLUMNS)
    return (f"# The Conv → GroupNorm → ReLU block inverse ({result['machine']})\n\n"
            f"{result['seeds']} random-init blocks × {result['steps']} steps per row, each "
            "step one 32×32 photo crop, its float32 gradient; the block's conv 32 → 64 (3×3) "
            "reads a 16×16 map, GroupNorm over 64 channels. Input error: the recovered conv "
            "input against the true one (relative, per step); σ_g error: the largest relative "
            "error of a group's deviation. The first solve (r̂ at the off-units guessed) is "
            "the start; Gauss-Newton on the block's equations in its input finishes.\n\n"
            + table + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--groups", type=int, nargs="+", default=list(GROUPS))
    args = parser.parse_args()
    runs = []
    for groups in args.groups:
        for seed in range(args.seeds):
            runs.append(run(groups, seed, args.steps))
            print(groups, seed, runs[-1]["newton"], f"{max(runs[-1]['input_error']):.1e}",
                  f"{runs[-1]['ms_per_step']:.0f} ms", flush=True)
    result = {"machine": machine(), "seeds": args.seeds, "steps": args.steps, "runs": runs}
    write_results(RESULTS, result, markdown(result))


if __name__ == "__main__":
    main()
