"""How far down an IMPALA stack one step's gradient determines the activations exactly.

The paper's IMPALA stage is conv → GroupNorm → 3×3 max-pool (stride 2) → two residual blocks
(x + conv1(relu(conv0(relu(x))))); three stages, a final ReLU, then FC. No attack reaches its
frames today (the training-free attack refuses the GroupNorm; IG stays at 8 dB). This measures
the first levels of a walk down the stack, from the observed (float32) per-step gradients and
θ0 alone, on random-init victims at the sizes the paper and the CPU presets use:

- the FC input u = relu(out₃) in closed form, so δ at the last stage's output is exact;
- each residual block of the last stage, top down: conv1's input b from its own weight
  gradient Σ_p δ(p) patch_p(b)ᵀ, a least-squares solve per input channel (9·C equations for the
  H·W entries of that channel: its rank is reported), then δ at conv0's output, conv0's input
  relu(x) the same way, and the block input x wherever the block's output or relu(x) gives it;
- the stage's pooled map (the first block's input) as far as those equations give it;
- below it (GroupNorm, the max-pool's switches, the stage's first conv, then the stage beneath),
  the equations a solve would have: their count and, with the true δ (an oracle, read from the
  private frames), the rank they could reach at best.

Relative errors are against the victim's own activations on the private frames (scoring only).
Writes benchmarks/results/impala_walk.{json,md}.

    python benchmarks/impala_walk.py [--work runs/impala-walk] [--steps 16]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from host import machine, write_results

from gradleak.capture.reader import CaptureFile
from gradleak.capture.run import CaptureJob, run_capture
from gradleak.inversion.layers.base import Known
from gradleak.inversion.layers.conv_equations import TapOperator
from gradleak.inversion.layers.linear import Linear
from gradleak.inversion.layers.residual import ConvAt, ResidualBlock
from gradleak.presets import load_preset
from gradleak.report.tables import markdown_table
from gradleak.victims.base import victim_at_theta0

RESULTS = Path(__file__).parent / "results" / "impala_walk.json"


@dataclass(frozen=True)
class Case:
    victim: str
    preset: str
    size: int


CASES = [Case("impala-small", "cpu-quick", 64), Case("impala-wide-small", "cpu-quick", 64),
         Case("impala", "paper", 84), Case("impala-wide", "paper", 84)]


def capture(case: Case, work: Path, steps: int) -> Path:
    path = work / f"{case.victim}-{case.size}-random.h5"
    if not path.exists():
        preset = load_preset(case.preset, [f"train.victim={case.victim}",
                                           "capture.gradient_dtype=float32"])
        run_capture(CaptureJob(victim=case.victim, random_init=True, split="heldout",
                               steps=steps, out=path, preset=preset, progress=False, seed=11))
    return path


def rank(conv: ConvAt, delta: torch.Tensor) -> int:
    """The rank of one input channel's weight-gradient equations D(δ) (9·C rows)."""
    return int(torch.linalg.matrix_rank(TapOperator.of(conv, delta[None]).dense()[0]))


def relative(estimate: torch.Tensor, truth: torch.Tensor, where: torch.Tensor | None = None
             ) -> float:
    if where is not None:
        estimate, truth = estimate[where], truth[where]
    return float((estimate - truth).norm() / truth.norm().clamp_min(1e-30))


