"""The review's concrete test for NL-SME: does the Bézier curve or the d-vector carry the gain?

On both embedded datasets, for (E, N, B) in {(20, 50, 10), (50, 50, 10), (20, 10, 10)} and
--seeds seeds: IG, SME, NL-SME, SME + d-vector and NL-SME without d, each with and without
L_cls, on the same clients and budgets. Reports raw and scaled L_sim, PSNR, SSIM (Hungarian
matched), seconds per client. Writes benchmarks/results/fedavg_controls.{json,md}.

    python benchmarks/fedavg_controls.py [--iters 1000] [--seeds 3] [--datasets digits,photos]
        [--settings "20/10/10"] [--resume] [--shard I/N | --merge]

Runs on one thread each give the same numbers on the same machine; the thread count is stored
with every run, since a different one changes floating-point sums and so the trajectory.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from gradleak.fedavg.attacks import METHODS, FedAttackConfig
from gradleak.fedavg.client import ClientConfig
from gradleak.fedavg.experiment import run_fedavg
from gradleak.io import atomic_path
from gradleak.report.tables import markdown_table

RESULTS = Path(__file__).parent / "results" / "fedavg_controls.json"
SETTINGS = ((20, 50, 10), (50, 50, 10), (20, 10, 10))
CLS_WEIGHT = 0.1


def mean_std(values: list[float]) -> str:
    clean = [v for v in values if v is not None]
    if not clean:
        return "-"
    spread = statistics.pstdev(clean) if len(clean) > 1 else 0.0
    return f"{statistics.fmean(clean):.4g} ± {spread:.2g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--datasets", default="digits,photos")
    parser.add_argument("--settings", default=None, help="E/N/B;E/N/B (default: the three)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in --results and run only the missing ones")
    parser.add_argument("--shard", default=None, metavar="I/N",
                        help="run every N-th missing cell from the I-th, into a shard file "
                             "beside --results (one process per core; then --merge)")
    parser.add_argument("--merge", action="store_true",
                        help="fold the shard files into --results and delete them")
    args = parser.parse_args()
    if args.merge:
        merge_shards(args)
        return
    settings = ([tuple(int(v) for v in s.split("/")) for s in args.settings.split(";")]
                if args.settings else SETTINGS)
    runs = previous_runs(args.results, args.iters) if args.resume else []
    done = {run_key(run) for run in runs}
    todo = [cell for cell in grid(args.datasets.split(","), settings, args.seeds)
            if cell not in done]
    if args.shard:
        index, count = (int(v) for v in args.shard.split("/"))
        todo, args.results = todo[index::count], shard_path(args.results, index, count)
        runs = previous_runs(args.results, args.iters) if args.resume else []
        todo = [cell for cell in todo if cell not in {run_key(run) for run in runs}]
    for dataset, epochs, samples, batch, seed, method, cls in tqdm(todo, desc="cells"):
        client = ClientConfig(epochs=epochs, samples=samples, batch=batch, seed=seed)
        attack = FedAttackConfig(method=method, iterations=args.iters, labels="known",
                                 cls=CLS_WEIGHT if cls else 0.0, seed=seed)
        result = run_fedavg(dataset, "cnn", client, attack)
        runs.append({"dataset": result["dataset"], "E": epochs, "N": samples, "B": batch,
                     "seed": seed, "method": method, "l_cls": cls, "threads":
                     torch.get_num_threads(), **{k: result[k] for k in (
                         "l_sim_raw", "l_sim_scaled", "psnr", "ssim", "seconds")}})
        tqdm.write(json.dumps(runs[-1]))
        write(args, runs)
    write(args, runs)


def grid(datasets: list[str], settings: list[tuple[int, int, int]], seeds: int) -> list[tuple]:
    """Seed-major, so a grid cut short still holds every setting and method at its first seeds."""
    return [(dataset, *setting, seed, method, cls) for seed in range(seeds)
            for setting in settings for dataset in datasets for method in METHODS
            for cls in (False, True)]


def shard_path(results: Path, index: int, count: int) -> Path:
    return results.with_name(f"{results.stem}.shard{index}of{count}.json")


def merge_shards(args: argparse.Namespace) -> None:
    shards = sorted(args.results.parent.glob(f"{args.results.stem}.shard*of*.json"))
    if not shards:
        raise SystemExit(f"no shard files beside {args.results}")
    runs = previous_runs(args.results, args.iters)
    for shard in shards:
        runs += previous_runs(shard, args.iters)
    unique = {run_key(run): run for run in runs}  # a re-run cell keeps its latest result
    write(args, sorted(unique.values(), key=lambda run: (
        run["dataset"], run["E"], run["N"], run["B"], METHODS.index(run["method"]),
        run["l_cls"], run["seed"])))
    for shard in shards:
        shard.unlink()
        shard.with_suffix(".md").unlink(missing_ok=True)


def run_key(run: dict) -> tuple:
    """The loop's coordinates of a stored run (its dataset is stored by display name)."""
    return (run["dataset"].split(" ")[0], run["E"], run["N"], run["B"], run["seed"],
            run["method"], run["l_cls"])


