"""`computed_ahead`: each key computed once, in a worker thread, one ahead of the caller."""

from __future__ import annotations

import threading

import pytest
import torch

from gradleak.threads import computed_ahead


def test_each_key_is_computed_once_the_first_by_the_caller_the_rest_by_the_worker() -> None:
    computed: list[tuple[int, str]] = []

    def square(key: int) -> int:
        computed.append((key, threading.current_thread().name))
        return key * key

    here = threading.current_thread().name
    with computed_ahead(square, [3, 1, 4, 5]) as take:
        assert [take(3), take(1), take(4), take(5)] == [9, 1, 16, 25]
        assert take(7) == 49  # not among the keys: computed here
    assert sorted(key for key, _ in computed) == [1, 3, 4, 5, 7]
    threads = dict(computed)
    assert threads[3] == here and threads[7] == here
    assert all(threads[key].startswith("gradleak-ahead") for key in (1, 4, 5))


def test_the_worker_starts_before_the_caller_asks_and_keeps_two_ahead_at_most() -> None:
    started = {key: threading.Event() for key in range(5)}

    def compute(key: int) -> int:
        started[key].set()
        return key

    with computed_ahead(compute, [0, 1, 2, 3, 4]) as take:
        # nothing has been taken: the second key runs already (a worker computing only on
        # demand would leave this wait to time out)
        assert started[1].wait(timeout=10)
        assert not started[0].is_set()  # the first is the caller's
        assert take(0) == 0 and started[2].wait(timeout=10)
        assert not started[3].is_set()  # queued only when 1 is taken: memory stays bounded
        assert [take(1), take(2), take(3), take(4)] == [1, 2, 3, 4]


def test_a_failure_in_the_worker_is_raised_where_its_key_is_taken_and_nothing_is_left() -> None:
    def compute(key: int) -> int:
        if key == 1:
            raise ValueError("step 1 is singular")
        return key

    before = threading.active_count()
    with pytest.raises(ValueError, match="step 1 is singular"):
        with computed_ahead(compute, [0, 1, 2]) as take:
            take(0)
            take(1)
    assert threading.active_count() == before


def test_fewer_than_two_keys_start_no_thread() -> None:
    names = []
    with computed_ahead(lambda key: names.append(threading.current_thread().name), [5]) as take:
        take(5)
    assert names == [threading.current_thread().name]


def test_the_worker_computes_in_the_callers_grad_mode() -> None:
    """Grad mode is per thread: a worker at the default built autograd graphs for work the
    caller ran under no_grad (and its completions' rounding differed)."""
    weight = torch.ones(3, requires_grad=True)
    with torch.no_grad(), computed_ahead(lambda key: weight * key, [1, 2, 3]) as take:
        products = [take(key) for key in (1, 2, 3)]
    assert not any(product.requires_grad for product in products)
    with computed_ahead(lambda key: weight * key, [1, 2]) as take:
        assert all(take(key).requires_grad for key in (1, 2))
