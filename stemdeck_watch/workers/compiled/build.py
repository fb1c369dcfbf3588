"""The background compile: `python -m stemdeck_watch.workers.compiled.build`, and its keeper.

Building a compiled model costs minutes of CPU (workers/compiled/model.py says why it is worth it),
so it runs in its own process group at idle priority (SCHED_IDLE on Linux, else nice 19),
never holding the worker's GIL or the service's threads, and the queue goes on with the eager
model meanwhile. Idle priority is not enough on its own: torch's threads leave the cores idle
for moments many times a second, a build slips into each, and a song separated beside one
took 2.4× as long here. So while the worker separates, the build (its compiler processes too)
is stopped (SIGSTOP) and continued after: it runs only while the worker has nothing to do.
It is stopped only once it has said it dies with the service (`ARMED`): one stopped before
would outlive a service killed meanwhile, stopped for ever.

Dying with the service takes two processes on Linux, since the compiler processes Inductor
starts are the build's children, not the service's, and a stopped process can act on
nothing. The process the service starts is a small keeper, the leader of a session of its
own, at the service's priority (its sweep must not wait for idle CPU) and never stopped: it
watches the service through a pidfd,
adopts its descendants' orphans (a subreaper), and forks the build into a process group of
its own (the group a song stops), which dies with the keeper (the parent-death signal). When
the build ends, the service dies or asks it to go (SIGTERM), the keeper SIGKILLs the
build's group and every process of its session and its adopted children, stopped or not,
and exits. The service stops the build's group itself with SIGKILL when it closes, without
waiting for the keeper. Elsewhere (no pidfds) the build is one process that dies with the
service, and a stopped one's compilers are reaped by the next service (`reap`).

It loads the model as the worker does (a RoFormer, `--engine roformer`, as a recipe's lead
is loaded), compiles each part of each network ahead of time into a build folder with a
random name in the compiled-model cache (compiled/graph.py: the saved parts, and Inductor's
code in the folder's own cache), loads them back and calls them once as the worker will, and
makes the build an entry (compiled/cache.py: manifest written and read back, one rename). The
worker adopts the entry between two songs (a recipe's RoFormer: as the next song with it
starts).

    python -m stemdeck_watch.workers.compiled.build --model NAME [--engine demucs|roformer]
        [--repo DIR] --precision P
        --device cpu --cache DIR [--cap-mb N] [--threads N] [--parent PID]

stdout: one JSON line at the end, {"ok": true, "key": K, "compile_seconds": F, "bytes": N} or
{"ok": false, "error": TEXT}; stderr: `@@armed GROUP` once it dies with the service (GROUP: the
process group to stop while a song separates), then what torch prints. It exits when its
parent dies.

`CompileBuilder` is the service's side: at most one build at a time, started when the worker
reports that the compiled model it wants is not built, stopped with the service.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from stemdeck_watch.util.safefile import read_regular_text, write_replacing
from stemdeck_watch.workers import lifetime
from stemdeck_watch.workers.lifetime import proc_stat, started_at

log = logging.getLogger(__name__)

STDERR_TAIL_LINES = 20
PID_FILE = "build.pid"  # in the cache: the session of the build running, and its start
ARMED = "@@armed"  # on stderr: the build dies with the service from now on, also when stopped
CLOSE_TIMEOUT = 5.0  # seconds for a build asked to stop to be gone
SERVICE_POLL = 1.0  # seconds between two looks at the service where no pidfd tells


def lower_priority(pid: int = 0) -> str:
    """Run process `pid` (0: this one), and the compiler processes it starts, only on CPU
    nobody else wants."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
            return "SCHED_IDLE"
        except OSError:
            pass
    if pid:
        return "its own"  # nice can only be set for oneself portably: the child does it
    try:
        os.nice(19 - os.nice(0))
    except OSError:
        pass
    return f"nice {os.nice(0)}"


