"""Episodes written in a thread while this one forms the next episode's gradients.

The write is mostly LZ4 compression and HDF5 I/O, which h5py runs without the GIL, so it
proceeds beside torch's work on the gradients. One write is in flight at most: the caller
waits for it before handing over the next episode, so episodes are still written, and
committed, in order, and the gradient rows handed over stay untouched while they are written
(the caller alternates two buffers). The file's crash safety is the writer's, unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any


class InlineWrites:
    """The same interface, each write done at once (capture.background_write off)."""

    buffers = 1  # the rows handed over are written before the next episode's are formed

    def __init__(self, write: Callable[..., Any]) -> None:
        self._write = write
        self.seconds = 0.0
        self.waited = 0.0

    def submit(self, *args: Any) -> None:
        tick = time.perf_counter()
        try:
            self._write(*args)
        finally:
            self.seconds += time.perf_counter() - tick

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


class BackgroundWrites:
    buffers = 2  # one episode's rows being written while the next one's are formed

    def __init__(self, write: Callable[..., Any]) -> None:
        self._inline = InlineWrites(write)  # run in the thread: it times the writes there
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradleak-writer")
        self._pending: Future | None = None
        self.waited = 0.0  # the caller's time waiting for a write to end

    @property
    def seconds(self) -> float:
        """The writes' own time, in the thread."""
        return self._inline.seconds

    def submit(self, *args: Any) -> None:
        self.wait()
        self._pending = self._executor.submit(self._inline.submit, *args)

    def wait(self) -> None:
        """Until the write in flight ends; its error, if any, is raised here."""
        if self._pending is None:
            return
        tick = time.perf_counter()
        pending, self._pending = self._pending, None
        try:
            pending.result()
        finally:
            self.waited += time.perf_counter() - tick

    def close(self) -> None:
        """After an error or Ctrl-C too: the file must not be closed under a write in flight
        (whose own error, if any, gives way to the one already raised)."""
        if self._pending is not None:
            wait([self._pending])
            self._pending = None
        self._executor.shutdown(wait=True)
