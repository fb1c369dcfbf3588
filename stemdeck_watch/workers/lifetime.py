"""How long the processes the service starts live: ended by signal, never by asking them.

A process that is stopped (SIGSTOP, a debugger, a frozen container), hung in a driver, or
whose helper is gone answers nothing; the only ending that needs no answer is a signal sent
straight to it. Two things make that safe: a process is named by a pidfd where the kernel
has them (Linux 5.3), a handle that stays with that one process however its pid is handed
out later; and a signal for its process group is sent only while its leader is known not to
be gone (while any member of a group lives, the kernel does not hand its id to another).
And a child that must not outlive the process that started it asks the kernel to kill it
when that parent dies (`die_with_parent`, Linux), which also ends a stopped child.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    if sys.platform != "linux":
        return False
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(signum: int = signal.SIGKILL) -> bool:
    """Have the kernel send `signum` to this process when the thread that started it ends
    (Linux; the process's parent, for a single-threaded one). SIGKILL ends it also while it
    is stopped. False where it cannot be had."""
    return _prctl(PR_SET_PDEATHSIG, int(signum))


def adopt_orphans() -> bool:
    """Become the parent of this process's descendants whose own parent dies (a subreaper),
    so that they can still be found and ended from here (Linux)."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def pidfd(pid: int) -> int | None:
    """A pidfd for process `pid` (None where the kernel has none). It names that process only
    when taken while the pid cannot have been reused: by its parent before reaping it, or
    checked afterwards (`os.getppid()` still the one expected)."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def pidfds() -> bool:
    """Whether this kernel gives pidfds."""
    fd = pidfd(os.getpid())
    if fd is None:
        return False
    os.close(fd)
    return True


def exited(fd: int, timeout: float = 0.0) -> bool:
    """Whether the process of pidfd `fd` has ended, waiting up to `timeout` seconds for it
    (an ended process counts, reaped by its parent or not)."""
    try:
        readable, _, _ = select.select([fd], [], [], max(0.0, timeout))
    except (OSError, ValueError):
        return True  # a closed handle names nothing that runs
    return bool(readable)


def send(fd: int, signum: int) -> None:
    """Send `signum` to the process of pidfd `fd`, if it still runs."""
    with contextlib.suppress(OSError, AttributeError):
        signal.pidfd_send_signal(fd, signum)  # type: ignore[attr-defined]


def kill_group(group: int, signum: int = signal.SIGKILL) -> None:
    """Send `signum` to process group `group` (none there: nothing happens). The caller
    knows a member still lives (see the module's docstring)."""
    if sys.platform == "win32" or group <= 1:
        return
    with contextlib.suppress(OSError):
        os.killpg(group, signum)


def proc_stat(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state 0, ppid 1, pgrp 2,
    session 3, … starttime 19); OSError when the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def started_at(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, Linux), None if it is gone: a pid
    and its start time name one process, where a pid alone may be reused."""
    try:
        return int(proc_stat(pid)[19])
    except (OSError, IndexError, ValueError):
        return None


def session_members(session: int, also_children_of: int | None = None) -> list[int]:
    """The processes of session `session` (Linux /proc), and the children of process
    `also_children_of` (the orphans a subreaper adopted, whatever session they made)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = proc_stat(name)
            member = int(fields[3]) == session or int(fields[1]) == also_children_of
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if member and fields[0] != "Z":
            found.append(int(name))
    return found
