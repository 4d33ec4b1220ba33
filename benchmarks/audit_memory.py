"""`gradleak audit`'s peak memory against the capture's length: it must not grow with it.

A held-out capture of S steps (episodes of 64) of a NatureCNN-size policy at 64×64 RGB (0.60M
parameters, the size of a CleanRL-style agent on such frames), recorded and then audited under
quant:8, prune:0.1 and dpsgd:eps=1 within 6 minutes, in a fresh process per S; peak RSS from
the process's own getrusage (the recording's peak is below the audit's). Beside it, one
update's gradient block (512 steps × d float32), which the update-cosine stage held at once,
with copies, before it read blocks in pieces. Writes benchmarks/results/audit_memory.{json,md}.

    python benchmarks/audit_memory.py [--steps 512 1024] [--work /tmp/audit-memory]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from host import in_work_folder, machine

from gradleak.io import write_json

RESULTS = Path(__file__).parent / "results" / "audit_memory"
DEFENSES = ["quant:8", "prune:0.1", "dpsgd:eps=1"]
CHILD = """
import json, resource, sys, time
import numpy as np, torch
import gradleak
from gradleak.victims import create_victim
steps, work, defenses = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
torch.manual_seed(0)
victim = create_victim("nature-cnn", frame_size=64)
rng = np.random.default_rng(0)
capture = f"{work}/heldout-{steps}.h5"
gradleak.record(victim, capture, images=rng.integers(0, 256, (steps, 64, 64, 3), dtype=np.uint8),
                actions=rng.integers(0, victim.config.num_actions, steps),
                advantages=rng.normal(size=steps), returns=rng.normal(size=steps),
                episode_ids=np.arange(steps) // 64, split="heldout",
                loss={"value": 0.5, "entropy": 0.01, "clip": 0.2, "gamma": 0.99, "lam": 0.95})
start = time.perf_counter()
verdict = gradleak.audit(capture, out=f"{work}/audit-{steps}", defenses=defenses,
                         budget_minutes=6, progress=False)
print(json.dumps({"audit_seconds": time.perf_counter() - start,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "parameters": sum(p.numel() for p in victim.parameters()),
                  "defenses_run": [d["spec"] for d in verdict.details["defenses"]],
                  "skipped": verdict.skipped}))
"""


def measure(steps: int, work: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(steps), str(work),
                           json.dumps(DEFENSES)], check=True, capture_output=True, text=True)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row.update(steps=steps, update_block_mb=min(steps, 512) * row["parameters"] * 4 / 2 ** 20)
    return row


def markdown(rows: list[dict], host: str) -> str:
    lines = [f"# `gradleak audit`'s peak memory against the capture's length ({host})", "",
             "NatureCNN-size policy at 64×64 RGB (0.60M parameters), held-out captures in "
             f"episodes of 64 steps, audited under {', '.join(DEFENSES)} in 6 minutes, a fresh "
             "process per length. \"One update's block\": 512 steps × d float32, what the "
             "update-cosine stage held at once (with copies) before it read blocks in pieces.",
             "", "| steps | peak RSS (MB) | one update's block (MB) | audit seconds | defenses "
             "run |", "|---|---|---|---|---|"]
    lines += [f"| {r['steps']} | {r['peak_rss_mb']:.0f} | {r['update_block_mb']:.0f} | "
              f"{r['audit_seconds']:.0f} | {', '.join(r['defenses_run'])} |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--work", type=Path, default=None,
                        help="where the captures and audits are written (and removed); a temp "
                        "folder by default")
    args = parser.parse_args()
    rows = in_work_folder(measure, args.steps, args.work, "audit-memory-")
    host = machine()
    write_json(RESULTS.with_suffix(".json"), {"host": host, "defenses": DEFENSES, "rows": rows})
    RESULTS.with_suffix(".md").write_text(markdown(rows, host))
    print(RESULTS.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
