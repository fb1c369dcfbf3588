"""The service's side of one Ray worker: a Separator, like the local WorkerClient.

The pipeline calls `ensure_model`, `separate`, `stop`, `shutdown`, `close`, `stderr_tail`,
`versions`, `model_info` and `info` exactly as on the local client and cannot tell the two
apart. Underneath, each client owns one actor (actor.py) that Ray restarts whenever it
dies (`max_restarts=-1`); a restarted actor has to load its model again, which the client
notices by the actor's process id changing.

Data: the decoded song goes up in bounded windows (two in flight at most), the stems come
back in windows; the whole song is never one object. Cancel: the job's flag is set on the
actor at once, and the actor stops at its next segment; one that has not stopped within the
grace the worker's measured pace allows (one segment and a margin, workers/pace.py) is killed
(and restarted), so a cancel neither kills a slow worker that is about to stop nor waits for
a segment that does not end. Any other error
on this side while the actor separates (a failed registry write, a full disk) ends the
actor's job the same way: an actor left separating a job nobody reads would refuse every
next one as busy. A dead actor or machine ends the request like a dead local worker does:
`WorkerDied` with a diagnosis naming the machine, a machine fault (the song is tried again).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, NoReturn

import ray
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    ActorUnschedulableError,
    NodeDiedError,
    ObjectLostError,
    OutOfMemoryError,
    RayActorError,
    RayTaskError,
    WorkerCrashedError,
)

from stemdeck_watch.core.errors import (
    SHUTDOWN,
    Cancelled,
    ModelError,
    OutOfMemory,
    SeparationError,
    WorkerDied,
    WorkerStalled,
)
from stemdeck_watch.workers.ray.actor import SeparationActor
from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.workers.demucs.chunked import WINDOW_SECONDS
from stemdeck_watch.workers.pace import Pace, Watch
from stemdeck_watch.workers.demucs.precision import physical_cores
from stemdeck_watch.stages.scratch import AudioReader, AudioWriter
from stemdeck_watch.workers.separator import (
    DEMUCS_DEFAULTS,
    DemucsSettings,
    Lead,
    ModelInfo,
    Separation,
    separate_request,
)
from stemdeck_watch.workers.waiting import next_message
from stemdeck_watch.workers.worker import ModelUnavailable, memory_error

log = logging.getLogger(__name__)

START_TIMEOUT = 300.0  # an actor's start (placement, imports, a restart after a death)
UPLOADS_IN_FLIGHT = 2  # windows of the song on their way to the actor at once
POLL = 0.05  # seconds between checks of the job's cancel flag while waiting on Ray
LEAVE_WAIT = 2.0  # seconds an actor killed for good is given to remove its scratch first
TAIL_LINES = 40


class RayWorkerClient:
    """One resident-model worker on a Ray cluster (Ray must be connected: cluster.py)."""

    def __init__(
        self,
        device: str = "auto",
        threads: int = 0,
        precision: str = "auto",
        *,
        gpus: float = 0.0,
        cpus: float = 1.0,
        index: int = 0,
        spread: bool = True,
        env: dict[str, str] | None = None,
        node: str | None = None,
    ):
        self.device = device
        self.threads = threads
        self.precision = precision
        self.index = index  # which worker of the pool (status, logs)
        self._gpus, self._cpus, self._spread = gpus, cpus, spread
        self.node = node  # the machine this worker is pinned to (`workers = "auto"`)
        self._env = dict(env or {})  # environment of the actor process (tests, benchmarks)
        self._decided: dict[tuple[str, str | None, str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()  # one request at a time, as on the local client
        self._actor: Any = None
        self._actor_device = device  # the device the actor was started for
        self._where: dict[str, Any] | None = None  # the actor's ready() answer
        # the process a kill with restart ended: until it is gone it may still answer
        self._killed: tuple[Any, Any] | None = None  # (node id, pid)
        self._model: ModelInfo | None = None
        self._shut = False
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.pids: list[int] = []  # every actor process seen, in order (diagnostics, tests)
        self.nodes: list[str] = []  # the node of every job this client ran (tests)
        self.current: str | None = None  # the job separating on this worker now
        self.busy: collections.deque[tuple[float, float]] = collections.deque(maxlen=10000)
        self._paces: dict[str, Pace] = {}  # the time per segment measured, by device

    # ------------------------------------------------------------ views

    @property
    def pid(self) -> int | None:
        where = self._where
        return where["pid"] if where else None

    @property
    def versions(self) -> dict[str, str]:
        where = self._where
        return dict(where.get("versions", {})) if where else {}

    @property
    def actor(self) -> Any:
        """The actor handle (tests kill it to check recovery)."""
        return self._actor

    def stderr_tail(self) -> str:
        return "\n".join(self._tail)

    @property
    def model_info(self) -> ModelInfo | None:
        return self._model if self._where else None

    def leaves_room(self) -> bool:
        """Whether work beside a separation (decoding ahead, publishing behind) costs it
        nothing: the worker runs on a GPU or on another machine, or leaves this machine's
        cores free (see WorkerClient.leaves_room)."""
        where = self._where or {}
        if str(where.get("device") or self.device) not in ("cpu", "auto"):
            return True
        if where.get("node_ip") and where["node_ip"] != ray.util.get_node_ip_address():
            return True
        return int(where.get("threads") or self._cpus) < physical_cores()

    def info(self) -> dict[str, Any]:
        """This worker for `status --json` and `doctor`: where it runs and on what."""
        where = self._where or {}
        model = self._model
        return {
            "executor": "ray",
            "index": self.index,
            "pid": where.get("pid"),
            "node_ip": where.get("node_ip"),
            "hostname": where.get("hostname"),
            "node_id": where.get("node_id"),
            "device": where.get("device", self.device),
            "threads": where.get("threads"),
            "job": self.current,
            "model": model.name if model else None,
            "precision": dict(model.precision) if model else None,
        }

    # ------------------------------------------------------------ requests

    def ensure_model(
        self,
        name: str,
        repo: str | None,
        control: JobControl | None = None,
        precision: str | None = None,
        device: str | None = None,
    ) -> ModelInfo:
        """Start the actor if needed and have it load `name` (see Separator.ensure_model)."""
        setting = precision or self.precision
        key = (name, repo, setting, device or self.device)
        with self._lock:
            actor = self._ensure_actor(control, device)
            model = self._model
            if model is not None and model.serves(name, repo, setting):
                return model
            reply = self._get(
                actor.load.remote(name, repo, setting, self._decided.get(key)), control
            )
            self._model = ModelInfo.loaded(name, repo, reply)
            self._decided[key] = self._model.precision
            log.info(
                "ray worker %d (pid %s on %s) loaded model %s in %s",
                self.index,
                self.pid,
                self._host(),
                name,
                self._model.dtype,
            )
            return self._model

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
        """Upload the decoded song, separate it on the actor, write the stems it streams
        back into `output_dir/<stem>.npy` (see Separator.separate)."""
        request = separate_request(
            model,
            repo,
            demucs=demucs,
            lead=lead,
            precision=precision,
            window=window,
            shrink=shrink,
        )
        with self._lock:
            actor = self._ensure_actor(control, device)
            started = time.monotonic()
            self.current = job_id
            try:
                with self._cancel_on(actor, job_id, control):
                    self._upload(actor, job_id, input_path, window, control)
                    watch = self.pace().watch(self.pace().stall_limit(stall_seconds))
                    stems, done = self._receive(
                        actor, job_id, request, output_dir, control, on_progress, watch
                    )
                    watch.done()
            finally:
                self.current = None
                self.busy.append((started, time.monotonic()))
            self.nodes.append(str((self._where or {}).get("node_id")))
            return Separation(
                stems,
                self.pid or 0,
                float(done.get("seconds") or 0.0),
                **Separation.from_reply(done),
            )

    def pace(self) -> Pace:
        """The time per segment measured on this worker's device."""
        device = str((self._where or {}).get("device") or self.device)
        return self._paces.setdefault(device, Pace())

    def stop(self) -> None:
        """Kill the actor now (it restarts and reloads its model for the next job)."""
        actor = self._actor
        if actor is not None:
            self._kill(actor, restart=True)

    def shutdown(self) -> None:
        """Start no new request (the service is stopping); the running one is cut off by
        its job's cancel."""
        self._shut = True

    def close(self) -> None:
        """Kill the actor for good (the service stopped), once it removed its scratch (or
        could not within LEAVE_WAIT: the next actor on its machine removes it)."""
        self._shut = True
        self._let_go()

    def _let_go(self) -> None:
        """Kill the actor for good, once it removed its scratch (or could not within
        LEAVE_WAIT: the next actor on its machine removes it)."""
        actor, self._actor = self._actor, None
        if actor is not None:
            with contextlib.suppress(Exception):
                ray.wait([actor.leave.remote()], timeout=LEAVE_WAIT)
            self._kill(actor, restart=False)
        self._where = self._model = None

    # ------------------------------------------------------------ internals

    def _ensure_actor(self, control: JobControl | None, device: str | None = None) -> Any:
        """The actor on `device` (default: the client's), started if needed: one on another
        device is let go first (the CPU after a GPU ran out of memory, and back)."""
        if self._shut:
            raise Cancelled(SHUTDOWN)
        wanted = device or self.device
        if self._actor is not None and self._actor_device != wanted:
            log.info(
                "ray worker %d runs on %s; starting one on %s",
                self.index,
                self._actor_device,
                wanted,
            )
            self._let_go()
        if self._actor is None:
            cpu_only = wanted == "cpu" and self.device != "cpu"  # a GPU worker's fallback
            options: dict[str, Any] = {
                "num_cpus": self._cpus,
                "num_gpus": 0 if cpu_only else self._gpus,
                "max_restarts": -1,
                "max_task_retries": 0,
                "max_concurrency": 4,
            }
            if self.node is not None:  # its machine's worker: never moved to another
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                    self.node, soft=False
                )
            elif self._spread:
                options["scheduling_strategy"] = "SPREAD"
            if self._env:
                options["runtime_env"] = {"env_vars": self._env}
            self._actor = (
                ray.remote(SeparationActor).options(**options).remote(wanted, self.threads)
            )
            self._actor_device = wanted
        where = self._ready(control)
        if self._where is None or where["pid"] != self._where["pid"]:
            if self._where is not None:
                log.info(
                    "ray worker %d restarted: pid %s on %s",
                    self.index,
                    where["pid"],
                    where.get("hostname"),
                )
            self._model = None  # a new process: the model is loaded again
            self.pids.append(where["pid"])
        self._where = where
        return self._actor

    def _ready(self, control: JobControl | None) -> dict[str, Any]:
        """The actor's ready() answer, waiting while Ray (re)starts it."""
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            ref = self._actor.ready.remote()
            try:
                where: dict[str, Any] = self._get(
                    ref, control, deadline - time.monotonic(), starting=True
                )
            except WorkerDied:
                if time.monotonic() > deadline:
                    raise
            else:
                if (where.get("node_id"), where.get("pid")) != self._killed:
                    self._killed = None
                    return where
                if time.monotonic() > deadline:
                    raise WorkerDied(
                        f"the ray worker {self.index} killed on {self._host()} did not "
                        f"end within {START_TIMEOUT:.0f} s",
                        details=self.stderr_tail(),
                        worker=self.name(),
                    )
            # restarting: Ray answers "unavailable" until the new process is up, and the
            # killed one (its other threads) may still answer before it is gone
            if control is not None:
                control.check()
            time.sleep(POLL * 4)

    def _upload(
        self, actor: Any, job_id: str, input_path: Path, window: float | None, control: JobControl
    ) -> None:
        reader = AudioReader(input_path)
        rate = self._model.samplerate if self._model else 44100
        frames = max(1, int((window or WINDOW_SECONDS) * rate))
        self._get(actor.begin.remote(job_id, reader.channels), control)
        in_flight: collections.deque[Any] = collections.deque()
        try:
            for index, start in enumerate(range(0, reader.frames, frames)):
                if len(in_flight) >= UPLOADS_IN_FLIGHT:
                    self._get(in_flight.popleft(), control)
                in_flight.append(
                    actor.upload.remote(  # numbered: they may arrive out of order
                        job_id, index, reader.read(start, min(reader.frames, start + frames))
                    )
                )
            while in_flight:
                self._get(in_flight.popleft(), control)
        except BaseException:
            with contextlib.suppress(Exception):
                actor.drop.remote(job_id)
            raise

    def _receive(
        self,
        actor: Any,
        job_id: str,
        request: dict[str, Any],
        output_dir: Path,
        control: JobControl,
        on_progress: Callable[[float], None],
        watch: Watch,
    ) -> tuple[dict[str, Path], dict[str, Any]]:
        output_dir.mkdir(parents=True, exist_ok=True)
        writers: dict[str, AudioWriter] = {}
        stream = actor.separate.remote(job_id, request)
        cancelled_at: float | None = None
        done: dict[str, Any] = {}
        held = True  # the actor may still be running the job

        def cancel() -> None:
            """The actor was told (its flag, from the cancelling thread) and is given the
            cancel grace to stop by itself; past it, it is killed (and restarted)."""
            nonlocal cancelled_at, held
            cancelled_at = cancelled_at or time.monotonic()
            grace = self.pace().cancel_grace()
            if time.monotonic() - cancelled_at > grace:
                log.info(
                    "ray worker %d did not stop %s within %.1f s; killing it",
                    self.index,
                    job_id,
                    grace,
                )
                self._kill(actor, restart=True)
                held = False
                control.check()

        try:
            while True:
                next_message(
                    lambda wait: ray.wait([stream], timeout=wait)[0] or None,
                    control,
                    on_cancel=cancel,
                    watch=watch,
                    on_stall=lambda: self._stalled(actor, watch),
                    interval=POLL,
                )
                try:
                    item = self._value(next(stream))
                except StopIteration:
                    break
                if "progress" in item:
                    watch.beat()
                    on_progress(float(item["progress"]))
                elif "stem" in item:
                    name = item["stem"]
                    if name not in writers:
                        writers[name] = AudioWriter(
                            output_dir / f"{name}.npy", item["audio"].shape[0]
                        )
                    writers[name].write(item["audio"])
                elif item.get("cancelled"):
                    control.check()
                    raise SeparationError("the ray worker stopped the job without a cancel")
                elif item.get("done"):
                    done = item
            control.check()
            for writer in writers.values():
                writer.close()
        except BaseException as exc:
            for writer in writers.values():
                writer.abort()
            if held and not isinstance(exc, WorkerDied):  # a dead actor holds nothing
                self._end(actor, job_id, stream)
            raise
        return {name: output_dir / f"{name}.npy" for name in writers}, done

    def _stalled(self, actor: Any, watch: Watch) -> NoReturn:
        """The actor has reported nothing for longer than the stall limit: kill it (Ray
        starts it again) and end the request as a machine fault."""
        log.warning(
            "ray worker %d on %s reported no progress for %.0f s; killing it",
            self.index,
            self._host(),
            watch.silent(),
        )
        self._kill(actor, restart=True)
        raise WorkerStalled(
            watch.stalled_reason(where=f" on {self._host()}"),
            details=self.stderr_tail(),
            worker=self.name(),
        )

    def _end(self, actor: Any, job_id: str, stream: Any) -> None:
        """Make the actor let go of a job this side gave up on: its cancel flag is set and
        its stream read to the end; an actor that has not let go within the cancel grace is
        killed (and restarted), as for a cancel."""
        with contextlib.suppress(Exception):
            actor.cancel.remote(job_id)
            actor.drop.remote(job_id)
        deadline = time.monotonic() + self.pace().cancel_grace()
        try:
            while time.monotonic() < deadline:
                ready, _ = ray.wait([stream], timeout=POLL)
                if ready:
                    next(stream)  # a report or a stem nobody wants; errors stay in the ref
        except StopIteration:
            return  # the job ended there: the actor serves the next one
        except (ActorDiedError, ActorUnavailableError, RayActorError):
            return  # the actor went away: it holds nothing
        except Exception as exc:  # cannot tell: as if it had not let go
            log.warning("ray worker %d: lost track of %s (%s)", self.index, job_id, exc)
        log.info("ray worker %d did not let go of %s; killing it", self.index, job_id)
        self._kill(actor, restart=True)

    @contextlib.contextmanager
    def _cancel_on(self, actor: Any, job_id: str, control: JobControl) -> Any:
        """While inside, a cancel sets the job's flag on the actor at once (from the
        cancelling thread); the waiting loops see the control's flag and enforce the grace."""

        def flag() -> None:
            with contextlib.suppress(Exception):
                actor.cancel.remote(job_id)

        with control.registered(flag):
            yield

    def _get(
        self,
        ref: Any,
        control: JobControl | None,
        timeout: float | None = None,
        starting: bool = False,
    ) -> Any:
        """ray.get that a cancel interrupts and that turns Ray's errors into ours."""

        def ready(wait: float) -> list[Any] | None:
            if self._shut and starting:
                raise Cancelled(SHUTDOWN)
            return ray.wait([ref], timeout=wait)[0] or None

        def late() -> NoReturn:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
            raise WorkerDied(
                f"the ray worker {self.index} did not start within "
                f"{timeout:.0f} s: the cluster may lack free resources "
                f"({self._cpus:g} CPU, {self._gpus:g} GPU per worker)",
                details=self.stderr_tail(),
                worker=self.name(),
            )

        deadline = None if timeout is None else time.monotonic() + timeout
        next_message(ready, control, deadline=deadline, on_late=late, interval=POLL)
        return self._value(ref, quiet=starting)

    def _value(self, ref: Any, quiet: bool = False) -> Any:
        try:
            return ray.get(ref)
        except RayTaskError as exc:  # the request failed inside the actor
            cause = exc.cause
            if isinstance(cause, ModelUnavailable):
                raise ModelError(str(cause)) from None
            memory = memory_error(cause) if cause is not None else None
            if memory is not None:
                self._tail.extend(str(exc).splitlines()[-TAIL_LINES:])
                raise OutOfMemory(
                    f"the separation worker on {self._host()} ran out of memory "
                    f"({'the GPU' if memory != 'cpu' else 'the machine'}'s): "
                    f"{type(cause).__name__}: {cause}",
                    details=str(exc),
                    worker=self.name(),
                    device=memory,
                ) from None
            self._tail.extend(str(exc).splitlines()[-TAIL_LINES:])
            raise SeparationError(
                f"the ray worker on {self._host()} failed: {type(cause).__name__}: {cause}",
                details=str(exc),
            ) from None
        except OutOfMemoryError as exc:  # Ray's memory monitor killed the worker
            self._model = None
            self._tail.extend(str(exc).splitlines()[-TAIL_LINES:])
            raise OutOfMemory(
                f"the separation worker on {self._host()} ran out of memory (the "
                f"machine's; Ray stopped it)",
                details=str(exc),
                worker=self.name(),
                device="cpu",
            ) from None
        except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
            self._died(exc, quiet)
        except (ActorUnschedulableError, NodeDiedError, ObjectLostError, WorkerCrashedError) as exc:
            # its machine left (with the stems it held), or the worker cannot be placed
            # where it must run: the machine's fault as well
            self._died(exc, quiet)

    def _died(self, exc: BaseException, quiet: bool = False) -> None:
        host = self._host()
        self._model = None  # the restarted actor loads the model again
        text = str(exc)
        why = _diagnose(text) if self._node_alive() else "its machine left the cluster"
        if not quiet:  # not while waiting for a (re)start
            self._tail.extend(text.splitlines()[-TAIL_LINES:])
            log.warning("ray worker %d on %s died: %s", self.index, host, why)
        then = "; Ray restarts it" if self.node is None else ""  # a pinned one goes with it
        raise WorkerDied(
            f"the separation worker on {host} stopped unexpectedly ({why}){then}",
            details=text,
            worker=self.name(),
        )

    def _node_alive(self) -> bool:
        """Whether the machine the worker ran on is still in the cluster (as far as Ray's
        control store knows yet: a machine that just vanished may still count as alive)."""
        node = (self._where or {}).get("node_id")
        try:
            return any(n.get("NodeID") == node and n.get("Alive") for n in ray.nodes())
        except Exception:
            return True  # cannot tell: say what the error says

    def _kill(self, actor: Any, restart: bool) -> None:
        if restart and self._where is not None:
            self._killed = (self._where.get("node_id"), self._where.get("pid"))
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=not restart)
        self._model = None

    def name(self) -> str:
        """This worker as a fault names it."""
        return f"ray worker {self.index} on {self._host()}"

    def _host(self) -> str:
        where = self._where or {}
        host, ip = where.get("hostname"), where.get("node_ip")
        return f"{host} ({ip})" if host and ip else str(host or ip or "an unknown machine")


def _diagnose(text: str) -> str:
    """The short reason in a Ray actor-death message."""
    lowered = text.lower()
    if "node" in lowered and ("died" in lowered or "dead" in lowered or "removed" in lowered):
        return "its machine left the cluster"
    if "ray.kill" in lowered or "killed by" in lowered:
        return "the worker was killed"
    if "out of memory" in lowered or "oom" in lowered:
        return "probably out of memory"
    if any(
        word in lowered
        for word in ("sigkill", "exit", "died unexpectedly", "socket closed", "connection error")
    ):
        return "the worker process exited"
    return "the worker process or its machine went away"
