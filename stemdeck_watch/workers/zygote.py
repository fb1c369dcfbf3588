"""Starting a worker process: forked from a process that has imported torch already.

A fresh interpreter pays Python's start and torch's import at every worker start: 3.2 s of CPU
on a 2-core AMD Zen 3, and a worker starts at every cancel (a cancel ends its worker) and
after every crash. On Linux the service instead keeps one small process, the zygote, that
imports torch, demucs and the worker's code once and then forks each worker on request: the
worker is running its loop a few milliseconds after the request. The zygote does nothing
else (no thread, no CUDA, no model), so a fork of it is what a fresh interpreter would be
after those imports.

The protocol is one AF_UNIX SOCK_SEQPACKET socket pair: the service sends a start (JSON: a
number of its own for this start, the worker's argv, the changes to the zygote's environment
that make the worker's, and its working folder) with the worker's stdin, stdout and stderr
attached (SCM_RIGHTS); the zygote answers `{"started": pid, "start": n}`, and `{"exited": pid,
"start": n, "code": c}` once it has reaped that worker. Everything is keyed by the start's
number, never by the pid: a pid comes round again in a long-running service, and a late answer
to a start given up on must not be taken for the next one's. With `{"started": …}` comes a
pidfd of the worker (SCM_RIGHTS), taken by the zygote before it could reap it, so it names that
worker for certain: the service signals its worker's process group itself (`end`) and sees its
end on that handle (`running`, `gone`), so a zygote that is stopped, hung or lost never holds a
stop up. Its exit code still comes from the zygote, its parent, when the zygote can tell it.
When the service's process ends, its end of the socket closes and the zygote exits; its
workers die with it (the parent-death signal, which ends a stopped worker too). A worker whose
zygote was lost before it reported the worker's end is `lost(...)`: its exit code is not known,
and it is not a sign of anything the worker did (not, say, the out-of-memory killer).

The zygote says once that its imports are done (`{"ready": pid}`): a start asked of a zygote
that is ready must be answered within FORK_TIMEOUT (a fork takes milliseconds), one asked
while it imports within START_TIMEOUT; a zygote that does not answer in time is killed and
the next start brings a new one. A start may be given up on (a cancel, a shutdown) at once.

Both ends of the protocol live in this module (the service's `_Zygote`, the zygote's
`main`), so that a message is changed on both sides at once.

Elsewhere (macOS, Windows, a kernel without pidfds), or with STEMDECK_WORKER_START=exec, a
worker is a fresh interpreter, in a session of its own that `end` signals. `start` returns either way something with Popen's pipes and life (`pid`,
`returncode`, `poll`, `wait`, `terminate`, `kill`).

    python -m stemdeck_watch.workers.zygote FD PID   (started by the service, never by hand)
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any, Callable, Protocol, Sequence

from stemdeck_watch.workers import lifetime

log = logging.getLogger(__name__)

START_ENV = "STEMDECK_WORKER_START"  # "exec": a fresh interpreter for every worker
WORKER_MODULE = "stemdeck_watch.workers.worker"
MESSAGE_BYTES = 1 << 20  # a request's JSON: argv, environment, folder
START_TIMEOUT = 300.0  # seconds for the zygote's imports and one fork (a worker's own start)
FORK_TIMEOUT = 15.0  # seconds for a zygote done with its imports to fork one worker
READER = "zygote-reader"  # the service's thread that reads what the zygote reports
LOST = -int(signal.SIGKILL)  # the exit code given a worker whose zygote is gone (see lost)


class StartFailed(OSError):
    """A worker could not be started: the zygote ended, did not answer, or refused the
    request. Like a worker that dies as it starts, a fault of the machine, not of a song."""


class StartAbandoned(StartFailed):
    """The caller gave the start up (a cancel, a shutdown) before the zygote answered."""


class _TooLarge(StartFailed):
    """The start request does not fit one message (the environment grew by hundreds of KB
    since the zygote started): that worker starts as a fresh interpreter."""


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
    return sys.platform == "linux" and os.environ.get(START_ENV) != "exec" and _has_pidfds()


_pidfds: list[bool] = []


def _has_pidfds() -> bool:
    if not _pidfds:
        _pidfds.append(lifetime.pidfds())
    return _pidfds[0]


def ready() -> None:
    """Start the zygote now, if workers fork from it (the tests, before counting children)."""
    if forks():
        _zygote()


def pid() -> int | None:
    """The running zygote's process id (None: none runs)."""
    with _lock:
        return _current.pid if _current is not None and _current.alive() else None


