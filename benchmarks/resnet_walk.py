"""Where the training-free attack breaks on a ResNet: what one step's gradient gives back of the
last basic block when global average pooling hides the positions.

ResNet-8 (`resnet8`) ends in o = relu(BN₁(conv₁(relu(BN₀(conv₀ x)))) + skip(x)), averaged over
the map into the FC input. From the float32 wire and θ0 alone:

- the FC input, each channel's mean of o, in closed form; the gradient reaching o is that
  channel's g_c / (h·w) at every position, so δ at o's pre-activation is g_c / (h·w) · [o > 0],
  with the ReLU's on-units (the mask) unknown: the positions are what the pooling hides;
- BN₁'s bias gradient Σ_p δ(p) = g_c / (h·w) · |on_c| gives each channel's count of on-units
  exactly, but not which ones: log₂ C(h·w, |on_c|) bits a channel stay open;
- given the mask (an oracle: read from the private frames), conv₁'s weight-gradient equations
  (9·C rows against h·w entries a channel) give conv₁'s input, relu(BN₀(conv₀ x)), to the
  wire's precision, and the walk could go on from there.

Random-init victim, held-out steps of a cpu-quick capture; relative errors against the
victim's own activations. Writes benchmarks/results/resnet_walk.{json,md}.

    python benchmarks/resnet_walk.py [--work runs/resnet-walk] [--steps 16]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from exact_frames import Case, capture
from host import machine, write_results

from gradleak.capture.reader import CaptureFile
from gradleak.inversion.layers.base import Known
from gradleak.inversion.layers.conv import Conv
from gradleak.inversion.layers.linear import Linear
from gradleak.inversion.layers.residual import ConvAt
from gradleak.report.tables import markdown_table
from gradleak.victims.base import victim_at_theta0

RESULTS = Path(__file__).parent / "results" / "resnet_walk.json"
CASE = Case("resnet8 random init", "resnet8", "cpu-quick", True)


def activations(victim: Any, frames: torch.Tensor, block: str) -> dict[str, torch.Tensor]:
    """The last block's input, conv₁'s input and the block's output (truth)."""
    found: dict[str, torch.Tensor] = {}
    module = victim.get_submodule(block)
    hooks = [module.register_forward_hook(lambda m, i, o: found.update(x=i[0], o=o)),
             module.conv1.register_forward_hook(lambda m, i, o: found.update(b=i[0]))]
    with torch.no_grad():
        victim.features(frames)
    for hook in hooks:
        hook.remove()
    return {key: value.double() for key, value in found.items()}


def walk_step(victim: Any, gradient: Any, truth: dict[str, torch.Tensor], block: str,
              step: int) -> dict[str, Any]:
    module = victim.get_submodule(block)
    channels, (height, width) = truth["o"].shape[1], truth["o"].shape[2:]
    one = lambda name: gradient(name)[step:step + 1]  # noqa: E731
    top = Linear("fc", victim.fc).invert(None, one)
    means, g = top.value[0], top.gradient[0]
    on = truth["o"][step] > 0  # the oracle's mask
    counts_true = on.flatten(1).sum(1).double()
    # BN₁'s β: Σ_p δ(p) = g_c / (h·w) · |on_c|
    beta = one(f"{block}.norm1.bias")[0].double()
    per_unit = g / (height * width)
    usable = per_unit.abs() > 1e-12 * per_unit.abs().max()
    counts = torch.where(usable, beta / torch.where(usable, per_unit, 1.0), torch.nan)
    exact_counts = (counts[usable].round() == counts_true[usable]).double().mean()
    bits = sum(math.log2(math.comb(height * width, int(c))) for c in counts_true.tolist())
    # with the oracle's mask: δ at BN₁'s output, through BN₁'s gain to conv₁'s output
    norm = module.norm1
    gain = (norm.weight / (norm.running_var + norm.eps).sqrt()).detach().double()
    delta = (per_unit[:, None, None] * on * gain[:, None, None])[None]
    conv1 = ConvAt(f"{block}.conv1", module.conv1, (height, width))
    weight_gradient = one(f"{block}.conv1.weight").double()
    found = Conv(conv1).invert(Known(torch.zeros_like(delta), torch.zeros_like(delta), delta),
                               {f"{block}.conv1.weight": weight_gradient}.__getitem__)
    b, true_b = found.value[0], truth["b"][step]
    return {"fc_input": float((means - truth["o"][step].mean((1, 2))).norm()
                              / truth["o"][step].mean((1, 2)).norm()),
            "on_fraction": float(on.double().mean()),
            "counts_exact": float(exact_counts), "open_bits": bits,
            "channels": channels, "positions": height * width,
            "conv1_equations_per_channel": 9 * channels,
            "conv1_input_with_oracle_mask": float((b - true_b).norm() / true_b.norm())}


def run(path: Path, steps: int) -> dict[str, Any]:
    with CaptureFile(path) as file:
        rows = np.arange(min(steps, len(file)))
        observation, target = file.observation(rows), file.target(rows)
    victim = victim_at_theta0(observation).double().eval()
    frames = torch.from_numpy(target.images.astype(np.float64))
    block = "encoder.5"
    truth = activations(victim, frames, block)

    def gradient(name: str) -> torch.Tensor:
        return torch.from_numpy(observation.block(name).astype(np.float64))

    walks = [walk_step(victim, gradient, truth, block, int(step)) for step in rows]
    summary = {key: float(np.median([w[key] for w in walks])) for key in walks[0]}
    return {"victim": CASE.victim, "frame": list(target.images.shape[1:3]), "block": block,
            "steps": len(rows), "median": summary}


def markdown(result: dict[str, Any]) -> str:
    m = result["median"]
    rows = [{"what": "FC input (each channel's mean of the last map), closed form",
             "median": f"{m['fc_input']:.1e} relative error"},
            {"what": "units of the last ReLU that are on",
             "median": f"{m['on_fraction']:.0%} of {int(m['positions'])} positions"},
            {"what": "each channel's count of on-units, from BN₁'s bias gradient",
             "median": f"{m['counts_exact']:.0%} of channels exact"},
            {"what": "which units: what the counts n_c leave open, log₂ Π C(h·w, n_c)",
             "median": f"{m['open_bits']:.0f} bits"},
            {"what": f"conv₁'s input given the true mask ({int(m['conv1_equations_per_channel'])}"
                     f" equations for {int(m['positions'])} entries a channel)",
             "median": f"{m['conv1_input_with_oracle_mask']:.1e} relative error"}]
    return "\n".join([
        f"# Where the training-free attack breaks on ResNet-8 ({result['machine']})", "",
        f"{result['victim']} at {result['frame'][0]}×{result['frame'][1]}, random init, "
        f"{result['steps']} held-out steps, float32 wire; the last basic block "
        f"({result['block']}). Global average pooling hands over each channel's mean and "
        "the count of its on-units, not their positions; given the positions (an oracle), the "
        "block's equations are full rank again.", "", markdown_table(rows, ["what", "median"]), ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="runs/resnet-walk")
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine(), **run(capture(CASE, "float32", args.steps, work),
                                          args.steps)}
    write_results(RESULTS, result, markdown(result))


if __name__ == "__main__":
    main()
