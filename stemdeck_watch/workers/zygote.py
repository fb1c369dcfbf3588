"""Starting a worker process: forked from a process that has imported torch already.

A fresh interpreter pays Python's start and torch's import at every worker start: 3.2 s of CPU
on a 2-core AMD Zen 3, and a worker starts at every cancel (a cancel ends its worker) and
after every crash. On Linux the service instead keeps one small process, the zygote, that
imports torch, demucs and the worker's code once and then forks each worker on request: the
worker is running its loop a few milliseconds after the request. The zygote does nothing
else (no thread, no CUDA, no model), so a fork of it is what a fresh interpreter would be
after those imports.

The protocol is one AF_UNIX SOCK_SEQPACKET socket pair: the service sends a start (JSON:
the worker's argv, environment and working folder) with the worker's stdin, stdout and stderr
attached (SCM_RIGHTS); the zygote answers `{"started": pid}`, and `{"exited": pid, "code":
c}` once it has reaped that worker. A signal for a worker goes through the zygote too: as its
parent, it alone knows whether that pid is still the worker's. When the service's process ends, its end of the socket
closes and the zygote exits; its workers, whose parent it was, then notice and exit too
(worker.watch_parent), as they do when the service itself is their parent.

Elsewhere (macOS, Windows), or with STEMDECK_WORKER_START=exec, a worker is a fresh
interpreter. `start` returns either way something with Popen's pipes and life (`pid`,
`returncode`, `poll`, `wait`, `terminate`, `kill`).

    python -m stemdeck_watch.workers.zygote FD     (started by the service, never by hand)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import IO, Any, Protocol, Sequence

log = logging.getLogger(__name__)

START_ENV = "STEMDECK_WORKER_START"  # "exec": a fresh interpreter for every worker
WORKER_MODULE = "stemdeck_watch.workers.worker"
MESSAGE_BYTES = 1 << 20  # a request's JSON: argv, environment, folder
START_TIMEOUT = 300.0  # seconds for the zygote's imports and one fork (a worker's own start)
READER = "zygote-reader"  # the service's thread that reads what the zygote reports
LOST = -int(signal.SIGKILL)  # the exit code of a worker whose zygote is gone (see _Zygote)


class WorkerProcess(Protocol):
    """A started worker: its pipes and its life, as subprocess.Popen has them."""

    @property
    def stdin(self) -> IO[str] | None: ...

    @property
    def stdout(self) -> IO[str] | None: ...

    @property
    def stderr(self) -> IO[str] | None: ...

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def forks() -> bool:
    """Whether workers are forked from the zygote here."""
    return sys.platform == "linux" and os.environ.get(START_ENV) != "exec"


def ready() -> None:
    """Start the zygote now, if workers fork from it (the tests, before counting children)."""
    if forks():
        _zygote()


def pid() -> int | None:
    """The running zygote's process id (None: none runs)."""
    with _lock:
        return _current.pid if _current is not None and _current.alive() else None