def lost(process: WorkerProcess) -> bool:
    """Whether `process` ended with its zygote, its own exit code unknown."""
    return isinstance(process, _Forked) and process.lost


def running(process: WorkerProcess) -> bool:
    """Whether `process` has not ended (known without its zygote's answer)."""
    if isinstance(process, _Forked):
        return not process.exited()
    return process.poll() is None


def end(process: WorkerProcess) -> None:
    """SIGKILL `process` and its process group now: from any thread, never waiting, and
    needing no other process to answer (a stopped worker ends too)."""
    if isinstance(process, _Forked):
        process.end()
    elif process.returncode is None:  # not reaped: its pid (its group's id) is still its own
        if sys.platform == "win32":
            with contextlib.suppress(OSError):
                process.kill()
        else:
            lifetime.kill_group(process.pid)


def gone(process: WorkerProcess, timeout: float) -> bool:
    """Wait up to `timeout` seconds for `process` to end; whether it has."""
    if isinstance(process, _Forked):
        return process.exited(timeout)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def start(
    argv: list[str], env: dict[str, str], give_up: Callable[[], bool] | None = None
) -> WorkerProcess:
    """The worker (`python -m stemdeck_watch.workers.worker ARGV`) with `env` as its whole
    environment, in a session of its own (Ctrl-C goes to the service, which stops it).
    `give_up`: asked while the zygote has not answered; True ends the wait at once
    (StartAbandoned)."""
    if forks():
        try:
            return _zygote().start(argv, env, give_up)
        except _TooLarge as exc:
            log.warning("%s: starting the worker as a fresh interpreter instead", exc)
    kwargs: dict[str, Any] = {}
    if sys.platform == "win32":
        kwargs["creationflags"] = subprocess.CREATE_NEW_PROCESS_GROUP  # type: ignore[attr-defined]
    else:
        kwargs["start_new_session"] = True
    return subprocess.Popen(
        [sys.executable, "-m", WORKER_MODULE, *argv, "--parent", str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=None if _working_folder() else "/",  # Python cannot start in a deleted folder
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
    """A worker the zygote forked (start number `number`): its pipes, its pidfd (the handle
    that signals it and sees it end), and its exit code once the zygote reports it."""

    def __init__(
        self, zygote: _Zygote, number: int, pid: int, pidfd: int, pipes: Sequence[IO[str]]
    ):
        self._zygote, self.number, self.pid = zygote, number, pid
        self._pidfd: int | None = pidfd
        self.stdin: IO[str] | None = pipes[0]
        self.stdout: IO[str] | None = pipes[1]
        self.stderr: IO[str] | None = pipes[2]

    def __del__(self) -> None:
        fd, self._pidfd = self._pidfd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def exited(self, timeout: float = 0.0) -> bool:
        """Whether it has ended, waiting up to `timeout` seconds (its pidfd says so, whether
        or not the zygote has reaped it or can answer)."""
        fd = self._pidfd
        if fd is None or self.returncode is not None:
            return True
        return lifetime.exited(fd, timeout)

    def end(self) -> None:
        """SIGKILL it and its process group (its own session), straight from here."""
        fd = self._pidfd
        if fd is None or self.exited():
            return  # its pid (its group's id) may name another process by now
        lifetime.kill_group(self.pid)
        lifetime.send(fd, signal.SIGKILL)

    @property
    def lost(self) -> bool:
        """Whether it ended with its zygote (its own exit code unknown)."""
        return self._zygote.lost(self.number)

    @property
    def returncode(self) -> int | None:
        return self._zygote.wait(self.number, 0)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._zygote.wait(self.number, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"separation worker {self.pid}", timeout or 0.0)
        return code

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        fd = self._pidfd
        if fd is not None and not self.exited():
            lifetime.send(fd, signum)


class _Zygote:
    """The service's side: the zygote process, one request at a time, and a reader thread
    that starts it and then files what it reports, by start number. The zygote dies with
    the thread that started it (its parent-death signal): the reader, which lives as long
    as the zygote does."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # the zygote's environment, from which a start sends only what differs: one message
        # holds at most a socket buffer (about 200 KB), a whole environment may not fit
        self._environment = dict(os.environ)
        self._socket = ours
        self._request = threading.Lock()  # one start at a time
        self._state = threading.Condition()
        # by start number (never reused, a few bytes per worker): the pid and pidfd until its
        # start takes them, the workers running, the exit codes, the workers that ended with
        # the zygote, the starts given up on
        self._numbers = itertools.count(1)
        self._started: dict[int, tuple[int, int]] = {}
        self._running: set[int] = set()
        self._exits: dict[int, int] = {}
        self._lost: set[int] = set()
        self._abandoned: set[int] = set()
        self._ready = False  # its imports are done: a start is a fork, milliseconds
        self._gone = False
        self._launched = threading.Event()
        self._launch_error: BaseException | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._reader = threading.Thread(target=self._run, args=(theirs,), name=READER, daemon=True)
        self._reader.start()
        self._launched.wait(START_TIMEOUT)
        if self._process is None:
            ours.close()
            raise StartFailed(f"the worker zygote could not be started: {self._launch_error}")

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def alive(self) -> bool:
        with self._state:
            return not self._gone

    def start(
        self, argv: list[str], env: dict[str, str], give_up: Callable[[], bool] | None = None
    ) -> _Forked:
        number = next(self._numbers)
        request = json.dumps(
            {
                "start": number,
                "argv": argv,
                "set": {k: v for k, v in env.items() if self._environment.get(k) != v},
                "unset": [k for k in self._environment if k not in env],
                "cwd": _working_folder(),
            }
        ).encode()
        ends = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr: (read, write) each
        theirs = [ends[0][0], ends[1][1], ends[2][1]]
        ours = [ends[0][1], ends[1][0], ends[2][0]]
        try:
            with self._request:
                try:
                    socket.send_fds(self._socket, [request], theirs)
                except OSError as exc:
                    failed = _TooLarge if exc.errno == errno.EMSGSIZE else StartFailed
                    raise failed(f"the worker zygote took no start request: {exc}") from exc
                pid, pidfd = self._answer(number, give_up)
        except BaseException:
            for fd in ours:  # a worker started late reads the end of its input and exits
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
        return _Forked(self, number, pid, pidfd, pipes)

    def _answer(self, number: int, give_up: Callable[[], bool] | None) -> tuple[int, int]:
        """The pid and pidfd of start `number`, as the zygote answers: within FORK_TIMEOUT
        of a zygote done with its imports, START_TIMEOUT of one still at them."""
        with self._state:
            limit = FORK_TIMEOUT if self._ready else START_TIMEOUT
            deadline = time.monotonic() + limit
            while number not in self._started and not self._gone:
                if give_up is not None and give_up():
                    self._abandoned.add(number)
                    raise StartAbandoned("the worker's start was given up")
                left = deadline - time.monotonic()
                if left <= 0:
                    # its late answer would belong to no start: the next start brings a
                    # new zygote
                    self._abandoned.add(number)
                    self._gone = True
                    if self._process is not None:
                        self._process.kill()
                    raise StartFailed(
                        f"the worker zygote did not answer in {limit:.0f} s and was stopped"
                    )
                self._state.wait(min(left, 0.1))
            if number not in self._started:
                raise StartFailed("the worker zygote ended (see the log above)")
            return self._started.pop(number)

    def wait(self, number: int, timeout: float | None) -> int | None:
        """The exit code of the worker of start `number`, waiting up to `timeout` for it
        (None: running, or the zygote has not said)."""
        with self._state:
            self._state.wait_for(lambda: number in self._exits, timeout)
            return self._exits.get(number)

    def lost(self, number: int) -> bool:
        with self._state:
            return number in self._lost

    def _run(self, theirs: socket.socket) -> None:
        """Start the zygote (from this thread: it dies with it), then read what it says."""
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env=self._environment,
                cwd=None if _working_folder() else "/",
                start_new_session=True,  # Ctrl-C goes to the service alone
            )
        except BaseException as exc:
            self._launch_error = exc
            return
        finally:
            theirs.close()
            self._launched.set()
        self._read()

    def _read(self) -> None:
        try:
            while True:
                data, fds, _flags, _address = socket.recv_fds(self._socket, MESSAGE_BYTES, 1)
                if not data:
                    break
                self._file(json.loads(data), fds)
        except (OSError, ValueError, KeyError) as exc:
            log.warning("lost the worker zygote: %s", exc)
        with self._state:
            # its workers die with it (their parent-death signal); to the service they are
            # gone now, and the next start brings a new zygote
            self._gone = True
            for number in self._running:
                self._exits[number] = LOST
            self._lost |= self._running
            self._running.clear()
            for _pid, fd in self._started.values():  # starts nobody took
                os.close(fd)
            self._started.clear()
            self._state.notify_all()
        self._socket.close()
        assert self._process is not None
        try:
            self._process.wait(FORK_TIMEOUT)
        except subprocess.TimeoutExpired:  # it said something that makes no sense: ended
            self._process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(FORK_TIMEOUT)

    def _file(self, message: dict[str, Any], fds: list[int]) -> None:
        """File one report of the zygote: ready, a worker started (with its pidfd), ended."""
        with self._state:
            if "ready" in message:
                self._ready = True
                return
            number = int(message["start"])
            if "started" in message:
                self._running.add(number)
                if number in self._abandoned or not fds:  # nobody waits for this worker
                    for fd in fds:
                        lifetime.send(fd, signal.SIGKILL)
                        os.close(fd)
                else:
                    self._started[number] = (int(message["started"]), fds[0])
            elif number in self._running:
                self._running.discard(number)
                self._exits[number] = int(message["code"])
            self._state.notify_all()


def _working_folder() -> str | None:
    """This process's working folder, for a worker (None: it was deleted, and a worker or
    zygote starts elsewhere: Python cannot start in a deleted folder)."""
    try:
        return os.getcwd()
    except OSError:
        return None


# ---------------------------------------------------------------- the zygote process


def main(fd: int, service: int = 0) -> int:
    # the environment the service started it with, before any import changes it: each start
    # sends what the worker's differs by
    environment = dict(os.environ)
    lifetime.die_with_parent()  # also while stopped: no zygote outlives its service
    if service and os.getppid() != service:
        return 0  # the service was gone before that took effect
    import demucs.apply  # noqa: F401 - the imports every worker needs, made once here
    import demucs.htdemucs  # noqa: F401
    import demucs.pretrained  # noqa: F401
    import torch  # noqa: F401

    import stemdeck_watch.workers.worker  # noqa: F401

    channel = socket.socket(fileno=fd)
    channel.send(json.dumps({"ready": os.getpid()}).encode())
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    children: dict[int, int] = {}  # pid -> start number, until reaped
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
            zygote = os.getpid()
            pid = os.fork()
            if pid == 0:
                channel.close()
                os.close(wake_r)
                os.close(wake_w)
                _become_worker(request, environment, fds, zygote)
            children[pid] = int(request["start"])
            for fd in fds:
                os.close(fd)
            # taken before the child can be reaped (that happens on this thread): it names
            # this worker for certain, for the service to signal and watch
            handle = lifetime.pidfd(pid)
            answer = json.dumps({"started": pid, "start": children[pid]}).encode()
            socket.send_fds(channel, [answer], [] if handle is None else [handle])
            if handle is not None:
                os.close(handle)
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the service's process is gone


def _reap(channel: socket.socket, children: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        number = children.pop(pid, None)
        if number is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        channel.send(json.dumps({"exited": pid, "start": number, "code": code}).encode())


def _become_worker(
    request: dict[str, Any], environment: dict[str, str], fds: list[int], zygote: int
) -> None:
    """In the forked child: what `python -m stemdeck_watch.workers.worker` would be; it
    watches `zygote`, its parent, from its first moment (one gone before is noticed too)."""
    code = 1
    try:
        lifetime.die_with_parent()  # a zygote lost ends its workers, stopped ones too
        if os.getppid() != zygote:
            os._exit(0)  # it was lost before that took effect
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        os.setsid()
        for fd, target in zip(fds, (0, 1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        if request["cwd"] is not None:
            os.chdir(request["cwd"])
        wanted = {**environment, **request["set"]}
        for name in request["unset"]:
            wanted.pop(name, None)
        os.environ.clear()
        os.environ.update(wanted)
        sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", errors="replace", closefd=False, buffering=1)
        sys.stderr = open(2, "w", encoding="utf-8", errors="replace", closefd=False, buffering=1)
        from stemdeck_watch.workers.worker import main as worker_main

        code = worker_main([*request["argv"], "--parent", str(zygote)])
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
    raise SystemExit(main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0))
