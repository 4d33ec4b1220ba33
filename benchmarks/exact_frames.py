"""Training-free frames on held-out maps: the first conv's own equations, per victim and storage.

For each victim (the paper's `cnn` at 84×84 and `cnn-small` at 64×64, random-init and trained
with PPO or A2C) and each storage (float32, what the client sends, and float16), a held-out
capture of --steps steps is scored on --frames evenly spaced steps, as `gradleak closed-form
--conv` scores it: each conv input's relative error, then frames from the first conv's
equations (outputs and weight gradient, weighed by how exact they are, with the total-variation
rounds and the inequalities: the default), the same with the quadratic prior alone (the solve
before the rounds), the same without the weight-gradient equations, the same fitted as if
exact, the same from the true first-block output (the prior's ceiling), and the frames' own
mean image. A scored step whose neighbouring step saw the same frame (the agent stood still) is
solved together with it, as the attack solves a stream; each step alone is scored beside. The
float32 captures are also scored zero-shot under --defenses, a grid from weak to strong so
the table shows where the attack gives way. One held-out episode's frames go into a
picture, truth above each method.
Writes benchmarks/results/exact_frames.{json,md,png}.

    python benchmarks/exact_frames.py [--work runs/exact-frames] [--steps 64] [--frames 16]
        [--ppo-cnn runs/victims/cnn84-ppo] [--a2c-cnn runs/victims/cnn84-a2c]
        [--ppo-small runs/victims/small64-ppo] [--a2c-small runs/victims/small64-a2c]
        [--rank-frames 1]
        [--defenses "cast:bfloat16;noise:1e-06;...;prune:0.1"] [--only "VICTIM;..."]

The trained victims, 6 updates of 4 × 128 steps each (about 20 s apiece on 2 cores):
`gradleak train-victim --preset paper [--algo a2c] --updates 6 --set train.num_envs=4 --out
runs/victims/cnn84-ppo` (cnn84-a2c), and the same with `--preset cpu-bench` for cnn-small
(small64-ppo, small64-a2c).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from host import machine

from gradleak.attacks.exact import ExactAttack, ExactConfig
from gradleak.capture.plan import CaptureJob
from gradleak.capture.reader import CaptureFile
from gradleak.capture.run import run_capture
from gradleak.defenses import parse_defense
from gradleak.defenses.files import defend_capture
from gradleak.evaluation.analytic import score_conv_stack
from gradleak.inversion.frame_solve import FrameSolve
from gradleak.io import atomic_path
from gradleak.metrics.lpips import unavailable_reason
from gradleak.presets import load_preset
from gradleak.report.tables import markdown_table

RESULTS = Path(__file__).parent / "results" / "exact_frames.json"


@dataclass(frozen=True)
class Case:
    name: str
    victim: str  # a registry name (random init) or a checkpoint directory
    preset: str
    random_init: bool


def paper_cases(ppo_cnn: Path) -> list[Case]:
    """The paper's cnn at 84×84, random init and trained with PPO (exact_refiner.py and
    exact_speed.py score the same captures)."""
    return [Case("cnn 84×84, random init", "cnn", "paper", True),
            Case("cnn 84×84, PPO", str(ppo_cnn), "paper", False)]


def cases(args: argparse.Namespace) -> list[Case]:
    return [*paper_cases(args.ppo_cnn),
            Case("cnn 84×84, A2C", str(args.a2c_cnn), "paper", False),
            Case("cnn-small 64×64, random init", "cnn-small", "cpu-bench", True),
            Case("cnn-small 64×64, PPO", str(args.ppo_small), "cpu-bench", False),
            Case("cnn-small 64×64, A2C", str(args.a2c_small), "cpu-bench", False)]


def capture(case: Case, dtype: str, steps: int, work: Path) -> Path:
    out = work / f"{case.name.split(',')[0].replace(' ', '-').replace('×', 'x')}-" \
                 f"{'random' if case.random_init else Path(case.victim).name}-{dtype}.h5"
    if not out.exists():
        preset = load_preset(case.preset)
        preset.capture.gradient_dtype = dtype
        run_capture(CaptureJob(victim=case.victim, random_init=case.random_init,
                               split="heldout", steps=steps, out=out, preset=preset,
                               progress=False, seed=11))
    return out


def scores(path: Path, frames: int, rank_frames: int = 0) -> dict[str, Any]:
    with CaptureFile(path) as file:
        observation, target = file.observation(), file.target()
    return score_conv_stack(observation, target, frames, rank_frames=rank_frames)


def row(case: Case, dtype: str, defense: str, result: dict[str, Any]) -> dict[str, Any]:
    solves = result["solves"]
    deepest = result["layers"][result["frames_from"]]
    return {"victim": case.name, "storage": dtype, "defense": defense,
            "map_error": deepest["median_relative_error"],
            "equations_per_unknown": result["equations_per_unknown"],
            "rank_fraction": result.get("rank_fraction"),
            "psnr": result["psnr"], "ssim": result["ssim"], "lpips": result.get("lpips"),
            "same_frame_steps": result.get("same_frame_steps", 0),
            "psnr_each_step_alone": solves["each_step_alone"]["psnr"],
            "ssim_each_step_alone": solves["each_step_alone"]["ssim"],
            "psnr_quadratic_prior": solves["quadratic_prior"]["psnr"],
            "ssim_quadratic_prior": solves["quadratic_prior"]["ssim"],
            "psnr_without_weight_gradient": solves["without_weight_gradient"]["psnr"],
            "psnr_as_if_exact": solves["as_if_exact"]["psnr"],
            "psnr_from_true_map": result["psnr_from_true_map"],
            "psnr_mean_image": result["psnr_of_their_mean_image"],
            "lpips_mean_image": result.get("lpips_of_their_mean_image"),
            "ms_per_frame": 1000 * (result["recovery_seconds_per_frame"]
                                    + result["frame_seconds_per_frame"]),
            "detail": result}


def picture(path: Path, out: Path, count: int = 8) -> None:
    """Truth above each method's frames, for `count` consecutive steps of one episode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with CaptureFile(path) as file:
        episodes = file.column("episode_ids")
        first = int(np.flatnonzero(episodes == episodes[0]).max() + 1) \
            if (episodes == episodes[0]).sum() < count else 0
        rows = np.arange(first, first + count)
        observation, truth = file.observation(rows), file.target(rows).images
    attack = ExactAttack(observation)
    rows_of = {"private": truth, "equations (default)": attack.reconstruct().images,
               "quadratic prior": ExactAttack(observation, ExactConfig(solve=FrameSolve(rounds=0)))
               .reconstruct().images,
               "without ∇W₁": ExactAttack(observation, ExactConfig(weight_gradient=False))
               .reconstruct().images}
    figure, axes = plt.subplots(len(rows_of), count, figsize=(1.1 * count + 1.2,
                                                              1.15 * len(rows_of)))
    for r, (label, images) in enumerate(rows_of.items()):
        for c in range(count):
            axes[r, c].imshow(images[c], interpolation="nearest")
            axes[r, c].set_xticks([])
            axes[r, c].set_yticks([])
        axes[r, 0].set_ylabel(label, fontsize=7)
    figure.suptitle(f"{path.stem}: one held-out episode, no attacker training", fontsize=8)
    figure.tight_layout()
    with atomic_path(out) as temporary:
        figure.savefig(temporary, format="png", dpi=110)
    plt.close(figure)


