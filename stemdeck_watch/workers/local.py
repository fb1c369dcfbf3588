"""The service's side of the resident worker: spawn it, talk to it, stop it, respawn it.

The worker is registered on the running job's JobControl while a request is in flight, so a
cancel terminates it at once; the next job gets a fresh worker. If the worker dies on its own
(out of memory, a crash in torch), the request ends in `WorkerDied` with the last lines the
worker wrote to stderr — a machine fault, so the song is tried again (engine/faults.py) — and
the next request gets a fresh worker: the queue never wedges.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Callable, Iterator, NoReturn

from stemdeck_watch.core.errors import (
    SHUTDOWN,
    Cancelled,
    ModelError,
    OutOfMemory,
    SeparationError,
    WorkerDied,
    WorkerStalled,
)
from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.workers.compiled.build import CompileBuilder
from stemdeck_watch.workers.compiled.cache import CompileSettings
from stemdeck_watch.workers.pace import Pace, Watch
from stemdeck_watch.workers import zygote
from stemdeck_watch.workers.separator import (
    DEMUCS_DEFAULTS,
    DemucsSettings,
    Lead,
    ModelInfo,
    Separation,
    separate_request,
)
from stemdeck_watch.workers.waiting import next_message
from stemdeck_watch.workers.demucs.precision import physical_cores, threads_for
from stemdeck_watch.workers.worker import DOWNLOAD_PREFIX, LOAD_BEAT, PROGRESS_PREFIX

log = logging.getLogger(__name__)
worker_log = logging.getLogger("stemdeck_watch.worker")

STDERR_TAIL_LINES = 40
START_TIMEOUT = 300.0
STOP_TIMEOUT = 5.0  # seconds for a worker SIGKILLed to be gone and its pipes read to the end
EXIT_REPORT = 1.0  # … and for its exit code to come from its zygote (its parent) after
CLOSE_TIMEOUT = 5.0  # seconds a worker asked to exit (its input closed) is given to go
LOCK_TIMEOUT = 10.0  # seconds `close` waits for a request in flight before it stops the worker
READ_POLL = 0.2  # seconds a reader waits on its pipe before it looks whether to give up


def lines(pipe: IO[str], stop: threading.Event | None = None) -> Iterator[str]:
    """The lines read from `pipe` until its end, or until `stop` is set (then within
    READ_POLL). Read from its descriptor, never through its buffer: closing a file while
    another thread reads it through its buffer waits for that read (CPython), and the end of a
    pipe may never come while a process that holds it is stopped."""
    if sys.platform == "win32" or stop is None:  # no select() on a pipe there
        try:
            yield from pipe
        except ValueError:  # "I/O operation on closed file": stop() closed it
            return
        return
    fd = pipe.fileno()
    pending = b""
    while not stop.is_set():
        try:
            readable, _, _ = select.select([fd], [], [], READ_POLL)
            chunk = os.read(fd, 65536) if readable else None
        except (OSError, ValueError):
            return
        if chunk is None:
            continue
        if not chunk:
            break
        *complete, pending = (pending + chunk).split(b"\n")
        for line in complete:
            yield line.decode("utf-8", "replace") + "\n"
    if pending and not stop.is_set():
        yield pending.decode("utf-8", "replace")


class _Process:
    """One worker process with its reader threads.

    Ending it never waits on anyone: `end` SIGKILLs its process group straight from the
    calling thread (a cancel, a shutdown: any thread); `stop` does that and then reaps, within
    deadlines, on the thread that owns the worker (the dispatcher's)."""

    def __init__(
        self,
        device: str,
        env: dict[str, str],
        threads: int = 0,
        give_up: Callable[[], bool] | None = None,
    ):
        self.device = device  # as asked for ("auto" included)
        self.popen = zygote.start(["--device", device, "--threads", str(threads)], env, give_up)
        self.replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self.tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.on_progress: Callable[[str, float], None] | None = None
        self.on_download: Callable[[dict[str, Any]], None] | None = None
        self.ready: dict[str, Any] | None = None
        self.model: ModelInfo | None = None
        # the compiled model of the latest recipe's RoFormer, as the latest song found it
        self.lead_compiled: dict[str, Any] | None = None
        self._reading = threading.Event()  # set: the readers stop, whether the pipes ended
        self._threads = [
            threading.Thread(target=self._read_stdout, name=f"worker-{self.pid}-out", daemon=True),
            threading.Thread(target=self._read_stderr, name=f"worker-{self.pid}-err", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return zygote.running(self.popen)

    def _read_stdout(self) -> None:
        assert self.popen.stdout is not None
        for line in lines(self.popen.stdout, self._reading):
            try:
                self.replies.put(json.loads(line))
            except ValueError:
                worker_log.warning(
                    "worker %d wrote a non-protocol line: %s", self.pid, line.rstrip()
                )

    def _read_stderr(self) -> None:
        assert self.popen.stderr is not None
        for line in lines(self.popen.stderr, self._reading):
            line = line.rstrip("\n")
            if line.startswith(PROGRESS_PREFIX):
                try:
                    data = json.loads(line[len(PROGRESS_PREFIX) :])
                    callback = self.on_progress
                    if callback:
                        callback(data["id"], float(data["value"]))
                except Exception:
                    worker_log.exception("bad progress line from worker %d", self.pid)
                continue
            if line.startswith(DOWNLOAD_PREFIX):
                try:
                    data = json.loads(line[len(DOWNLOAD_PREFIX) :])
                    if self.on_download:
                        self.on_download(
                            {
                                "model": str(data["model"]),
                                "done": int(data["done"]),
                                "total": None if data.get("total") is None else int(data["total"]),
                            }
                        )
                except Exception:
                    worker_log.exception("bad download line from worker %d", self.pid)
                continue
            self.tail.append(line)
            worker_log.debug("[%d] %s", self.pid, line)

    def send(self, request: dict[str, Any]) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(request) + "\n")
        self.popen.stdin.flush()

    def end(self) -> None:
        """SIGKILL the worker and its process group now. Safe from any thread; never waits,
        and needs neither the worker nor its zygote to answer (a stopped one ends too)."""
        zygote.end(self.popen)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """End the worker (cancel, shutdown, a fault) and reap it and its readers, waiting
        `timeout` seconds at most: on the thread that owns the worker."""
        deadline = time.monotonic() + timeout
        self.end()
        if not zygote.gone(self.popen, timeout):
            log.error("worker %d was still there %.0f s after SIGKILL", self.pid, timeout)
        # its exit code, from its parent (a zygote that does not answer leaves it unknown)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(max(0.0, min(EXIT_REPORT, deadline - time.monotonic())))
        # the readers end at the pipes' end, once the worker is gone (one still open in a
        # process it left behind: at `_reading`); then their files close
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.1, deadline - time.monotonic()))
        self._reading.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(2 * READ_POLL)
        if any(t.is_alive() for t in self._threads if t is not threading.current_thread()):
            return  # closing a pipe under its reader would wait for that read
        for pipe in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            try:
                if pipe:
                    pipe.close()
            except (OSError, ValueError):
                pass

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Ask politely (close stdin) and wait up to `timeout`; then end it."""
        try:
            if self.popen.stdin:
                self.popen.stdin.close()
        except (OSError, ValueError):
            pass
        zygote.gone(self.popen, timeout)
        self.stop()

    def stderr_tail(self) -> str:
        return "\n".join(self.tail)


class WorkerClient:
    """The one local worker process (a Separator). Only the pipeline, under its lock, calls
    the request methods."""

    def __init__(
        self,
        device: str = "auto",
        env: dict[str, str] | None = None,
        threads: int = 0,
        precision: str = "auto",
        compiling: CompileSettings | None = None,
        builds: bool = True,
        stall_seconds: float = 0.0,
    ):
        self.device = device
        # separation.stall_seconds: a load gets the watch a separation gets (a request's
        # own setting, when it gives one, for its separation)
        self.stall_seconds = stall_seconds
        self.threads = threads  # separation.threads: 0 = one per physical core
        self.precision = precision  # separation.precision, unless a request says otherwise
        # choices measured on this machine, per (model, repo, setting): a worker restarted
        # after a cancel reuses them instead of calibrating again
        self._decided: dict[tuple[str, str | None, str, str], dict[str, Any]] = {}
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # separation.compile: the worker adopts a compiled model that a background process
        # builds (workers/compiled/build.py)
        self.compiling = compiling if compiling and compiling.setting != "off" else None
        # `builds`: start the build the worker asks for (not where only reporting, as doctor)
        self.builder = (
            CompileBuilder(self.compiling.cache, self.compiling.cap_mb, self._env, threads)
            if self.compiling and builds
            else None
        )
        self._lock = threading.Lock()
        self._proc: _Process | None = None
        self._shut = False
        self._requests = 0
        self.pids: list[int] = []  # every worker started, in order (diagnostics, tests)
        # (start, end) of the latest separate requests, time.monotonic(): how busy the
        # worker is kept (the throughput benchmark's idle fraction)
        self.busy: collections.deque[tuple[float, float]] = collections.deque(maxlen=10000)
        # a model download the worker reports ({"model", "done", "total"} bytes) while it
        # lasts; `on_download` hears every report, and None when it ends (the executor)
        self.download: dict[str, Any] | None = None
        self.on_download: Callable[[dict[str, Any] | None], None] | None = None
        self._loading = False  # a load request is in flight: download reports count
        self._load_watch: Watch | None = None  # the load's watch: a download report beats it
        self._download_lock = threading.Lock()
        self._paces: dict[str, Pace] = {}  # the time per segment measured, by device

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc and proc.alive() else None

    @property
    def versions(self) -> dict[str, str]:
        proc = self._proc
        return dict(proc.ready.get("versions", {})) if proc and proc.ready else {}

    def stderr_tail(self) -> str:
        proc = self._proc
        return proc.stderr_tail() if proc else ""

    @property
    def model_info(self) -> ModelInfo | None:
        """The model the live worker holds, without waiting for the worker (which may be
        separating): what decoding ahead needs to know."""
        proc = self._proc
        return proc.model if proc is not None and proc.alive() else None

    def ensure_model(
        self,
        name: str,
        repo: str | None,
        control: JobControl | None = None,
        precision: str | None = None,
        device: str | None = None,
    ) -> ModelInfo:
        """Start the worker if needed and have it load `name` and choose its precision
        (`precision`: the setting, default the client's); cached while it lives. `device`:
        see Separator.ensure_model."""
        setting = precision or self.precision
        key = (name, repo, setting, device or self.device)
        with self._lock:
            proc = self._ensure_process(control, device)
            model = proc.model
            if model is not None and model.serves(name, repo, setting):
                if not self._build_for(model.compiled, name, repo, model.dtype, proc):
                    return model  # no news of its compiled model: a build ended well
            # a load is watched as a separation is: the worker reports each step of it (and
            # a download's progress); one silent past the stall limit is stopped
            watch = self.pace().watch(self.pace().stall_limit(self.stall_seconds))

            def beat(owner: str, _value: float) -> None:
                if owner == LOAD_BEAT:
                    watch.beat()

            self._loading, self._load_watch, proc.on_progress = True, watch, beat
            try:
                reply = self._call(
                    proc,
                    {
                        "op": "load",
                        "model": name,
                        "repo": repo,
                        "precision": setting,
                        "decided": self._decided.get(key),
                        "compile": self.compiling.request() if self.compiling else None,
                    },
                    control,
                    watch,
                    f"while it loaded model {name}",
                )
            finally:
                proc.on_progress = None
                self._downloading(None, ended=True)
            proc.model = ModelInfo.loaded(name, repo, reply)
            self._build_for(proc.model.compiled, name, repo, proc.model.dtype, proc)
            choice = proc.model.precision
            if key not in self._decided and choice.get("speedup") is not None:
                log.info(
                    "worker %d measured precision for %s: %s",
                    proc.pid,
                    name,
                    _describe_choice(choice),
                )
            self._decided[key] = choice
            log.info(
                "worker %d loaded model %s (%s) in %s: %s",
                proc.pid,
                name,
                ", ".join(proc.model.sources),
                proc.model.dtype,
                choice.get("reason"),
            )
            return proc.model

    def _build_for(
        self,
        compiled: dict[str, Any],
        name: str,
        repo: str | None,
        precision: str,
        proc: _Process,
        engine: str = "demucs",
    ) -> bool:
        """For a compiled model the worker waits for (`compiled`: its state, "building"):
        start its background build, unless it ended in this service's life. Asked at every
        song, as the builder takes one build at a time and ignores a request while another
        runs. A failed build is written into `compiled`, never tried again. Whether it ended
        well: then the worker has news (its next load, or the lead's next song, adopts it)."""
        key = compiled.get("key")
        if self.builder is None or compiled.get("state") != "building" or not key:
            return False
        ended = self.builder.result(key)
        if ended is None:
            device = str((proc.ready or {}).get("device") or "cpu")
            self.builder.request(key, name, repo, precision, device, engine)
            return False
        if not ended.get("ok"):
            compiled.update(state="failed", reason=f"the build failed: {ended.get('error')}")
        return bool(ended.get("ok"))

    def leaves_room(self) -> bool:
        """Whether other work can run beside a separation without slowing it: the worker
        runs on a GPU, or uses fewer threads than this process may use cores. (On a CPU the
        worker fills, torch's threads wait for the slowest of them, so work beside them
        stretches separation: see Pipeline.works_beside for when it still pays.)"""
        proc = self._proc
        ready = (proc.ready or {}) if proc is not None else {}
        if str(ready.get("device") or self.device) not in ("cpu", "auto"):
            return True
        threads = ready.get("threads") or threads_for(self.threads)
        return int(threads) < physical_cores()

    def info(self) -> dict[str, Any]:
        """The worker section of `status --json`: process, threads, model and precision."""
        proc = self._proc
        alive = proc is not None and proc.alive()
        ready = (proc.ready or {}) if proc is not None else {}
        model = proc.model if proc is not None else None
        return {
            "pid": proc.pid if alive and proc else None,
            "device": ready.get("device", self.device),
            "threads": ready.get("threads"),
            "model": model.name if model else None,
            "precision": dict(model.precision) if model else None,
            "compiled": self._with_build(model.compiled if model else None),
            "lead_compiled": self._with_build(proc.lead_compiled if alive and proc else None),
            "download": dict(self.download) if self.download else None,
        }

    def _with_build(self, compiled: dict[str, Any] | None) -> dict[str, Any] | None:
        """A compiled model's state for `status --json` (worker.compiled, and
        worker.lead_compiled for a recipe's RoFormer), with its build if one is in
        progress."""
        if not compiled:
            return None
        info = dict(compiled)
        building = self.builder.info() if self.builder else None
        if building and building.get("key") == info.get("key"):
            info["build"] = {"pid": building["pid"], "started": building["started"]}
        return info

    def _downloading(self, report: dict[str, Any] | None, ended: bool = False) -> None:
        """The worker's download report, passed on (under the lock, so the end is never
        overtaken by a report); `ended`: the load request ended, and a report read late from
        the worker's stderr no longer counts."""
        with self._download_lock:
            if ended:
                self._loading, self._load_watch = False, None
            elif not self._loading:
                return
            elif self._load_watch is not None:
                self._load_watch.beat()
            if report is None and self.download is None:
                return
            self.download = report
            callback = self.on_download
            if callback is not None:
                try:
                    callback(report)
                except Exception:
                    log.exception("a download listener failed")

    def separate(
        self,
        job_id: str,
        model: str,
        repo: str | None,
        input_path: Path,
        output_dir: Path,
        *,
        control: JobControl,
        on_progress: Callable[[float], None],
        demucs: DemucsSettings = DEMUCS_DEFAULTS,
        lead: Lead | None = None,
        window: float | None = None,
        precision: str = "float32",
        stall_seconds: float = 0.0,
        shrink: int = 0,
        device: str | None = None,
    ) -> Separation:
        """Separate the decoded song at `input_path` into `output_dir/<stem>.npy` in the
        worker process (see Separator.separate); `window` None: the worker's, 30 s."""
        request = {
            "op": "separate",
            "id": job_id,
            "input": str(input_path),
            "output": str(output_dir),
            **separate_request(
                model,
                repo,
                demucs=demucs,
                lead=lead,
                precision=precision,
                window=window,
                shrink=shrink,
            ),
        }
        if lead is not None and self.compiling:
            request["compile"] = self.compiling.request()  # the lead's compiled model
        with self._lock:
            proc = self._ensure_process(control, device)
            watch = self.pace().watch(self.pace().stall_limit(stall_seconds))

            def progress(owner: str, value: float) -> None:
                if owner == job_id:  # progress belongs to the job that owns the worker
                    watch.beat()
                    on_progress(value)

            proc.on_progress = progress
            started = time.monotonic()
            try:
                # a background compile only runs while the worker has nothing to do
                with self.builder.held() if self.builder else contextlib.nullcontext():
                    reply = self._call(proc, request, control, watch)
            finally:
                proc.on_progress = None
                self.busy.append((started, time.monotonic()))
            watch.done()
            fields = Separation.from_reply(reply)
            lead_compiled = fields["lead_compiled"]
            if lead is not None and lead_compiled is not None:
                precision = str(lead_compiled.get("precision") or "float32")
                self._build_for(lead_compiled, lead.model, repo, precision, proc, "roformer")
            proc.lead_compiled = lead_compiled
            return Separation(
                {k: Path(v) for k, v in reply["stems"].items()},
                proc.pid,
                float(reply["seconds"]),
                **fields,
            )

    def pace(self) -> Pace:
        """The time per segment measured on this worker's device."""
        proc = self._proc
        device = str(((proc.ready or {}) if proc else {}).get("device") or self.device)
        return self._paces.setdefault(device, Pace())

    def stop(self) -> None:
        """End the worker now (cancel, shutdown): a signal from any thread, never a wait;
        the thread in a request reaps it."""
        proc = self._proc
        if proc is not None:
            proc.end()

    def shutdown(self) -> None:
        """Stop the worker and start no new one (the service is stopping)."""
        self._shut = True
        self.stop()
        if self.builder is not None:
            self.builder.close()

    def close(self) -> None:
        """Let the worker go (it exits when its input closes) and reap it. A request still in
        flight after LOCK_TIMEOUT is cut off: the worker is ended under it."""
        if self.builder is not None:
            self.builder.close()
        if not self._lock.acquire(timeout=LOCK_TIMEOUT):
            log.warning("a request to worker %s did not end; stopping the worker", self.pid)
            self._shut = True
            self.stop()
            return
        try:
            if self._proc is not None:
                self._proc.close()
                self._proc = None
        finally:
            self._lock.release()

    # ------------------------------------------------------------ internals

    def _ensure_process(self, control: JobControl | None, device: str | None = None) -> _Process:
        """The live worker on `device` (default: the client's), started if needed."""
        if self._shut:
            raise Cancelled(SHUTDOWN)
        wanted = device or self.device
        current = self._proc
        if current is not None and current.alive() and current.device == wanted:
            return current
        if current is not None and current.alive():
            log.info(
                "worker %d runs on %s; starting one on %s", current.pid, current.device, wanted
            )
            current.close()
        elif current is not None:
            log.info(
                "worker %d is gone (exit code %s); starting a new one",
                current.pid,
                current.popen.returncode,
            )
            current.stop()

        def give_up() -> bool:  # a start the zygote has not answered yet waits for no one
            return self._shut or (control is not None and control.cancelled)

        try:
            self._proc = proc = _Process(wanted, self._env, self.threads, give_up)
        except OSError as exc:  # no process to wait for: a fault of the machine, as a death
            if self._shut:
                raise Cancelled(SHUTDOWN) from None
            if control is not None:
                control.check()
            raise WorkerDied(
                f"the separation worker could not be started: {exc}", worker="the local worker"
            ) from exc
        if self._shut:  # a shutdown that came while it was being started: it found no worker
            proc.stop()
            raise Cancelled(SHUTDOWN)
        proc.on_download = self._downloading
        self.pids.append(proc.pid)
        log.info("started separation worker %d", proc.pid)
        proc.ready = self._wait(proc, control, lambda m: m.get("event") == "ready", START_TIMEOUT)
        return proc

    def _call(
        self,
        proc: _Process,
        request: dict[str, Any],
        control: JobControl | None,
        watch: Watch | None = None,
        doing: str = "",
    ) -> dict[str, Any]:
        # every request carries a fresh number that the worker echoes: a late reply to an
        # earlier request (one cut off by a cancel) can never be taken for this one's
        self._requests += 1
        request = {**request, "req": self._requests}
        try:
            proc.send(request)
        except (BrokenPipeError, OSError):
            pass  # the process died; _wait reports it with its stderr
        reply = self._wait(
            proc, control, lambda m: m.get("req") == request["req"], None, watch, doing
        )
        if not reply.get("ok"):
            if reply.get("kind") == "model":
                raise ModelError(reply["error"])
            if reply.get("kind") == "memory":
                where = {"cuda": "the GPU's", "mps": "the GPU's"}.get(
                    reply.get("device") or "", "the computer's"
                )
                raise OutOfMemory(
                    f"the separation worker ran out of memory ({where}): {reply.get('error')}",
                    details=reply.get("traceback", ""),
                    worker=_name(proc),
                    device=reply.get("device") or "cpu",
                )
            raise SeparationError(
                f"the separation worker failed: {reply.get('error')}",
                details=reply.get("traceback", ""),
            )
        return reply

    def _wait(
        self,
        proc: _Process,
        control: JobControl | None,
        match: Callable[[dict[str, Any]], bool],
        timeout: float | None,
        watch: Watch | None = None,
        doing: str = "",
    ) -> dict[str, Any]:
        """The worker's reply `match` accepts. A cancel stops the worker (Cancelled); a
        worker that dies, does not start within `timeout` or stays silent past `watch`'s
        limit (`doing`: what it was at, for the message) is a machine fault (WorkerDied,
        WorkerStalled). A cancel only signals the worker, from its own thread; this thread
        (the worker's owner) reaps it."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def poll(wait: float) -> dict[str, Any] | None:
            try:
                return proc.replies.get(timeout=wait)
            except queue.Empty:
                return None

        def cancel() -> None:
            proc.stop()
            assert control is not None
            control.check()

        def stalled() -> NoReturn:
            assert watch is not None
            proc.stop()
            if control is not None:
                control.check()  # a cancel that came meanwhile wins
            log.warning(
                "worker %d reported no progress for %.0f s; stopped it", proc.pid, watch.silent()
            )
            raise WorkerStalled(
                watch.stalled_reason(doing=doing),
                details=proc.stderr_tail(),
                worker=_name(proc),
            ) from None

        def late() -> NoReturn:
            proc.stop()
            raise WorkerDied(
                f"the separation worker did not start within {timeout:.0f} s",
                details=proc.stderr_tail(),
                worker=_name(proc),
            ) from None

        with contextlib.ExitStack() as stack:
            if control is not None:  # a cancel from any thread ends the worker at once
                stack.enter_context(control.registered(proc.end))
            while True:
                message = next_message(
                    poll,
                    control,
                    on_cancel=cancel,
                    alive=lambda: proc.alive() or not proc.replies.empty(),
                    on_death=lambda: self._raise_died(proc, control),
                    watch=watch,
                    on_stall=stalled,
                    deadline=deadline,
                    on_late=late,
                )
                if match(message):
                    return message
                log.warning("unexpected message from worker %d: %s", proc.pid, message)

    def _raise_died(self, proc: _Process, control: JobControl | None) -> NoReturn:
        proc.stop()
        if control is not None:
            control.check()  # we killed it for a cancel: that is not a failure
        if self._shut:
            raise Cancelled(SHUTDOWN)  # nor is a stop for the service's shutdown
        code = proc.popen.returncode
        if zygote.lost(proc.popen):  # it ended with its zygote: nothing it did
            raise WorkerDied(
                "the separation worker ended with the zygote it was forked from",
                details=proc.stderr_tail(),
                worker=_name(proc),
            )
        if code is None:  # its zygote, stopped or hung, did not say how it ended
            raise WorkerDied(
                "the separation worker stopped unexpectedly (its exit code is unknown: the "
                "zygote it was forked from did not report it)",
                details=proc.stderr_tail(),
                worker=_name(proc),
            )
        why = _describe_exit(code)
        # nothing here sends SIGKILL but a stop, and a stop for a cancel ended above: it came
        # from the kernel's OOM killer, most likely
        died = OutOfMemory if code == -signal.SIGKILL else WorkerDied
        raise died(
            f"the separation worker stopped unexpectedly ({why})",
            details=proc.stderr_tail(),
            worker=_name(proc),
            device="cpu" if died is OutOfMemory else "",
        )


def _name(proc: _Process) -> str:
    """A worker process as a fault names it."""
    return f"the local worker (pid {proc.pid})"


def _describe_choice(choice: dict[str, Any]) -> str:
    figures = ""
    if choice.get("speedup") is not None:
        snr = choice.get("worst_snr_db")  # None: identical stems, or not run on the model
        figures = (
            f" ({choice['speedup']:.2f}× speed, worst stem "
            f"{'-' if snr is None else f'{snr:.1f}'} dB, calibration "
            f"{choice.get('calibration_seconds') or 0:.1f} s)"
        )
    return f"{choice.get('precision')} — {choice.get('reason')}{figures}"


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " — probably out of memory" if -code == 9 else ""
        return f"killed by {name}{hint}"
    return f"exit code {code}"
