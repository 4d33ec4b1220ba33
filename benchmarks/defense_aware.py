"""The training-free attack blind to the defense against the one that knows it.

Per victim (the paper's `cnn` at 84×84 and `cnn-small` at 64×64, both trained with PPO; the
held-out float32 captures of `benchmarks/exact_frames.py`) and per defense of a grid from light
to strong, --frames evenly spaced held-out steps are defended as the audit defends them (the
capture's row keys seed the noise; the attack is told the defense's kind and parameters, never
its seed) and attacked twice: by `exact` (training-free, reading the gradient as exact) and by
`training-free (defense-aware)`. Each row: PSNR / SSIM / LPIPS, action accuracy, the update's cosine
to the clean one, ms per frame, beside the mean image of the capture's held-out frames (the
audited frames: it has seen them, so gains over it understate the leak) and each frame's own
mean colour (an oracle). DP-SGD rows carry σ, C, q and the steps. The PNG shows the first six
scored frames on the paper's cnn: ground truth above each attack under each defense of
--picture. Where the frames fall short, `bottleneck` measures why on the paper's cnn (under
--bottleneck): each recovered conv input's error, how many of the second block's ReLU units
the recursion decides wrongly, the first block's map solved with the true on/off pattern
instead, and the frame solved from the true map. Writes
benchmarks/results/defense_aware.{json,md,png}.

    python benchmarks/defense_aware.py [--work runs/exact-frames] [--frames 16]
        [--defenses "cast:bfloat16;..."] [--picture "cast:bfloat16;prune:0.1;noise:0.0001"]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from exact_frames import Case, capture
from host import machine

from gradleak.attacks.defense_aware import DefenseAwareAttack
from gradleak.attacks.exact import ExactAttack
from gradleak.capture.reader import CaptureFile
from gradleak.defenses import parse_defense
from gradleak.defenses.base import row_keys
from gradleak.io import atomic_path
from gradleak.metrics.scores import image_scores
from gradleak.report.tables import fixed, markdown_table
from gradleak.threat import Observation, declared

RESULTS = Path(__file__).parent / "results" / "defense_aware.json"
DEFENSES = ("cast:bfloat16;quant:12;prune:0.5;noise:1e-05;prune:0.1;noise:0.0001;quant:8;"
            "noise:0.001;dpsgd:eps=10;dpsgd:eps=1")
# what the issue asked of the defense-aware attack (PSNR, dB): the targets the tables hold up
TARGETS = {"cast:bfloat16": "≥ 35 dB", "quant:12": "≥ 35 dB", "prune:0.5": "≥ 35 dB",
           "noise:1e-05": "≥ 35 dB", "prune:0.1": "≥ 30 dB", "noise:0.0001": "≥ 30 dB",
           "quant:8": "mean image + 6 dB", "noise:0.001": "mean image + 6 dB"}


def cases(work: Path) -> list[tuple[Case, Path]]:
    victims = [Case("cnn 84×84, PPO", "runs/victims/cnn84-ppo", "paper", False),
               Case("cnn-small 64×64, PPO", "runs/victims/small64-ppo", "cpu-bench", False)]
    return [(case, capture(case, "float32", 64, work)) for case in victims]


def as_nchw(frames: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255.0


def scores(images: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    return image_scores(as_nchw(images), as_nchw(truth))


def references(path: Path, rows: np.ndarray, truth: np.ndarray) -> dict[str, dict[str, float]]:
    """The mean of every held-out frame of the capture, and each frame's own mean colour."""
    with CaptureFile(path) as file:
        every = file.target(images=True).images.astype(np.float64)
    mean = np.broadcast_to(every.mean(0).round().astype(np.uint8), truth.shape)
    colour = np.broadcast_to(truth.reshape(len(truth), -1, truth.shape[-1]).mean(1)[
        :, None, None, :], truth.shape).round().astype(np.uint8)
    return {"mean of the held-out frames": scores(np.ascontiguousarray(mean), truth),
            "mean colour (oracle)": scores(np.ascontiguousarray(colour), truth)}


def attack(observation: Any, kind: str, actions: np.ndarray, truth: np.ndarray
           ) -> tuple[dict[str, Any], np.ndarray]:
    start = time.perf_counter()
    result = (DefenseAwareAttack if kind == "aware" else ExactAttack)(observation).reconstruct()
    seconds = time.perf_counter() - start
    row = {**scores(result.images, truth),
           "action_accuracy": float((result.actions == actions).mean()),
           "ms_per_frame": 1e3 * seconds / len(truth)}
    if kind == "aware":
        row["finished_fraction"] = float(np.mean(result.extras["finished"]))
    return row, result.images


