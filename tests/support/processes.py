"""The processes a service started, found and stopped as a stuck machine would stop them.

A process is the service's when its environment at start holds `FAMILY_ENV` with the test's
mark: every process the service starts inherits its environment (the zygote, the build and its
compilers), and a worker forked from a zygote keeps its zygote's (/proc/PID/environ shows the
environment a process began with). So a service started with a mark can be checked for
anything of it left afterwards, stopped (state T) or adopted by PID 1 included.
"""

from __future__ import annotations

import os
import signal
import uuid
from typing import Callable

from stemdeck_watch.workers import zygote

from support.helpers import processes, wait_for

FAMILY_ENV = "STEMDECK_TEST_FAMILY"


def new_mark() -> str:
    return uuid.uuid4().hex


def marked(mark: str) -> dict[int, str]:
    """The live processes (not zombies) whose environment at start holds the mark, but this
    one: pid -> state letter (R, S, T, …)."""
    needle = f"{FAMILY_ENV}={mark}".encode()
    found = {}
    for pid, (_parent, state) in processes().items():
        if pid == os.getpid() or state == "Z":
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                environment = handle.read().split(b"\0")
        except OSError:
            continue
        if needle in environment:
            found[pid] = state
    return found


def wait_none_left(mark: str, timeout: float, spare: Callable[[], set[int]] = set) -> None:
    """Wait until no process of the mark is left (but those `spare` names)."""
    wait_for(
        lambda: not set(marked(mark)) - spare(),
        timeout,
        lambda: f"no process of the service left; left: {marked(mark)}",
    )


def children_of(pid: int) -> set[int]:
    """The live children of process `pid`."""
    return {p for p, (parent, state) in processes().items() if parent == pid and state != "Z"}


def zygote_of(service: int) -> int | None:
    """The zygote a service process (`stemdeck-watch run`) forks its workers from."""
    for pid in children_of(service):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                if zygote.__name__.encode() in handle.read():
                    return pid
        except OSError:
            continue
    return None


def freeze(pid: int) -> None:
    """SIGSTOP `pid`: a process that hangs, answers nothing and holds what it holds."""
    os.kill(pid, signal.SIGSTOP)


def kill(pid: int) -> None:
    """SIGKILL `pid`, if it is still there."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def gone_or_zombie(pids: list[int] | set[int]) -> bool:
    """Whether none of `pids` runs (a zombie waits for its parent: it runs nothing)."""
    table = processes()
    return all(pid not in table or table[pid][1] == "Z" for pid in pids)
