"""The host line a benchmark's JSON carries beside its figures."""

from __future__ import annotations

import platform

import torch


def machine() -> str:
    return (f"{platform.machine()}, {torch.get_num_threads()} threads, torch "
            f"{torch.__version__}, no GPU")
