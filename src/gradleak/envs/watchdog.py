"""The game engine dies with the Python process that started it.

ViZDoom starts its engine as a child process from a thread of its own, so `prctl(PR_SET_PDEATHSIG)`
cannot be set on it (the signal would also follow that thread, not the process). Instead one
small watchdog process per Python process holds the read end of a pipe whose only write end
stays in the parent. The parent registers each engine's PID on it; when the parent dies by any
means, SIGKILL included, the pipe reaches end-of-file and the watchdog kills the engines still
registered. An engine closed normally is unregistered first, so a recycled PID is never hit.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from pathlib import Path

# Runs with `python -S`: no site packages, no gradleak import, ~20 ms to start. It ignores
# Ctrl-C, which reaches the whole process group, so the parent can still close its engines.
WATCHDOG_CODE = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
pids = set()
for line in sys.stdin:
    sign, pid = line[:1], line[1:].strip()
    if pid.isdigit():
        (pids.add if sign == "+" else pids.discard)(int(pid))
for pid in pids:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
"""

_watchdog: subprocess.Popen[bytes] | None = None


def child_pids() -> set[int]:
    """This process's direct children, from every thread (Linux /proc); empty elsewhere."""
    tasks = Path(f"/proc/{os.getpid()}/task")
    found: set[int] = set()
    try:
        for task in tasks.iterdir():
            found.update(int(pid) for pid in (task / "children").read_text().split())
    except OSError:  # not Linux, or a kernel without CONFIG_PROC_CHILDREN
        return set()
    return found


def watch(pids: set[int]) -> None:
    """Have `pids` killed when this process dies."""
    if pids:
        _send("".join(f"+{pid}\n" for pid in sorted(pids)))


def unwatch(pids: set[int]) -> None:
    """`pids` were closed normally: never kill them (their numbers may be reused)."""
    if pids and _watchdog is not None:
        _send("".join(f"-{pid}\n" for pid in sorted(pids)))


def _send(lines: str) -> None:
    global _watchdog
    if _watchdog is None or _watchdog.poll() is not None:
        _watchdog = subprocess.Popen([sys.executable, "-S", "-c", WATCHDOG_CODE],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        atexit.register(_stop, _watchdog)
    assert _watchdog.stdin is not None
    try:
        _watchdog.stdin.write(lines.encode())
        _watchdog.stdin.flush()
    except BrokenPipeError:  # the watchdog was killed (its process group was): nothing to tell
        pass


def _stop(watchdog: subprocess.Popen[bytes]) -> None:
    """At a normal exit: end of input now, as at a crash (the engines still registered are
    killed), and the watchdog reaped, instead of left running for the interpreter to warn
    about."""
    if watchdog is not _watchdog or watchdog.poll() is not None or watchdog.stdin is None:
        return
    try:
        watchdog.stdin.close()
    except BrokenPipeError:
        pass
    try:
        watchdog.wait(timeout=5)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait()


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) must not hold the pipe open after its parent died.
    Its copy of the write end is pointed at /dev/null rather than closed, so the file object
    still owning that descriptor number can never close an unrelated file later."""
    global _watchdog
    if _watchdog is not None and _watchdog.stdin is not None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, _watchdog.stdin.fileno())
        os.close(devnull)
        _inherited.append(_watchdog)  # the parent's watchdog: never reaped or written here
    _watchdog = None


_inherited: list[subprocess.Popen[bytes]] = []
os.register_at_fork(after_in_child=_forget_in_child)
