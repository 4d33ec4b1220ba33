"""Episodes rolled out in a child process, ahead of the gradients and the writer.

The engine and the rollout's forward passes run on one core while this process forms the
per-step gradients and writes them on the other: a bounded queue (`depth` episodes) keeps the
child at most that far ahead, so memory stays flat. The child is forked, so it rolls out with
the very victim object given (a model wrapped in this session included). It dies with this
process (PR_SET_PDEATHSIG; its own engine then dies with it through the engine watchdog), so a
capture killed with SIGKILL leaves no rollout or engine behind, and the file's crash safety is
the writer's, unchanged: episodes are written, and committed, in order, by this process.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from gradleak.errors import CaptureFileError

PR_SET_PDEATHSIG = 1
POLL_SECONDS = 1.0
STOP_SECONDS = 30.0  # for the child to finish its episode and close its engine when asked


@dataclass
class Produced:
    index: int
    scene: str
    episode: Any
    bootstrap: float
    seconds: float  # the rollout's wall time, in the child


# (episode index, steps still wanted) → (scene, episode, bootstrap): runs in the child
Rollout = Callable[[Any, int, int], tuple[str, Any, float]]


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _produce(make_env: Callable[[], Any], rollout: Rollout, control: multiprocessing.Queue,
             out: multiprocessing.Queue, stop: Any) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    env = None
    ending: Any = None
    try:
        env = make_env()  # while the parent opens (or reopens) its file
        order = _get(control, stop)
        if order is not None:
            index, remaining = order
            while remaining > 0 and not stop.is_set():
                tick = time.perf_counter()
                scene, episode, bootstrap = rollout(env, index, remaining)
                if not _put(out, Produced(index, scene, episode, bootstrap,
                                          time.perf_counter() - tick), stop):
                    break
                remaining -= len(episode)
                index += 1
    except BaseException as error:  # noqa: BLE001  (handed to the parent, which raises it)
        ending = ("error", error, traceback.format_exc())
    finally:
        # The engine is closed before the parent hears of the end: a parent that then exits
        # at once must not leave it running.
        if env is not None:
            env.close()
        if ending is not None:
            _put(out, ending, stop)
        _put(out, None, stop)


def _get(channel: multiprocessing.Queue, stop: Any) -> Any:
    """The next item, or None once the parent asks the child to stop."""
    while not stop.is_set():
        try:
            return channel.get(timeout=POLL_SECONDS)
        except queue.Empty:
            continue
    return None


def _put(channel: multiprocessing.Queue, item: Any, stop: Any) -> bool:
    """Put, unless the parent asks the child to stop first (it no longer reads)."""
    while not stop.is_set():
        try:
            channel.put(item, timeout=POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False


class EpisodeProducer:
    """Forks the rollout process, which starts its engine at once; `start(first, remaining)`
    then has it roll out episodes `first`, `first + 1`, ... until `remaining` steps are done,
    each while the caller handles the one before. Forked before the capture file is opened, so
    neither the child nor its engine holds the file."""

    def __init__(self, make_env: Callable[[], Any], rollout: Rollout, depth: int = 2) -> None:
        context = multiprocessing.get_context("fork")
        self.control: multiprocessing.Queue = context.Queue(maxsize=1)
        self.queue: multiprocessing.Queue = context.Queue(maxsize=depth)
        self.stop = context.Event()
        self.process = context.Process(
            target=_produce, daemon=True, name="gradleak-rollout",
            args=(make_env, rollout, self.control, self.queue, self.stop))
        self.process.start()

    def start(self, first: int, remaining: int) -> EpisodeProducer:
        self.control.put((first, remaining))
        return self

    def __iter__(self) -> Iterator[Produced]:
        while True:
            item = self._next()
            if item is None:
                return
            if isinstance(item, tuple) and item[0] == "error":
                _, error, text = item
                if isinstance(error, Exception):
                    raise error
                raise CaptureFileError(f"the rollout process failed:\n{text}")
            yield item

    def _next(self) -> Any:
        while True:
            try:
                return self.queue.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not self.process.is_alive():
                    raise CaptureFileError(
                        f"the rollout process died (exit code {self.process.exitcode}) before "
                        "finishing its episodes; the partial file is resumable") from None

    def close(self) -> None:
        """Asks the child to stop and waits for it to close its engine; it is terminated only
        if it does not stop in time (its engine then dies through the watchdog)."""
        self.stop.set()
        self.process.join(timeout=STOP_SECONDS)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)
        for channel in (self.control, self.queue):
            channel.close()
            channel.cancel_join_thread()  # nothing the child still needs is left unsent
