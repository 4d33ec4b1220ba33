"""How many threads torch and BLAS may use for a block of work."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import torch
from threadpoolctl import ThreadpoolController


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to `count` for the block."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch and BLAS (numpy's, scipy's) on one thread for the block: loops of small solves
    (a few hundred rows) lose more to waking a second thread than they gain from it."""
    with torch_threads(1), blas_controller().limit(limits=1):
        yield


@lru_cache(maxsize=1)
def blas_controller() -> Any:
    """The loaded BLAS libraries' thread controls, looked up once (0.7 ms a lookup)."""
    return ThreadpoolController().select(user_api="blas")