def leverage_picture(path: Path, out: Path, frames: int = 2) -> dict[str, Any]:
    """Where the equations decide and where the prior does, for the first `frames` steps: the
    private frame, the training-free one, its error and the equations' leverage per pixel
    (the row-space projector's diagonal, averaged over colour channels: 1 = fixed by the
    equations, 0 = left to the prior). Returns the leverage's quartiles and the mean error in
    the pixels of its top and bottom quarter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradleak.attacks.conv_inputs import observed_conv_inputs
    from gradleak.attacks.equation_rank import equation_space
    from gradleak.attacks.exact import bias_gradient
    from gradleak.inversion.first_conv import first_conv_equations

    rows = np.arange(frames)
    with CaptureFile(path) as file:
        observation, truth = file.observation(rows), file.target(rows).images
    attack = ExactAttack(observation)
    images = attack.reconstruct().images
    found = observed_conv_inputs(observation)
    deepest = list(found.inputs)[-1]
    equations = first_conv_equations(
        attack.victim, found.inputs[deepest], found.noise[deepest], found.upstream[deepest],
        torch.from_numpy(observation.block(f"{attack.first.name}.weight").astype(np.float64)),
        bias_gradient=bias_gradient(observation, attack.first))
    height, width, channels = observation.roles.transform.frame_shape
    shape = torch.Size((1, channels, height, width))
    error = np.abs(images.astype(float) - truth.astype(float)).mean(-1) / 255
    figure, axes = plt.subplots(frames, 4, figsize=(8.4, 2.2 * frames), squeeze=False)
    leverages = []
    for frame in range(frames):
        leverage = equation_space(equations, frame, shape).leverage(tuple(shape[1:])) \
            .mean(0).numpy()
        leverages.append(leverage)
        panels = [(truth[frame], "private"), (images[frame], "training-free"),
                  (error[frame], "|error|"), (leverage, "leverage")]
        for column, (panel, title) in enumerate(panels):
            axis = axes[frame, column]
            axis.imshow(panel, interpolation="nearest", **(
                {"cmap": "magma", "vmin": 0, "vmax": 1 if title == "leverage" else 0.25}
                if panel.ndim == 2 else {}))
            axis.set_xticks([])
            axis.set_yticks([])
            axis.set_title(title, fontsize=8)
    figure.suptitle(f"{path.stem}: where the equations fix the frame (leverage 1) and where "
                    "the prior does (0)", fontsize=8)
    figure.tight_layout()
    with atomic_path(out) as temporary:
        figure.savefig(temporary, format="png", dpi=110)
    plt.close(figure)
    leverage, errors = np.stack(leverages), error[:frames]
    quartiles = np.quantile(leverage, [0.25, 0.5, 0.75])
    return {"capture": path.stem, "frames": frames,
            "leverage_quartiles": [float(q) for q in quartiles],
            "mean_abs_error_top_quarter": float(errors[leverage >= quartiles[2]].mean()),
            "mean_abs_error_bottom_quarter": float(errors[leverage <= quartiles[0]].mean()),
            "mean_abs_error": float(errors.mean())}


COLUMNS = ["victim", "storage", "defense", "map_error", "equations_per_unknown", "rank_fraction",
           "psnr", "ssim", "lpips", "same_frame_steps", "psnr_each_step_alone",
           "ssim_each_step_alone", "psnr_quadratic_prior", "ssim_quadratic_prior",
           "psnr_without_weight_gradient", "psnr_as_if_exact",
           "psnr_from_true_map", "psnr_mean_image", "lpips_mean_image", "ms_per_frame"]


def markdown(result: dict[str, Any]) -> str:
    def cell(key: str, value: Any) -> Any:
        if isinstance(value, float) and key.startswith("lpips"):
            return f"{value:.3f}"
        if isinstance(value, float) and key == "rank_fraction":
            return f"{value:.2f}"
        if isinstance(value, float):
            return f"{value:.1e}" if abs(value) < 1e-2 else f"{value:.2f}"
        return "-" if value is None else value

    table = markdown_table([{k: cell(k, r.get(k)) for k in COLUMNS} for r in result["rows"]],
                           COLUMNS)
    return (f"# Training-free frames (`benchmarks/exact_frames.py`)\n\n{result['frames']} evenly "
            f"spaced steps of a {result['steps']}-step held-out capture per row; "
            f"{result['machine']}. `psnr`/`ssim`: the first conv's equations (outputs and "
            "weight gradient, the default), weighed by how exact they are (the ∇b₁ check "
            "and the on-units' estimated noise), solved with total variation (reweighted "
            "rounds) and the off-units and input range enforced, each scored step solved "
            "together with the neighbouring steps whose recovered first-block maps show the "
            "same frame (`same_frame_steps` of them had one; `*_each_step_alone`: every step "
            "from its own gradient); `*_quadratic_prior`: the same "
            "with the quadratic smoothness alone (the solve before the rounds, the default "
            "until this change); `psnr_as_if_exact`: the same equations all "
            "fitted as exact; `psnr_from_true_map`: the default solve from the true "
            "first-block output (δ₁ still the recursion's); `map_error`: the recovered "
            "first-block output's median relative error; `equations_per_unknown`: (on-units + weight-gradient "
            "entries) / frame entries, an upper bound on the fraction the equations pin down; "
            f"`rank_fraction`: the rank of those equations / frame entries, on the first "
            f"{result['rank_frames']} scored frame(s) of each undefended float32 capture (what "
            "they do pin down; the prior decides the rest"
            + ("; computed by an earlier run on the same captures, since the rank depends on "
               "the equations, not on the solve" if result.get("rank_from") else "")
            + "). LPIPS (AlexNet, v0.1): "
            f"{result['lpips']}; `cast:bfloat16` is what a mixed-precision client sends, and "
            f"float16 storage is `cast:float16`. `ms_per_frame`: this run's wall time, beside "
            "whatever else ran on the machine (`exact_speed.py` times the attack alone)."
            + (f" Measured again with `--only` after a change to the code: {'; '.join(rerun)}."
               if (rerun := result.get("rerun")) else "")
            + f"\n\n{table}\n\n![frames](exact_frames.png)\n" + leverage_text(result))


def leverage_text(result: dict[str, Any]) -> str:
    if "leverage" not in result:
        return ""
    figures = result["leverage"]
    low, middle, high = figures["leverage_quartiles"]
    return (f"\nWhere the equations decide ({figures['capture']}, first {figures['frames']} "
            f"frame(s)): the per-pixel leverage (1 = fixed by the equations, 0 = left to the "
            f"prior) has quartiles {low:.2f} / {middle:.2f} / {high:.2f}; the mean absolute "
            f"error is {figures['mean_abs_error_top_quarter']:.4f} of the range in the top "
            f"quarter, {figures['mean_abs_error_bottom_quarter']:.4f} in the bottom one "
            f"({figures['mean_abs_error']:.4f} overall).\n\n"
            "![leverage](exact_frames_leverage.png)\n")


def rewrite_markdown(results: Path = RESULTS) -> None:
    """The table again from the results JSON (after a change to its layout, without rerunning)."""
    with atomic_path(results.with_suffix(".md")) as temporary:
        temporary.write_text(markdown(json.loads(results.read_text())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, default=Path("runs/exact-frames"))
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--ppo-cnn", type=Path, default=Path("runs/victims/cnn84-ppo"))
    parser.add_argument("--a2c-cnn", type=Path, default=Path("runs/victims/cnn84-a2c"))
    parser.add_argument("--ppo-small", type=Path, default=Path("runs/victims/small64-ppo"))
    parser.add_argument("--a2c-small", type=Path, default=Path("runs/victims/small64-a2c"))
    parser.add_argument("--defenses", default="cast:bfloat16;noise:1e-06;noise:1e-05;"
                        "noise:0.0001;noise:0.001;quant:12;quant:8;prune:0.5;prune:0.1")
    parser.add_argument("--rank-frames", type=int, default=1,
                        help="frames whose equations' rank is computed (about a minute each "
                        "at 84×84)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--leverage-frames", type=int, default=2,
                        help="frames of the leverage picture (minutes each at 84×84)")
    parser.add_argument("--pictures-only", action="store_true",
                        help="redraw the pictures from the existing captures and add the "
                        "leverage figures to --results, scoring nothing")
    parser.add_argument("--rank-from", type=Path,
                        help="with --rank-frames 0: take each row's rank fraction from this "
                        "earlier results file (the rank depends on the equations, not on the "
                        "solve, so a change to the solve leaves it as it was)")
    parser.add_argument("--only", default="",
                        help="';'-separated victim names (as in the table) to measure again; "
                        "the other rows are kept from --results")
    args = parser.parse_args()
    torch.set_num_threads(2)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.rank_from and not args.rank_from.is_file():
        parser.error(f"--rank-from {args.rank_from}: not a file (an earlier results JSON)")
    if args.pictures_only:
        if not args.results.is_file():
            parser.error(f"--pictures-only adds to {args.results}, which is not a file")
        draw(args, json.loads(args.results.read_text()))
        return
    chosen = [case for case in cases(args)
              if not args.only or case.name in args.only.split(";")]
    if args.only and len(chosen) != len(args.only.split(";")):
        parser.error(f"--only: the victims are {'; '.join(c.name for c in cases(args))}")
    if args.only and not args.results.is_file():
        parser.error(f"--only keeps the other rows of --results, and {args.results} is not a "
                     "file: run without --only first")
    rows = []
    for case in chosen:
        for dtype in ("float32", "float16"):
            path = capture(case, dtype, args.steps, args.work)
            ranked = args.rank_frames if dtype == "float32" else 0
            rows.append(row(case, dtype, "none", scores(path, args.frames, ranked)))
            print(json.dumps({k: rows[-1][k] for k in COLUMNS}), flush=True)
            if dtype != "float32" or not case.random_init and "PPO" not in case.name:
                continue
            for spec in filter(None, args.defenses.split(";")):
                defended = path.with_name(f"{path.stem}-{spec.replace(':', '')}.h5")
                if not defended.exists():
                    defend_capture(path, parse_defense(spec), defended)
                rows.append(row(case, dtype, spec, scores(defended, args.frames)))
                print(json.dumps({k: rows[-1][k] for k in COLUMNS}), flush=True)
    reruns: list[str] = []
    result_extras: dict[str, Any] = {}
    if args.only:  # keep the other victims' rows, in the table's order
        kept = json.loads(args.results.read_text())
        fresh = {case.name for case in chosen}
        rows = [old for old in kept["rows"] if old["victim"] not in fresh] + rows
        if not args.leverage_frames and "leverage" in kept:
            result_extras["leverage"] = kept["leverage"]
        order = [case.name for case in cases(args)]
        rows.sort(key=lambda r: order.index(r["victim"]))
        reruns = sorted(set(kept.get("rerun", [])) | fresh)
    rank_frames = args.rank_frames
    if args.rank_from:
        rank_frames = carry_ranks(rows, json.loads(args.rank_from.read_text()))
    result = {"benchmark": "exact_frames", "steps": args.steps, "frames": args.frames,
              "rank_frames": rank_frames, "rerun": reruns,
              **({"rank_from": str(args.rank_from)} if args.rank_from else {}),
              "machine": machine(),
              "lpips": unavailable_reason() or "available", "rows": rows, **result_extras}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    draw(args, result)


def carry_ranks(rows: list[dict[str, Any]], earlier: dict[str, Any]) -> int:
    """Each row's rank fraction from the earlier run's row of the same victim, storage and
    defense; returns the number of frames it was computed on."""
    def key(row: dict[str, Any]) -> tuple[str, str, str]:
        return row["victim"], row["storage"], row["defense"]

    ranks = {key(old): old.get("rank_fraction") for old in earlier["rows"]}
    for row in rows:
        if row.get("rank_fraction") is None:
            row["rank_fraction"] = ranks.get(key(row))
    return int(earlier.get("rank_frames", 0))


def draw(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The pictures, then the results (with the leverage figures) and their table."""
    path = capture(cases(args)[1], "float32", args.steps, args.work)
    picture(path, args.results.with_suffix(".png"))
    if args.leverage_frames:
        result["leverage"] = leverage_picture(
            path, args.results.with_name(f"{args.results.stem}_leverage.png"),
            args.leverage_frames)
    with atomic_path(args.results) as temporary:
        temporary.write_text(json.dumps(result, indent=2, default=float))
    with atomic_path(args.results.with_suffix(".md")) as temporary:
        temporary.write_text(markdown(result))


if __name__ == "__main__":
    main()