def start(argv: list[str], env: dict[str, str]) -> WorkerProcess:
    """The worker (`python -m stemdeck_watch.workers.worker ARGV`) with `env` as its whole
    environment, in a session of its own (Ctrl-C goes to the service, which stops it)."""
    if forks():
        return _zygote().start(argv, env)
    kwargs: dict[str, Any] = {}
    if sys.platform == "win32":
        kwargs["creationflags"] = subprocess.CREATE_NEW_PROCESS_GROUP  # type: ignore[attr-defined]
    else:
        kwargs["start_new_session"] = True
    return subprocess.Popen(
        [sys.executable, "-m", WORKER_MODULE, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
        encoding="utf-8",
        errors="replace",
        bufsize=1,
        **kwargs,
    )


_lock = threading.Lock()
_current: _Zygote | None = None


def _zygote() -> _Zygote:
    """This process's zygote, started (again, if the last one died) when needed."""
    global _current
    with _lock:
        if _current is None or not _current.alive():
            _current = _Zygote()
        return _current


class _Forked:
    """A worker the zygote forked: its pipes, and its exit code once the zygote reports it."""

    def __init__(self, zygote: _Zygote, pid: int, pipes: Sequence[IO[str]]):
        self._zygote, self.pid = zygote, pid
        self.stdin: IO[str] | None = pipes[0]
        self.stdout: IO[str] | None = pipes[1]
        self.stderr: IO[str] | None = pipes[2]

    @property
    def returncode(self) -> int | None:
        return self._zygote.wait(self.pid, 0)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._zygote.wait(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"separation worker {self.pid}", timeout or 0.0)
        return code

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self.returncode is None:
            self._zygote.signal(self.pid, signum)


class _Zygote:
    """The service's side: the zygote process, one request at a time, and a reader thread
    that files the exit codes it reports."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C goes to the service alone
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._socket = ours
        self._request = threading.Lock()  # one start at a time: its answer is the next one
        self._state = threading.Condition()
        self._started: list[int] = []
        self._exits: dict[int, int] = {}
        self._mine: set[int] = set()
        self._gone = False
        self._reader = threading.Thread(target=self._read, name=READER, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._process.pid

    def alive(self) -> bool:
        with self._state:
            return not self._gone

    def start(self, argv: list[str], env: dict[str, str]) -> _Forked:
        ends = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr: (read, write) each
        theirs = [ends[0][0], ends[1][1], ends[2][1]]
        ours = [ends[0][1], ends[1][0], ends[2][0]]
        request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode()
        try:
            with self._request:
                socket.send_fds(self._socket, [request], theirs)
                with self._state:
                    if not self._state.wait_for(lambda: self._started or self._gone, START_TIMEOUT):
                        raise RuntimeError(
                            f"the worker zygote did not answer in {START_TIMEOUT:.0f} s"
                        )
                    if not self._started:
                        raise RuntimeError("the worker zygote ended (see the log above)")
                    pid = self._started.pop(0)
                    self._mine.add(pid)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:  # the worker has its own copies
                os.close(fd)
        pipes = [
            open(ours[0], "w", encoding="utf-8", buffering=1),
            open(ours[1], encoding="utf-8", errors="replace"),
            open(ours[2], encoding="utf-8", errors="replace"),
        ]
        return _Forked(self, pid, pipes)

    def signal(self, pid: int, signum: int) -> None:
        """Have the zygote send `signum` to its worker `pid`, if that one has not ended."""
        with contextlib.suppress(OSError):  # a zygote gone has no worker left to stop
            self._socket.send(json.dumps({"signal": pid, "signum": int(signum)}).encode())

    def wait(self, pid: int, timeout: float | None) -> int | None:
        """The exit code of worker `pid`, waiting up to `timeout` for it (None: running)."""
        with self._state:
            self._state.wait_for(lambda: pid in self._exits, timeout)
            return self._exits.get(pid)

    def _read(self) -> None:
        try:
            while True:
                data = self._socket.recv(MESSAGE_BYTES)
                if not data:
                    break
                message = json.loads(data)
                with self._state:
                    if "started" in message:
                        self._started.append(int(message["started"]))
                    else:
                        self._exits[int(message["exited"])] = int(message["code"])
                    self._state.notify_all()
        except (OSError, ValueError) as exc:
            log.warning("lost the worker zygote: %s", exc)
        with self._state:
            # its workers lose their parent and exit by themselves (worker.watch_parent);
            # to the service they are gone now, and the next start brings a new zygote
            self._gone = True
            for pid in self._mine - set(self._exits):
                self._exits[pid] = LOST
            self._state.notify_all()
        self._socket.close()
        self._process.wait()


# ---------------------------------------------------------------- the zygote process


def main(fd: int) -> int:
    import demucs.apply  # noqa: F401 - the imports every worker needs, made once here
    import demucs.htdemucs  # noqa: F401
    import demucs.pretrained  # noqa: F401
    import torch  # noqa: F401

    import stemdeck_watch.workers.worker  # noqa: F401

    channel = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    children: set[int] = set()
    try:
        while True:
            readable, _, _ = select.select([channel.fileno(), wake_r], [], [])
            if wake_r in readable:
                os.read(wake_r, 4096)
            _reap(channel, children)
            if channel.fileno() not in readable:
                continue
            data, fds, _flags, _address = socket.recv_fds(channel, MESSAGE_BYTES, 3)
            if not data:
                return 0  # the service's process is gone
            request = json.loads(data)
            if "signal" in request:
                if int(request["signal"]) in children:  # not reaped: still that worker
                    os.kill(int(request["signal"]), int(request["signum"]))
                continue
            pid = os.fork()
            if pid == 0:
                channel.close()
                os.close(wake_r)
                os.close(wake_w)
                _become_worker(request, fds)
            children.add(pid)
            for fd in fds:
                os.close(fd)
            channel.send(json.dumps({"started": pid}).encode())
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the service's process is gone


def _reap(channel: socket.socket, children: set[int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        channel.send(json.dumps({"exited": pid, "code": code}).encode())


def _become_worker(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: what `python -m stemdeck_watch.workers.worker` would be."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        os.setsid()
        for fd, target in zip(fds, (0, 1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", errors="replace", closefd=False, buffering=1)
        sys.stderr = open(2, "w", encoding="utf-8", errors="replace", closefd=False, buffering=1)
        from stemdeck_watch.workers.worker import main as worker_main

        code = worker_main(request["argv"])
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)  # as the worker's own __main__: no interpreter teardown


if __name__ == "__main__":
    raise SystemExit(main(int(sys.argv[1])))
