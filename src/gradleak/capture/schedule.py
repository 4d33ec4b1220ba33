"""A sharded capture as a job array: the command of each shard, and a Slurm array script."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from gradleak.capture.plan import shard_output
from gradleak.io import atomic_path


def flags_of(args: argparse.Namespace, actions: list[argparse.Action]) -> list[str]:
    """The command-line flags that give `args` these actions' values (defaults left out)."""
    flags: list[str] = []
    for action in actions:
        value, option = getattr(args, action.dest), action.option_strings[0]
        if value is None or value == action.default:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            flags.append(option)
        elif isinstance(action, argparse._AppendAction):
            for item in value:
                flags += [option, str(item)]
        else:
            flags += [option, str(value)]
    return flags


def shard_command(args: argparse.Namespace, actions: list[argparse.Action], shard: str,
                  shell: bool = False) -> str:
    """One shard's `gradleak capture`; --resume so a preempted or retried task continues.
    `shell`: `shard` is shell text to expand (a job array's task id), not quoted."""
    head = shlex.join(["gradleak", "capture", *flags_of(args, actions), "--shard"])
    return f"{head} {shard if shell else shlex.quote(shard)} --resume --quiet"


def merge_command(out: Path, shards: int) -> str:
    files = [str(shard_output(out, (i, shards))) for i in range(shards)]
    return shlex.join(["gradleak", "merge", *files, "--out", str(out)])


def job_lines(args: argparse.Namespace, actions: list[argparse.Action], shards: int
              ) -> tuple[list[str], str]:
    """(one command per shard, the merge to run once all have finished)."""
    return ([shard_command(args, actions, f"{i}/{shards}") for i in range(shards)],
            merge_command(Path(args.out), shards))


def slurm_script(args: argparse.Namespace, actions: list[argparse.Action], shards: int) -> str:
    command = shard_command(args, actions, f'"${{SLURM_ARRAY_TASK_ID}}/{shards}"', shell=True)
    return "\n".join([
        "#!/bin/bash",
        "#SBATCH --job-name=gradleak-capture",
        f"#SBATCH --array=0-{shards - 1}",
        "#SBATCH --cpus-per-task=2",
        "# two cores: the rollout on one, the gradients and the writes on the other",
        "#SBATCH --requeue",
        "# written by `gradleak capture-plan`; every task resumes its own shard if requeued",
        "set -euo pipefail",
        command,
        f"# once every task has finished: {merge_command(Path(args.out), shards)}",
        ""])


def write_script(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
        tmp.chmod(0o755)