def reap(cache: Path) -> None:
    """Kill what is left of a build an earlier service started and could not end (it was
    SIGKILLed while the build was stopped): the members of its session that are still a
    build or its compiler and started with it or after. Nothing, if its pid now names
    another process."""
    import signal

    try:
        recorded = [int(n) for n in read_regular_text(cache / PID_FILE, 64).split()]
    except (OSError, ValueError):
        return
    if len(recorded) != 2:
        return  # not a pid and a start time: nothing here names a process for certain
    group, start = recorded
    now = started_at(group)
    if now is not None and now != start:
        return  # the build's leader is gone and its pid given to another process
    for pid in (name for name in os.listdir("/proc") if name.isdigit()):
        try:
            fields = proc_stat(pid)
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            member = int(fields[3]) == group and int(fields[19]) >= start
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not a process's stat
        ours = b"compiled.build" in cmdline or b"torch" in cmdline or b"cc1plus" in cmdline
        if member and ours:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(int(pid), sig)
                except OSError:
                    pass


def build(args: Any) -> dict[str, Any]:
    """Build the compiled model `args` describes into the cache; what to print."""
    from stemdeck_watch.workers.faultseam import building

    building()  # faults on purpose, where tests ask for them
    import torch

    from stemdeck_watch.workers.compiled.cache import INDUCTOR, CompileCache, folder_bytes
    from stemdeck_watch.workers.compiled.model import (
        key_for,
        members,
        open_compiled,
        use_inductor_cache,
        warm,
    )
    from stemdeck_watch.workers.compiled.graph import build as build_graphs
    from stemdeck_watch.workers.demucs.precision import threads_for
    from stemdeck_watch.workers.worker import set_backends, load_model

    set_backends()
    torch.set_num_threads(threads_for(args.threads))
    if args.engine == "roformer":  # a recipe's lead, loaded as the worker loads it
        from stemdeck_watch.workers.recipe import load_lead

        model = load_lead(args.model, args.repo, args.device).module
    else:
        model = load_model(args.model, args.repo)
        model.to(args.device)
    key = key_for(model, args.model, args.precision, args.device)
    cache = CompileCache(Path(args.cache), args.cap_mb)
    if cache.entry(key) is not None:
        return {"ok": True, "key": key.digest(), "already": True}
    cache.remove_builds()  # a stopped or killed build before this one: never an entry
    folder = cache.new_build(key)
    try:
        use_inductor_cache(folder / INDUCTOR)
        started = time.monotonic()
        build_graphs(members(model), folder, args.device, args.precision)
        seconds = time.monotonic() - started
        # loaded back and called as the worker will: a file that does not load, or guards
        # that refuse a segment, are never an entry (stems that are not finite are the
        # worker's measure to refuse, and its verdict to keep)
        pairs = open_compiled(model, folder, args.device, args.precision)
        warm(model, pairs, args.device, args.precision)
        size = folder_bytes(folder)
        if size > cache.cap_bytes:
            raise ValueError(
                f"the compiled model takes {size / 2**20:.0f} MB, more than "
                f"separation.compile_cache_mb ({cache.cap_bytes / 2**20:.0f} MB)"
            )
        cache.commit(folder, key, {"compile_seconds": round(seconds, 1), "bytes": size})
    finally:
        if folder.exists():
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
    return {"ok": True, "key": key.digest(), "compile_seconds": round(seconds, 1), "bytes": size}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="stemdeck_watch.workers.compiled.build")
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine", choices=("demucs", "roformer"), default="demucs")
    parser.add_argument("--repo", default=None)
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cache", required=True)
    parser.add_argument("--cap-mb", type=float, default=2048.0)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--parent", type=int, default=0)  # the service's pid
    args = parser.parse_args(argv)
    if sys.platform == "linux" and lifetime.pidfds():
        return _keep(args)
    lower_priority()  # first: everything after, torch's threads too, inherits it
    lifetime.die_with_parent()
    if args.parent and os.getppid() != args.parent:
        return 0  # the service was killed before die_with_parent took effect
    return _build_here(args, ARMED)


def _keep(args: Any) -> int:
    """The keeper (see the module's docstring): fork the build, wait for it or the
    service's end, then end whatever is left of the build; the build's exit code."""
    import select
    import signal

    service = lifetime.pidfd(args.parent) if args.parent else None
    if args.parent and (service is None or os.getppid() != args.parent):
        return 0  # the service was killed before this could watch it
    lifetime.adopt_orphans()
    keeper = os.getpid()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            os.setpgid(0, 0)  # the group a song stops, without the keeper
            lifetime.die_with_parent()
            if os.getppid() == keeper:
                code = _build_here(args, f"{ARMED} {os.getpid()}")
        finally:
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
            os._exit(code)

    class _Asked(Exception):
        pass

    def asked(*_: object) -> None:
        raise _Asked

    signal.signal(signal.SIGTERM, asked)
    build = lifetime.pidfd(child)  # its parent, before reaping it: it names the build
    watched = [fd for fd in (build, service) if fd is not None]
    try:
        while True:
            readable, _, _ = select.select(watched, [], [], SERVICE_POLL)
            if build in readable or service in readable:
                break
            if args.parent and os.getppid() != args.parent:
                break
    except _Asked:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return _sweep(child)


