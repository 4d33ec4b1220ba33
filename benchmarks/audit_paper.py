"""`gradleak audit` on the paper's victim: the cnn at 84×84 trained with PPO, every attack beside
the training-free one along a defense grid, the learned attackers trained by the audit itself.

The held-out capture is `benchmarks/exact_frames.py`'s (64 steps of held-out scenes, float32)
and the training capture `benchmarks/exact_refiner.py`'s (the attacker's own 768 steps on
training scenes at the victim's θ0); both must exist (run those benchmarks first). TRACE and LtI
are fitted within their share of --budget-minutes (cpu-quick's attacker sizes: minutes, not the
paper's hours), DLG and IG invert one window. Writes benchmarks/results/audit_paper.{json,md}
and leaves the audit itself (report.html) in --out.

    python benchmarks/audit_paper.py [--work runs/exact-frames] [--out runs/audit-paper]
        [--budget-minutes 60] [--defenses "cast:bfloat16;quant:12;..."]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from gradleak.auditing import Audit, AuditConfig
from gradleak.evaluation.verdict import headline
from gradleak.io import atomic_path
from gradleak.report.audit import write_audit_report
from gradleak.report.tables import fixed, markdown_table

from host import machine

RESULTS = Path(__file__).parent / "results" / "audit_paper.json"
DEFENSES = ("cast:bfloat16;quant:12;prune:0.5;noise:1e-05;prune:0.1;noise:0.0001;quant:8;"
            "noise:0.001;dpsgd:eps=10;dpsgd:eps=1")


def markdown(result: dict[str, Any]) -> str:
    verdict = result["verdict"]
    names = sorted({name for o in verdict["defenses"] if not o.get("skipped")
                    for name in o["per_attack"]} | set(result["clean"]))
    rows = [{"defense": "none", "update cosine": "1.000",
             **{n: fixed(result["clean"].get(n), 2) for n in names}}]
    for o in verdict["defenses"]:
        if o.get("skipped"):
            rows.append({"defense": o["spec"], "update cosine": o["skipped"]})
            continue
        rows.append({"defense": o["spec"], "update cosine": fixed(o["cosine"], 3),
                     "stops all": "yes" if o["stops"] else "no",
                     **{n: fixed(o["per_attack"].get(n, {}).get("psnr_gain_over_mean_image"), 2)
                        for n in names}})
    return ("# gradleak audit of the paper's cnn at 84×84, trained with PPO\n\n"
            + "\n".join(f"- {line}" for line in headline(verdict))
            + f"\n\nPSNR gain over the mean training image (dB) per attack and defense "
            f"({result['machine']}; {result['minutes']} minutes of stages):\n\n"
            + markdown_table(rows, ["defense", "update cosine", "stops all", *names]) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, default=Path("runs/exact-frames"))
    parser.add_argument("--out", type=Path, default=Path("runs/audit-paper"))
    parser.add_argument("--budget-minutes", type=float, default=60.0)
    parser.add_argument("--defenses", default=DEFENSES)
    parser.add_argument("--markdown-only", action="store_true",
                        help="rewrite the Markdown from the results JSON, running nothing")
    args = parser.parse_args()
    if args.markdown_only:
        with atomic_path(RESULTS.with_suffix(".md")) as temporary:
            temporary.write_text(markdown(json.loads(RESULTS.read_text())))
        return
    heldout = args.work / "cnn-84x84-cnn84-ppo-float32.h5"
    train = args.work / "attacker-train-cnn84-ppo-768.h5"
    for path, made_by in ((heldout, "exact_frames.py"), (train, "exact_refiner.py")):
        if not path.is_file():
            parser.error(f"{path} is missing: run benchmarks/{made_by} first")
    torch.set_num_threads(2)
    config = AuditConfig(capture=str(heldout), out=str(args.out), train=str(train),
                         defenses=args.defenses.split(";"), budget_minutes=args.budget_minutes,
                         max_windows=8, training_free_windows=2, optimisation_windows=1)
    summary = Audit(config, progress=False, say=print).run()
    write_audit_report(args.out)
    clean = summary["stages"]["defense none"]["result"]["methods"]
    result = {"benchmark": "audit_paper", "config": summary["config"],
              "machine": machine(),
              "minutes": summary["minutes"], "verdict": summary["verdict"],
              "clean": {name: row.get("psnr_gain_over_mean_image")
                        for name, row in clean.items()
                        if row["kind"] not in ("reference", "control")
                        and row.get("psnr") is not None},
              "clean_methods": clean}
    with atomic_path(RESULTS) as temporary:
        temporary.write_text(json.dumps(result, indent=2) + "\n")
    with atomic_path(RESULTS.with_suffix(".md")) as temporary:
        temporary.write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
