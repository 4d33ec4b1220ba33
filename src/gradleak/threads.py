"""How many threads torch and BLAS may use for a block of work."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Any, TypeVar

import torch
from threadpoolctl import ThreadpoolController

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


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


@contextlib.contextmanager
def computed_ahead(compute: Callable[[K], V], keys: Sequence[K]
                   ) -> Iterator[Callable[[K], V]]:
    """`take(key)` returns compute(key), for `keys` taken in their order: the caller computes
    the first itself while a worker thread computes the second, and each `take` queues the
    next key for the worker, which so keeps at most two ahead of the caller. For work made of a
    few large operations that release the Python lock while they run (LAPACK, convolutions),
    beside small ones in the caller that hold it: the caller never waits for the first key (a
    worker computing it would leave the caller idle for it on every call), and a worker slower
    than the caller is never idle. A key not queued is computed in the caller's thread. The
    worker takes the caller's grad mode and torch thread count, which torch, MKL and OpenMP
    keep per thread: a worker left at their defaults built autograd graphs under the caller's
    `no_grad` and ran LAPACK on two threads inside `one_thread`, and a completion's inputs
    came out different in their last bits."""
    if len(keys) < 2:
        yield compute
        return
    pending = iter(keys[1:])
    futures: dict[K, Future[V]] = {}
    grad = torch.is_grad_enabled()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradleak-ahead",
                              initializer=torch.set_num_threads,
                              initargs=(torch.get_num_threads(),))

    def as_the_caller(key: K) -> V:
        with torch.set_grad_enabled(grad):
            return compute(key)

    def submit_next() -> None:
        for key in pending:
            futures[key] = pool.submit(as_the_caller, key)
            return

    def take(key: K) -> V:
        submit_next()
        future = futures.pop(key, None)
        return compute(key) if future is None else future.result()

    submit_next()
    try:
        yield take
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