def _sweep(build: int) -> int:
    """SIGKILL the build's group, every process of this session and every child adopted,
    until none is left (a fork in flight adds one), and reap them; the build's exit code."""
    import signal

    lifetime.kill_group(build)
    me = os.getpid()
    for _ in range(100):
        left = [pid for pid in lifetime.session_members(me, me) if pid != me]
        if not left:
            break
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        threading.Event().wait(0.01)
    code = 1
    deadline = time.monotonic() + CLOSE_TIMEOUT
    while time.monotonic() < deadline:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            threading.Event().wait(0.01)  # a child killed above, not a zombie yet
            continue
        if pid == build:
            code = os.waitstatus_to_exitcode(status)
    return 0 if code == 0 else 1


def _build_here(args: Any, armed: str) -> int:
    """Build in this process (it dies with its parent already); `armed`: the line that
    says so."""
    priority = lower_priority()  # first: everything after, torch's threads too, inherits it
    print(armed, file=sys.stderr, flush=True)
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1, encoding="utf-8")
    sys.stdout = sys.stderr  # what torch prints goes to stderr; stdout is the result
    from stemdeck_watch.workers.worker import watch_parent

    threading.Thread(
        target=watch_parent, args=(os.getppid(),), name="parent-watch", daemon=True
    ).start()
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s: %(message)s")
    log.info("building at %s", priority)
    try:
        result = build(args)
    except Exception as exc:
        log.exception("the compile failed")
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    protocol.write(json.dumps(result) + "\n")
    protocol.flush()
    return 0 if result["ok"] else 1