def previous_runs(path: Path, iterations: int) -> list[dict]:
    if not path.exists():
        return []
    stored = json.loads(path.read_text())
    if stored.get("iterations") != iterations:
        raise SystemExit(f"{path} holds runs of {stored.get('iterations')} iterations, not "
                         f"{iterations}: --resume would mix budgets")
    return list(stored["runs"])


def write(args: argparse.Namespace, runs: list[dict]) -> None:
    """Results so far, rewritten after every run: an interrupted grid resumes (--resume)."""
    if not runs:
        return
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        key = (run["dataset"], run["E"], run["N"], run["B"], run["method"], run["l_cls"])
        groups.setdefault(key, []).append(run)
    table = [{"dataset": k[0], "E/N/B": f"{k[1]}/{k[2]}/{k[3]}", "method": k[4],
              "L_cls": "on" if k[5] else "off",
              "L_sim raw": mean_std([r["l_sim_raw"] for r in v]),
              "L_sim scaled": mean_std([r["l_sim_scaled"] for r in v]),
              "PSNR": mean_std([r["psnr"] for r in v]), "SSIM": mean_std([r["ssim"] for r in v]),
              "s / client": mean_std([r["seconds"] for r in v]), "seeds": len(v)}
             for k, v in groups.items()]
    seeds = len({run["seed"] for run in runs})
    summary = {"iterations": args.iters, "seeds": seeds, "labels": "known",
               "model": "cnn", "runs": runs}
    with atomic_path(args.results) as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
    gains = attribution(runs)
    text = (f"# FedAvg controls ({args.iters} iterations, {len(runs)} runs over {seeds} "
            "seed(s), labels known; datasets are the embedded stand-ins)\n\n"
            + markdown_table(table, list(table[0])) + "\n")
    if gains:
        text += ("\n## What carries NL-SME's gain (PSNR over SME, same client and seed, "
                 "L_cls off)\n\n" + markdown_table(gains, list(gains[0])) + "\n")
    with atomic_path(args.results.with_suffix(".md")) as tmp:
        tmp.write_text(text)


ABLATIONS = {"Bézier only (nlsme-nod)": "nlsme-nod", "d-vector only (sme-dvec)": "sme-dvec",
             "both (nlsme)": "nlsme"}


def attribution(runs: list[dict]) -> list[dict]:
    """Paired PSNR differences against SME: which of NL-SME's two changes helps on its own."""
    psnr = {(r["dataset"], r["E"], r["N"], r["B"], r["seed"], r["method"]): r["psnr"]
            for r in runs if not r["l_cls"]}
    rows = []
    for dataset, e, n, b in dict.fromkeys(k[:4] for k in psnr):
        seeds = sorted({k[4] for k in psnr if k[:4] == (dataset, e, n, b)})
        row = {"dataset": dataset, "E/N/B": f"{e}/{n}/{b}"}
        for label, method in ABLATIONS.items():
            paired = [psnr[(dataset, e, n, b, s, method)] - psnr[(dataset, e, n, b, s, "sme")]
                      for s in seeds if (dataset, e, n, b, s, method) in psnr
                      and (dataset, e, n, b, s, "sme") in psnr]
            row[label] = mean_std(paired) + f" (n={len(paired)})" if paired else "-"
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
