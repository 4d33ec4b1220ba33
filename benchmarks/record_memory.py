"""`record()`'s peak memory against the rollout's length: it must not grow.

A rollout of S steps of the paper's `cnn` at 84×84 (0.94M parameters), one episode (the worst
case: the whole rollout is one episode), recorded by `gradleak.capture.record.record` in a fresh
process per S; peak RSS from the process's own getrusage. Beside it, the gradient matrix alone
(S × d float32) that a recorder holding every row in memory needs. Writes
benchmarks/results/record_memory.{json,md}.

    python benchmarks/record_memory.py [--steps 512 2048] [--work /tmp/record-memory]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from host import in_work_folder, machine

from gradleak.io import write_json

RESULTS = Path(__file__).parent / "results" / "record_memory"
CHILD = """
import json, resource, sys, time
import numpy as np, torch
from gradleak.capture.record import record
from gradleak.victims import create_victim
steps, out = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
victim = create_victim("cnn", frame_size=84)
rng = np.random.default_rng(0)
start = time.perf_counter()
record(victim, out, images=rng.integers(0, 256, (steps, 84, 84, 3), dtype=np.uint8),
       actions=np.arange(steps) % victim.config.num_actions,
       advantages=rng.normal(size=steps), returns=rng.normal(size=steps),
       episode_ids=np.zeros(steps, np.int64),
       loss={"value": 0.5, "entropy": 0.01, "clip": 0.2, "gamma": 0.99, "lam": 0.95})
print(json.dumps({"seconds": time.perf_counter() - start,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "parameters": sum(p.numel() for p in victim.parameters())}))
"""


def measure(steps: int, work: Path) -> dict:
    out = work / f"rollout-{steps}.h5"
    done = subprocess.run([sys.executable, "-c", CHILD, str(steps), str(out)], check=True,
                          capture_output=True, text=True)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row.update(steps=steps, file_mb=out.stat().st_size / 2 ** 20,
               all_rows_in_memory_mb=steps * row["parameters"] * 4 / 2 ** 20)
    out.unlink()
    return row


def markdown(rows: list[dict], host: str) -> str:
    lines = [f"# `record()`'s peak memory against the rollout's length ({host})", "",
             "Paper `cnn` at 84×84 (0.94M parameters), the whole rollout one episode, a fresh "
             "process per length. \"All rows in memory\": the gradient matrix a recorder that "
             "holds every row needs (steps × d float32), for comparison.", "",
             "| steps | peak RSS (MB) | all rows in memory (MB) | file (MB) | seconds |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['steps']} | {r['peak_rss_mb']:.0f} | {r['all_rows_in_memory_mb']:.0f} | "
              f"{r['file_mb']:.0f} | {r['seconds']:.1f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--work", type=Path, default=None,
                        help="where the captures are written (and removed); a temp folder by "
                        "default")
    args = parser.parse_args()
    rows = in_work_folder(measure, args.steps, args.work, "record-memory-")
    host = machine()
    write_json(RESULTS.with_suffix(".json"), {"host": host, "rows": rows})
    RESULTS.with_suffix(".md").write_text(markdown(rows, host))
    print(RESULTS.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