class CompileBuilder:
    """At most one background compile at a time; what became of each, by key."""

    def __init__(self, cache: Path, cap_mb: float, env: dict[str, str], threads: int = 0):
        self.cache = cache
        self.cap_mb = cap_mb
        self.env = env
        self.threads = threads
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        # the build said it dies with the service: only then may it be stopped (a build
        # stopped before would outlive a service killed meanwhile, stopped for ever)
        self._armed = threading.Event()
        self._group: int | None = None  # the build's own process group, as it said
        self._building: dict[str, Any] | None = None
        self._ended: dict[str, dict[str, Any]] = {}  # key → the build's result
        self._closed = False

    def request(
        self,
        key: str,
        model: str,
        repo: str | None,
        precision: str,
        device: str,
        engine: str = "demucs",
    ) -> None:
        """Build `key` unless it is being built, was built, or failed in this service's life
        (`engine`: "roformer" for a recipe's lead)."""
        with self._lock:
            if self._closed or self._building is not None or key in self._ended:
                return
            self.cache.mkdir(parents=True, exist_ok=True)
            reap(self.cache)
            command = [
                sys.executable,
                "-m",
                "stemdeck_watch.workers.compiled.build",
                "--model",
                model,
                "--engine",
                engine,
                "--precision",
                precision,
                "--device",
                device,
                "--cache",
                str(self.cache),
                "--cap-mb",
                str(self.cap_mb),
                "--threads",
                str(self.threads),
                "--parent",
                str(os.getpid()),
            ]
            if repo:
                command += ["--repo", repo]
            self._armed.clear()
            self._group = None
            self._proc = proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self.env,
                text=True,
                encoding="utf-8",
                errors="replace",
                start_new_session=sys.platform != "win32",
            )
            write_replacing(self.cache / PID_FILE, f"{proc.pid} {started_at(proc.pid) or ''}")
            self._building = {"key": key, "model": model, "pid": proc.pid, "started": time.time()}
            log.info(
                "building the compiled model for %s (%s) in the background (pid %d)",
                model,
                precision,
                proc.pid,
            )
            threading.Thread(
                target=self._follow, args=(proc, key), name="compile-build", daemon=True
            ).start()

    def _follow(self, proc: subprocess.Popen[str], key: str) -> None:
        tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        try:
            assert proc.stderr is not None and proc.stdout is not None
            reader = threading.Thread(target=self._read_stderr, args=(proc, tail), daemon=True)
            reader.start()
            # to the pipe's end: the build and everything it started are gone (`close` ends
            # them, with the service, and the keeper with the build)
            with proc.stdout:
                lines = [line.rstrip("\n") for line in proc.stdout]
            try:
                proc.wait(CLOSE_TIMEOUT)
            except subprocess.TimeoutExpired:
                lifetime.kill_group(proc.pid)
                proc.wait(CLOSE_TIMEOUT)
            self._end_group(proc.pid)
            reader.join(5.0)
            proc.stderr.close()
            try:
                result = json.loads(lines[-1]) if lines else {}
            except ValueError:
                result = {}
            if not result:
                result = {"ok": False, "error": f"the build stopped (exit code {proc.returncode})"}
            elif result.get("ok") and result.get("key") != key:
                result = {"ok": False, "error": f"it built {result.get('key')}, not {key}"}
            if result.get("ok"):
                log.info(
                    "compiled model built in %s s (%s)",
                    result.get("compile_seconds", "?"),
                    key,
                )
            elif not self._closed:
                log.warning(
                    "the background compile failed: %s\n%s", result.get("error"), "\n".join(tail)
                )
        except Exception:  # a keeper thread never takes the service down
            log.exception("following the background compile failed")
            result = {"ok": False, "error": "following the build failed"}
        with self._lock:
            if not self._closed:
                self._ended[key] = result
            self._building = None
            self._proc = None

    def _read_stderr(self, proc: subprocess.Popen[str], tail: collections.deque[str]) -> None:
        for line in proc.stderr or []:
            said = line.rstrip().split()
            if said[:1] == [ARMED] and self._proc is proc:
                self._group = int(said[1]) if len(said) > 1 and said[1].isdigit() else proc.pid
                self._armed.set()
            else:
                tail.append(line.rstrip())

    def _end_group(self, pid: int) -> None:
        """The build ended: end what it left running in its process groups (a compiler) and
        forget it, so nothing reaps that group id once it names something else."""
        group = self._group
        if group is not None and group != pid:
            lifetime.kill_group(group)
        lifetime.kill_group(pid)
        with contextlib.suppress(OSError):
            (self.cache / PID_FILE).unlink()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """While inside (the worker separates), the build in progress is stopped, once it
        dies with the service (its first moment, at idle priority, it goes on)."""
        proc, group = self._proc, self._group
        stopped = proc is not None and self._armed.is_set() and self._signal(proc, "SIGSTOP", group)
        try:
            yield
        finally:
            if stopped and proc is not None:
                self._signal(proc, "SIGCONT", group)

    @staticmethod
    def _signal(proc: subprocess.Popen[str], name: str, group: int | None = None) -> bool:
        """Send signal `name` to the build's process group `group` (its compiler processes
        too; default: the group of the process the service started), while that process
        runs (its group's id is still its own)."""
        import signal

        if sys.platform == "win32" or proc.poll() is not None:
            return False
        try:
            os.killpg(group or proc.pid, getattr(signal, name))
            return True
        except OSError:
            return False

    def result(self, key: str) -> dict[str, Any] | None:
        """How the build of `key` ended in this service's life (None: not ended)."""
        with self._lock:
            return self._ended.get(key)

    def info(self) -> dict[str, Any] | None:
        """The build in progress, if one runs: key, model, pid (the build's own, once it has
        said it; its keeper's before), started (time.time())."""
        with self._lock:
            if not self._building:
                return None
            return {**self._building, "pid": self._group or self._building["pid"]}

    def close(self) -> None:
        """Stop a build in progress (its folder is never an entry) and start no more."""
        with self._lock:
            self._closed = True
            proc, group = self._proc, self._group
        if proc is None or proc.poll() is not None:
            return
        if group is not None and group != proc.pid:
            # the build and its compilers end now, stopped or not, by signal from here; the
            # keeper then ends what is left of its session and exits
            self._signal(proc, "SIGKILL", group)
        self._signal(proc, "SIGTERM")
        self._signal(proc, "SIGCONT")  # a stopped build (no keeper) could not act on it
        try:
            proc.wait(CLOSE_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._signal(proc, "SIGKILL")
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(CLOSE_TIMEOUT)


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)
