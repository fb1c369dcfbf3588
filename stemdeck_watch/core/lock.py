"""One service per state dir: an OS file lock, released by the OS even after a crash.

Two services on the same registry would both take jobs and separate every song twice. The
lock file also records the pid, which is how `status` tells whether the service is running.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from stemdeck_watch.core.errors import StemdeckError

LOCK_NAME = "service.lock"


class AlreadyRunning(StemdeckError):
    pass


class ServiceLock:
    def __init__(self, path: Path, handle: int):
        self.path = path
        self._fd = handle

    @classmethod
    def acquire(cls, state_dir: Path) -> ServiceLock:
        path = state_dir / LOCK_NAME
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            _lock(fd)
        except OSError:
            os.close(fd)
            pid = running_pid(state_dir)
            raise AlreadyRunning(
                f"could not start: another stemdeck-watch service{f' (pid {pid})' if pid else ''} "
                f"already uses the state folder {state_dir}; stop it first"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        return cls(path, fd)

    def release(self) -> None:
        if self._fd >= 0:
            try:
                os.ftruncate(self._fd, 0)
            finally:
                os.close(self._fd)  # closing drops the lock
                self._fd = -1


def running_pid(state_dir: Path) -> int | None:
    """The pid of the service using `state_dir`, or None if none is running."""
    try:
        text = (state_dir / LOCK_NAME).read_text().strip()
        pid = int(text)
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def _alive(pid: int) -> bool:
    if sys.platform == "win32":
        import ctypes

        handle = ctypes.windll.kernel32.OpenProcess(0x1000, False, pid)  # type: ignore[attr-defined]
        if handle:
            ctypes.windll.kernel32.CloseHandle(handle)  # type: ignore[attr-defined]
        return bool(handle)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lock(fd: int) -> None:
    if sys.platform == "win32":
        import msvcrt

        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    else:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