def activations(victim: Any, frames: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every conv's input and output and each residual block's input and output (truth)."""
    found: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in victim.named_modules():
        if isinstance(module, (torch.nn.Conv2d, torch.nn.GroupNorm, torch.nn.MaxPool2d)) or \
                type(module).__name__ == "ResidualBlock":
            hooks.append(module.register_forward_hook(
                lambda m, i, o, name=name: found.update({f"{name}:in": i[0].detach(),
                                                         f"{name}:out": o.detach()})))
    with torch.no_grad():
        victim(frames)
    for hook in hooks:
        hook.remove()
    return found


def walk_step(victim: Any, block: Any, truth: dict[str, torch.Tensor], step: int
              ) -> dict[str, Any]:
    """One step's walk down the last stage by the residual block's inverse
    (`inversion.layers.residual`), against the truth of that step."""
    fc, stages = victim.fc, victim.encoder
    last = len(stages) - 1
    channels = stages[last][0].out_channels
    size = int(round((fc.in_features / channels) ** 0.5))
    top = Linear("fc", fc).invert(None, lambda name: block(name)[step:step + 1])
    u, g_u = top.value.view(1, channels, size, size), top.gradient.view(1, channels, size, size)
    on = u > 0  # the stage output is known where relu(out) is positive
    known = Known(torch.where(on, u, torch.nan), torch.where(on, top.noise.view_as(u), torch.inf),
                  g_u * on)
    row: dict[str, Any] = {"fc_input": relative(u.flatten(), truth["fc:in"][step])}
    levels = []
    for index in (4, 3):  # the residual blocks, top down
        name = f"encoder.{last}.{index}"
        module = stages[last][index]
        convs = [ConvAt(f"{name}.conv{i}", getattr(module, f"conv{i}"), (size, size))
                 for i in (0, 1)]
        parts = ResidualBlock(*convs).parts(known, lambda n: block(n)[step:step + 1])
        x = parts.input.value[0]
        found = torch.isfinite(x)
        levels.append({"block": name, "unknowns_per_channel": size * size,
                       "equations_per_channel": 9 * channels,
                       "rank_conv1": rank(convs[1], known.gradient[0]),
                       "rank_conv0": rank(convs[0], parts.conv0_output.gradient[0]),
                       "conv1_input": relative(parts.conv0_output.value[0],
                                               truth[f"{name}.conv1:in"][step]),
                       "conv0_input": relative(parts.conv0_input.value[0],
                                               truth[f"{name}.conv0:in"][step]),
                       "input_known": float(found.double().mean()),
                       "input": relative(x, truth[f"{name}:in"][step], found)})
        known = parts.input
    row["blocks"] = levels
    row["pooled_map_known"] = levels[-1]["input_known"]
    row["pooled_map"] = levels[-1]["input"]
    return row


def below(victim: Any, truth: dict[str, torch.Tensor], frames: torch.Tensor, step: int
          ) -> list[dict[str, Any]]:
    """The levels beneath the last stage's pooled map: for each conv, its equations per input
    channel against the unknowns, and the rank they reach with the true δ (an oracle; δ of the
    policy's log-partition plus the value, which has the step's own ReLU masks and switches)."""
    stages = victim.encoder
    grads: dict[str, torch.Tensor] = {}
    hooks = [m.register_full_backward_hook(lambda m, gi, go, n=n: grads.update({n: go[0]}))
             for n, m in victim.named_modules() if isinstance(m, torch.nn.Conv2d)]
    value = victim.value_head(victim.features(frames[step:step + 1])).sum() + \
        victim.policy_head(victim.features(frames[step:step + 1])).logsumexp(-1).sum()
    victim.zero_grad()
    value.backward()
    for hook in hooks:
        hook.remove()
    levels = []
    for s in range(len(stages) - 1, -1, -1):
        names = [f"encoder.{s}.{i}.conv{j}" for i in (4, 3) for j in (1, 0)] + [f"encoder.{s}.0"]
        for name in names if s < len(stages) - 1 else names[-1:]:
            x = truth[f"{name}:in"][step]
            delta = grads[name][0].double()
            if delta.shape[-1] != x.shape[-1]:  # only the 3×3, padding-1 convs here
                continue
            conv = ConvAt(name, victim.get_submodule(name), tuple(x.shape[-2:]))
            levels.append({"conv": name, "unknowns_per_channel": x.shape[-1] ** 2,
                           "equations_per_channel": 9 * delta.shape[0],
                           "rank_true_delta": rank(conv, delta)})
    return levels


def run_case(case: Case, path: Path, steps: int) -> dict[str, Any]:
    with CaptureFile(path) as file:
        rows = np.arange(min(steps, len(file)))
        observation, target = file.observation(rows), file.target(rows)
    victim = victim_at_theta0(observation).double().eval()
    frames = torch.from_numpy(target.images.astype(np.float64))
    truth = {key: value.double() for key, value in activations(victim, frames).items()}
    truth["fc:in"] = victim.encoder(victim.prepare_image(frames)).relu().flatten(1).detach()

    def block(name: str) -> torch.Tensor:
        return torch.from_numpy(observation.block(name).astype(np.float64))

    with torch.no_grad():
        walks = [walk_step(victim, block, truth, int(step)) for step in rows]
    levels = below(victim, truth, frames, 0)
    blocks = [{key: (float(np.median([w["blocks"][i][key] for w in walks]))
                     if isinstance(walks[0]["blocks"][i][key], float)
                     else walks[0]["blocks"][i][key]) for key in walks[0]["blocks"][i]}
              for i in range(len(walks[0]["blocks"]))]
    for i, entry in enumerate(blocks):
        entry["rank_conv1_min"] = min(w["blocks"][i]["rank_conv1"] for w in walks)
        entry["rank_conv0_min"] = min(w["blocks"][i]["rank_conv0"] for w in walks)
    return {"victim": case.victim, "size": case.size, "steps": len(rows),
            "fc_input_median": float(np.median([w["fc_input"] for w in walks])),
            "blocks": blocks,
            "pooled_map_known_median": float(np.median([w["pooled_map_known"] for w in walks])),
            "pooled_map_error_median": float(np.median([w["pooled_map"] for w in walks])),
            "below": levels}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# How far one step's gradient determines IMPALA ({result['machine']})", "",
             "Random-init victims, float32 per-step gradients (the wire), "
             f"{result['steps']} held-out steps each; median relative errors against the "
             "victim's own activations on the private frames. Ranks are of one input "
             "channel's equations (9·C rows) against its H·W entries.", ""]
    rows = []
    for case in result["cases"]:
        for entry in case["blocks"]:
            rows.append({"victim": f"{case['victim']} {case['size']}×{case['size']}",
                         "block": entry["block"],
                         "equations / unknowns": f"{entry['equations_per_channel']} / "
                                                 f"{entry['unknowns_per_channel']}",
                         "rank conv1 / conv0 (min)": f"{entry['rank_conv1_min']} / "
                                                     f"{entry['rank_conv0_min']}",
                         "conv1 input": f"{entry['conv1_input']:.1e}",
                         "conv0 input": f"{entry['conv0_input']:.1e}",
                         "block input known": f"{entry['input_known']:.2f}",
                         "block input": f"{entry['input']:.1e}"})
    lines += [markdown_table(rows, list(rows[0])), "", "## Beneath the last stage's pooled map", "",
              "Each 3×3 conv's equations with the true δ (an oracle: the best a solve could "
              "get from them alone); under-determined wherever the rank is below the "
              "unknowns, so those levels need the forward equations or a prior.", ""]
    rows = [{"victim": f"{case['victim']} {case['size']}×{case['size']}", "conv": level["conv"],
             "equations / unknowns": f"{level['equations_per_channel']} / "
                                     f"{level['unknowns_per_channel']}",
             "rank": level["rank_true_delta"]}
            for case in result["cases"] for level in case["below"]]
    lines += [markdown_table(rows, list(rows[0])), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="runs/impala-walk")
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cases = []
    for case in CASES:
        print(f"{case.victim} {case.size}×{case.size}", flush=True)
        cases.append(run_case(case, capture(case, work, args.steps), args.steps))
    result = {"machine": machine(), "steps": args.steps, "cases": cases}
    write_results(RESULTS, result, markdown(result))


if __name__ == "__main__":
    main()
