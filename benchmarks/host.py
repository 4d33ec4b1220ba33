"""What the benchmarks share: the host line their JSON carries beside its figures, and a work
folder for the files a measurement writes."""

from __future__ import annotations

import platform
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def machine() -> str:
    return (f"{platform.machine()}, {torch.get_num_threads()} threads, torch "
            f"{torch.__version__}, no GPU")


def in_work_folder(measure: Callable[[int, Path], dict[str, Any]], sizes: list[int],
                   work: Path | None, prefix: str) -> list[dict[str, Any]]:
    """`measure(size, folder)` for each size, in `work` (kept) or a temporary folder (removed
    afterwards, whatever happens)."""
    folder = work or Path(tempfile.mkdtemp(prefix=prefix))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return [measure(size, folder) for size in sizes]
    finally:
        if work is None:
            shutil.rmtree(folder)


def write_results(path: Path, result: dict[str, Any], text: str) -> None:
    """The results JSON at `path` and its Markdown beside it (atomically), then the Markdown
    printed."""
    import json

    from gradleak.io import atomic_path

    with atomic_path(path) as out:
        out.write_text(json.dumps(result, indent=1))
    with atomic_path(path.with_suffix(".md")) as out:
        out.write_text(text)
    print(text)