def defended(clean: Observation, keys: np.ndarray, spec: str
             ) -> tuple[Observation, float, dict[str, Any]]:
    """The stream through `spec` as the audit defends it (the rows' keys seed the noise), the
    defense declared without its seed; the update's mean cosine to the clean one; the chain's
    description."""
    chain = parse_defense(spec, seed=0)
    gradients = chain.gradients(torch.from_numpy(clean.gradients), keys).numpy()
    cosine = float(torch.nn.functional.cosine_similarity(
        torch.from_numpy(gradients).double(), torch.from_numpy(clean.gradients).double()).mean())
    return (replace(clean, gradients=gradients, defense=declared(chain.describe()["transforms"])),
            cosine, chain.describe())


def run_case(path: Path, defenses: list[str], frames: int, picture: list[str]
             ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    with CaptureFile(path) as file:
        rows = np.linspace(0, file.num_rows - 1, frames).round().astype(int)
        clean, target = file.observation(rows), file.target(rows)
        keys = row_keys(dict(file.attrs), 0, file.num_rows)[rows]
    truth = target.images
    result: dict[str, Any] = {"capture": str(path), "rows": rows.tolist(),
                              "references": references(path, rows, truth), "defenses": {}}
    shown = {"ground truth": truth[:6]}
    for spec in ["none", *defenses]:
        observation, cosine, description = defended(clean, keys, spec)
        row: dict[str, Any] = {"update_cosine": cosine, "defense": description}
        for kind in ("blind", "aware") if spec != "none" else ("blind",):
            row[kind], images = attack(observation, kind, target.actions, truth)
            if spec in picture:
                shown[f"{spec}, {'defense-aware' if kind == 'aware' else 'blind'}"] = images[:6]
        result["defenses"][spec] = row
        print(f"{path.name} {spec}: cos {cosine:.4f} blind {row['blind']['psnr']:.2f}"
              + (f" aware {row['aware']['psnr']:.2f}" if "aware" in row else ""), flush=True)
    return result, shown


def bottleneck(path: Path, spec: str, frames: int) -> dict[str, Any]:
    """Why the frames fall short under `spec` (an oracle analysis: it reads the private
    frames, actions and advantages to form the true maps and output gradients)."""
    from gradleak.attacks.conv_inputs import observed_conv_inputs
    from gradleak.attacks.optim.matching import coefficients_from
    from gradleak.evaluation.analytic import score_conv_stack
    from gradleak.inversion.conv_blocks import conv_blocks
    from gradleak.inversion.layers.affine_norm import bn_affine
    from gradleak.inversion.layers.conv import solve_input
    from gradleak.rl.losses import actor_critic_loss
    from gradleak.victims.base import victim_at_theta0

    with CaptureFile(path) as file:
        rows = np.linspace(0, file.num_rows - 1, frames).round().astype(int)
        clean, target = file.observation(rows), file.target(rows)
        keys = row_keys(dict(file.attrs), 0, file.num_rows)[rows]
    defended = replace(clean, gradients=parse_defense(spec).gradients(
        torch.from_numpy(clean.gradients), keys).numpy())
    victim = victim_at_theta0(clean).double()
    blocks = conv_blocks(victim)
    inputs, outputs = {}, {}
    hooks = [victim.get_submodule(b.name).register_forward_pre_hook(
        lambda m, a, name=b.name: inputs.__setitem__(name, a[0].detach())) for b in blocks]

    def keep(name: str) -> Any:
        def hook(module: Any, args: Any, out: torch.Tensor) -> None:
            out.retain_grad()  # its gradient: the block's true δ
            outputs[name] = out
        return hook

    hooks += [victim.get_submodule(b.name).register_forward_hook(keep(b.name)) for b in blocks]
    logits, values = victim(torch.from_numpy(target.images).double())[:2]
    actor_critic_loss(logits, values.reshape(-1), torch.from_numpy(target.actions),
                      torch.from_numpy(target.advantages).double(),
                      torch.from_numpy(target.returns).double(),
                      coefficients_from(clean.hyperparameters)).sum().backward()
    for hook in hooks:
        hook.remove()
    found = observed_conv_inputs(defended)
    second, third = blocks[1], blocks[2]

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(((a - b).flatten(1).norm(dim=1) / b.flatten(1).norm(dim=1)).median())

    gain = bn_affine(second)[0].detach()
    true_on = outputs[second.name].detach() > 0
    upstream = found.upstream[third.name]
    gradient = torch.from_numpy(defended.block(f"{second.name}.weight")).double()
    with_true_on = solve_input(second, upstream * gain * true_on.double(), gradient)
    scored = score_conv_stack(defended, target, frames)
    return {"spec": spec, "frames": frames,
            "conv_input_errors": {name: error(found.inputs[name], inputs[name])
                                  for name in found.inputs},
            "second_block_units": int(true_on.numel()),
            "second_block_units_decided_wrongly": int((true_on != (
                found.masks[second.name] > 0)).sum()),
            "first_map_error": error(found.inputs[second.name], inputs[second.name]),
            "first_map_error_with_true_on_units": error(with_true_on, inputs[second.name]),
            "psnr": scored["psnr"], "psnr_from_true_map": scored["psnr_from_true_map"]}


def dp_text(description: dict[str, Any]) -> str:
    dp = next((t for t in description["transforms"] if "achieved_eps" in t), None)
    return (f"ε {dp['achieved_eps']:.2f}: σ {dp['sigma']:.3g}, C {dp['clip']:g}, "
            f"q {dp['q']:.3g}, {dp['steps']} steps" if dp else "")


def markdown(results: dict[str, Any]) -> str:
    parts = [f"# The training-free attack, blind and defense-aware ({results['machine']})\n",
             f"{results['frames']} evenly spaced held-out steps per victim (float32 wire); "
             "PSNR (dB) / SSIM / LPIPS (lower is closer), action accuracy, ms per frame. The "
             "defense-aware attack is told each defense's kind and parameters, never its seed. "
             "Target: what the issue asked of the defense-aware attack.\n"]
    for name, case in results["victims"].items():
        refs = case["references"]
        parts.append(f"## {name}\n\nReferences: " + "; ".join(
            f"{ref} {r['psnr']:.2f} / {r['ssim']:.3f} / {fixed(r.get('lpips'), 3)}"
            for ref, r in refs.items()) + ".\n")
        table = []
        for spec, row in case["defenses"].items():
            def cell(r: dict[str, Any] | None) -> str:
                return "" if not r else (f"{r['psnr']:.2f} / {r['ssim']:.3f} / "
                                         f"{fixed(r.get('lpips'), 3)}")
            table.append({"defense": spec, "update cosine": f"{row['update_cosine']:.4f}",
                          "blind": cell(row.get("blind")), "defense-aware": cell(row.get("aware")),
                          "actions blind / aware": f"{row['blind']['action_accuracy']:.2f}"
                          + (f" / {row['aware']['action_accuracy']:.2f}" if "aware" in row
                             else ""),
                          "ms / frame": f"{row['blind']['ms_per_frame']:.0f}"
                          + (f" / {row['aware']['ms_per_frame']:.0f}" if "aware" in row
                             else ""),
                          "target": TARGETS.get(spec, ""), "DP": dp_text(row["defense"])})
        parts.append(markdown_table(table, ["defense", "update cosine", "blind", "defense-aware",
                                            "actions blind / aware", "ms / frame", "target",
                                            "DP"]) + "\n")
    for b in results.get("bottleneck", []):
        parts.append(
            f"## Where the frames fall short: {b['spec']}, {next(iter(results['victims']))}\n\n"
            f"Oracle analysis on {b['frames']} frames (reads the private frames). The recursion "
            "recovers the conv inputs to median relative errors "
            + ", ".join(f"{name} {err:.4f}" for name, err in b["conv_input_errors"].items())
            + f": {b['second_block_units_decided_wrongly']} of {b['second_block_units']} ReLU "
            "units of the second block are decided wrongly, and the first block's map, which "
            f"the frame solve reads, comes back at {b['first_map_error']:.3f}; the same least "
            f"squares with the true on/off pattern gives {b['first_map_error_with_true_on_units']:.4f}. "
            f"The frame solve gives {b['psnr']:.2f} dB from the recovered map and "
            f"{b['psnr_from_true_map']:.2f} dB from the true one: the on/off decisions of that "
            "one block are what stands between the attack and the target.\n")
    return "\n".join(parts)


def plot(shown: dict[str, np.ndarray], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradleak.report.plots import show

    count = len(next(iter(shown.values())))
    figure, axes = plt.subplots(len(shown), count, figsize=(1.2 * count + 2.4, 1.25 * len(shown)),
                                squeeze=False)
    for r, (label, images) in enumerate(shown.items()):
        for c in range(count):
            show(axes[r][c], images[c])
        axes[r][0].set_ylabel(label, rotation=0, ha="right", va="center", fontsize=7)
    figure.tight_layout()
    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png", dpi=60)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, default=Path("runs/exact-frames"))
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--defenses", default=DEFENSES)
    parser.add_argument("--picture", default="cast:bfloat16;prune:0.1;noise:0.0001")
    parser.add_argument("--bottleneck", default="cast:bfloat16;noise:1e-05")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    defenses, picture = args.defenses.split(";"), args.picture.split(";")
    results: dict[str, Any] = {"machine": machine(), "frames": args.frames, "victims": {}}
    first_shown = None
    for case, path in cases(args.work):
        results["victims"][case.name], shown = run_case(path, defenses, args.frames, picture)
        first_shown = first_shown or shown
    paper_capture = cases(args.work)[0][1]
    results["bottleneck"] = [bottleneck(paper_capture, spec, min(args.frames, 8))
                             for spec in args.bottleneck.split(";") if spec]
    with atomic_path(args.results) as temporary:
        temporary.write_text(json.dumps(results, indent=2) + "\n")
    with atomic_path(args.results.with_suffix(".md")) as temporary:
        temporary.write_text(markdown(results))
    if first_shown:
        plot(first_shown, args.results.with_suffix(".png"))


if __name__ == "__main__":
    main()
