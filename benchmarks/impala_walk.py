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
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gradleak.capture.reader import CaptureFile
from gradleak.capture.run import CaptureJob, run_capture
from gradleak.io import atomic_path
from gradleak.presets import load_preset
from gradleak.report.tables import markdown_table
from gradleak.victims.base import victim_at_theta0

from host import machine

RESULTS = Path(__file__).parent / "results" / "impala_walk.json"
ON_ABOVE = 1e-4  # float32 rounding leaves a recovered zero near 1e-6 of the largest entry


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


def correlation_matrix(delta: torch.Tensor, size: int) -> torch.Tensor:
    """(O·9, H·W): ∇W[o, i, ky, kx] = Σ_p δ_o(p) x_i(p + (ky − 1, kx − 1)) (3×3, padding 1)
    as a matrix on one input channel's entries: row (o, k) holds δ_o shifted by −k + 1."""
    padded = F.pad(delta, (1, 1, 1, 1))
    rows = [padded[:, 2 - ky:2 - ky + size, 2 - kx:2 - kx + size]
            for ky in range(3) for kx in range(3)]
    return torch.stack(rows, 1).reshape(-1, size * size)


def solve_input(delta: torch.Tensor, gradient: torch.Tensor, size: int
                ) -> tuple[torch.Tensor, int]:
    """A 3×3 conv's input (C, H, W) from its weight gradient (O, C, 3, 3) and output δ (O, H,
    W): one least squares per input channel, all sharing δ's matrix; and that matrix's rank."""
    matrix = correlation_matrix(delta, size)
    rhs = gradient.permute(0, 2, 3, 1).reshape(-1, gradient.shape[1])
    solution = torch.linalg.lstsq(matrix, rhs, driver="gelsd").solution
    return solution.T.reshape(-1, size, size), int(torch.linalg.matrix_rank(matrix))


def on(relu_output: torch.Tensor) -> torch.Tensor:
    """The units of a recovered ReLU output that are on: above the noise the float32 wire
    leaves on the zeros (ON_ABOVE of its largest entry)."""
    return relu_output > ON_ABOVE * relu_output.abs().max()


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
    """One step's walk down the last stage, against the truth of that step."""
    fc, stages = victim.fc, victim.encoder
    last = len(stages) - 1
    channels, size = stages[last][0].out_channels, int(round(
        (fc.in_features / stages[last][0].out_channels) ** 0.5))
    gw, gb = block("fc.weight")[step], block("fc.bias")[step]
    u = ((gw.T @ gb) / (gb @ gb)).view(channels, size, size)  # relu(out) of the last stage
    out = torch.where(u > 0, u, torch.nan)  # the stage output: known where it is positive
    delta = (fc.weight.detach().double().T @ gb).view(channels, size, size) * (u > 0)
    row: dict[str, Any] = {"fc_input": relative(u.flatten(), truth["fc:in"][step])}
    levels = []
    for index in (4, 3):  # the residual blocks, top down
        name = f"encoder.{last}.{index}"
        module = stages[last][index]
        b, rank1 = solve_input(delta, block(f"{name}.conv1.weight")[step].double(), size)
        delta_c = torch.nn.grad.conv2d_input((1, *b.shape), module.conv1.weight.double(),
                                             delta[None], padding=1)[0] * on(b)
        a, rank0 = solve_input(delta_c, block(f"{name}.conv0.weight")[step].double(), size)
        a = a * on(a)  # a ReLU's output: what the float32 wire leaves of its zeros is noise
        # the block input x: from out = x + conv1(b) where out is known, and x = relu(x) > 0
        branch = F.conv2d(b[None], module.conv1.weight.double(), module.conv1.bias.double(),
                          padding=1)[0]
        x = torch.where(on(a), a, out - branch)
        known = torch.isfinite(x)
        true_b, true_a = truth[f"{name}.conv1:in"][step], truth[f"{name}.conv0:in"][step]
        true_x = truth[f"{name}:in"][step]
        levels.append({"block": name, "unknowns_per_channel": size * size,
                       "equations_per_channel": 9 * channels, "rank_conv1": rank1,
                       "rank_conv0": rank0, "conv1_input": relative(b, true_b),
                       "conv0_input": relative(a, true_a),
                       "input_known": float(known.double().mean()),
                       "input": relative(x, true_x, known)})
        delta = delta + torch.nn.grad.conv2d_input(
            (1, *a.shape), module.conv0.weight.double(), delta_c[None], padding=1)[0] * on(a)
        out = x
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
            _, rank = solve_input(delta, torch.zeros(delta.shape[0], x.shape[0], 3, 3,
                                                     dtype=torch.float64), x.shape[-1])
            levels.append({"conv": name, "unknowns_per_channel": x.shape[-1] ** 2,
                           "equations_per_channel": 9 * delta.shape[0], "rank_true_delta": rank})
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
    with atomic_path(RESULTS) as path:
        path.write_text(json.dumps(result, indent=1))
    with atomic_path(RESULTS.with_suffix(".md")) as path:
        path.write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
