"""The Ray actor: one resident-model separation worker on one machine of a Ray cluster.

It is the subprocess worker's twin (workers/worker.py) and loads, warms and calibrates the
model with the same code (`Worker.model`, `Worker.precision`), so a job gives the same
stems on either. What differs is how data moves: no worker machine has the inbox or the
outbox, so the service uploads the decoded song window by window (`begin`, `upload`: each
window one object in Ray's object store, never the whole song in one), the actor stages it
on its own scratch disk, separates it window by window (workers/demucs/chunked.py) and streams
progress and then the stems back, again one window per object (`separate` is a streaming
generator with backpressure, so stems waiting to be fetched stay bounded).

One request at a time: `separate` refuses a second job while one runs (and counts the
attempt in `overlaps`, which tests read); the actor allows a little concurrency only so that
`cancel`, `ready` and `stats` answer while a job runs. Ray cannot force-cancel an actor
task, so cancel is cooperative: a flag checked between model segments (a fraction of a
second); the client kills the actor if the flag is not honoured within a grace period.

Scratch: each actor process keeps its songs in one folder of its machine's temp folder,
locked (flock) while the process lives. A killed actor cannot clean up after itself, so every
actor starting on a machine first removes the folders whose lock nobody holds; the client
has the actor remove its folder (`leave`) before it kills it for good.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import ray

from stemdeck_watch.workers import heap

try:
    import fcntl
except ImportError:  # Windows: no lock, so no sweep of dead actors' folders
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("stemdeck_watch.workers.actor")

STREAM_BACKPRESSURE = 8  # stem windows (and progress reports) the actor may run ahead
PROGRESS_EVERY = 0.1  # seconds between progress reports streamed back
SCRATCH_PREFIX = "stemdeck-worker-"  # an actor's folder in its machine's temp folder
STARTING_PREFIX = "stemdeck-starting-"  # the same before its lock is held (never swept)
ALIVE = ".alive"  # the file an actor holds locked while it lives


class _Stopped(Exception):
    """Raised inside separation when the job's cancel flag is seen."""


class _Upload:
    """A song arriving window by window. The actor runs a few calls at once (so that cancel
    and stats answer during a job), so two windows in flight may arrive in either order, or
    at the same time: each carries its index and is appended in order, one at a time."""

    def __init__(self, folder: Path, writer: Any) -> None:
        self.folder, self.writer = folder, writer
        self._lock = threading.Lock()
        self._next = 0
        self._early: dict[int, Any] = {}  # windows that came before the one due

    def add(self, index: int, block: Any) -> None:
        with self._lock:
            self._early[index] = block
            while self._next in self._early:
                self.writer.write(self._early.pop(self._next))
                self._next += 1

    def close(self) -> None:
        """The whole song is here: finish the file (a window missing is an error)."""
        with self._lock:
            if self._early:
                self.writer.abort()
                raise RuntimeError(f"window {self._next} of the song never arrived")
            self.writer.close()


class SeparationActor:
    """Wrapped with `ray.remote` by the client (client.py), which sets its resources."""

    def __init__(self, device: str = "auto", threads: int = 0):
        # before the slow imports: clear what dead actors left here, and make this one's folder
        self._root, self._alive = _own_scratch(Path(tempfile.gettempdir()))
        import demucs
        import torch

        from stemdeck_watch.workers.demucs.precision import threads_for
        from stemdeck_watch.workers.worker import Worker, resolve_device

        # 0 = the CPUs Ray gave this actor (two actors on one machine must not both take
        # every core), else the configured count
        assigned = ray.get_runtime_context().get_assigned_resources().get("CPU")
        torch.set_num_threads(
            threads_for(threads) if threads or not assigned else max(1, int(assigned))
        )
        self._worker = Worker(resolve_device(device), sys.stderr)
        self._versions = {
            "torch": torch.__version__,
            "demucs": demucs.__version__,
            "python": sys.version.split()[0],
            "ray": ray.__version__,
        }
        self._lock = threading.Lock()  # held by the one running separation
        self._state = threading.Lock()  # guards the fields below
        self._staged: dict[str, _Upload] = {}  # job → its song, arriving
        self._cancelled: set[str] = set()
        self._running: str | None = None
        self.jobs_run = 0
        self.overlaps = 0

    # ------------------------------------------------------------ facts

    def ready(self) -> dict[str, Any]:
        """Where this worker runs: process, machine, device, threads, versions."""
        import torch

        context = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "actor_id": context.get_actor_id(),
            "device": self._worker.device,
            "threads": torch.get_num_threads(),
            "versions": self._versions,
        }

    def stats(self) -> dict[str, Any]:
        """How many jobs ran here and how often a second one was refused (tests)."""
        with self._state:
            return {"jobs_run": self.jobs_run, "overlaps": self.overlaps, "running": self._running}

    # ------------------------------------------------------------ requests

    def load(
        self, model: str, repo: str | None, precision: str, decided: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The subprocess worker's "load" request, answered by the same code."""
        return self._worker.handle(
            {"op": "load", "model": model, "repo": repo, "precision": precision, "decided": decided}
        )

    def begin(self, job_id: str, channels: int) -> None:
        """Open the scratch file the job's decoded audio is uploaded into."""
        from stemdeck_watch.stages.scratch import AudioWriter

        folder = Path(tempfile.mkdtemp(prefix=f"{job_id}-", dir=self._root))
        with self._state:
            self._discard(job_id)
            self._cancelled.discard(job_id)
            self._staged[job_id] = _Upload(folder, AudioWriter(folder / "input.npy", channels))

    def upload(self, job_id: str, index: int, block: Any) -> None:
        """Window `index` (from 0) of the decoded song, (channels, frames) float32."""
        with self._state:
            staged = self._staged.get(job_id)
        if staged is None:
            raise RuntimeError(f"job {job_id} has no upload open on this worker")
        staged.add(index, block)

    def cancel(self, job_id: str) -> bool:
        """Set the job's cancel flag; separation stops at its next segment. True if the
        job is staged or running here."""
        with self._state:
            self._cancelled.add(job_id)
            return job_id in self._staged or self._running == job_id

    def drop(self, job_id: str) -> None:
        """Forget a staged upload that will never run (cancelled or failed on the way)."""
        with self._state:
            self._discard(job_id)

    def leave(self) -> None:
        """The service is done with this actor (it is killed next): stop the job running
        here and remove the whole scratch folder."""
        with self._state:
            for job_id in list(self._staged):
                self._discard(job_id)
            if self._running is not None:
                self._cancelled.add(self._running)
        shutil.rmtree(self._root, ignore_errors=True)

    @ray.method(num_returns="streaming", _generator_backpressure_num_objects=STREAM_BACKPRESSURE)
    def separate(self, job_id: str, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Separate the uploaded song; yields {"progress": F} reports, then the stems one
        window at a time ({"stem", "start", "audio"}), then {"done": True, "seconds": F};
        {"cancelled": True} instead when the cancel flag stopped it."""
        if not self._lock.acquire(blocking=False):
            with self._state:
                self.overlaps += 1
                other = self._running
                self._discard(job_id)  # its upload never runs here
            raise RuntimeError(f"this worker is busy with job {other}; one job at a time")
        try:
            with self._state:
                staged = self._staged.pop(job_id, None)
                self._running = job_id
            if staged is None:
                raise RuntimeError(f"job {job_id} was not uploaded to this worker")
            try:
                staged.close()
                yield from self._separate(job_id, request, staged.folder)
            finally:
                shutil.rmtree(staged.folder, ignore_errors=True)
        finally:
            with self._state:
                self._running = None
                self._cancelled.discard(job_id)
                self.jobs_run += 1
            heap.give_back()  # the song's tensors, kept for its segments
            self._lock.release()

    # ------------------------------------------------------------ internals

    def _separate(
        self, job_id: str, request: dict[str, Any], folder: Path
    ) -> Iterator[dict[str, Any]]:
        from stemdeck_watch.stages.scratch import AudioReader
        from stemdeck_watch.workers.worker import window_seconds

        model = self._worker.model(request["model"], request.get("repo"))
        started = time.monotonic()
        window = window_seconds(request)
        events: queue.Queue[tuple[str, Any]] = queue.Queue()

        def progress(value: float) -> None:
            if job_id in self._cancelled:  # checked between segments: cooperative cancel
                raise _Stopped()
            events.put(("progress", value))

        def run() -> None:
            try:
                paths = self._worker.separate_files(
                    request, folder / "input.npy", folder / "stems", progress
                )
                events.put(("stems", paths))
            except BaseException as exc:  # handed to the generator, which raises it
                events.put(("error", exc))

        thread = threading.Thread(target=run, name=f"separate-{job_id}", daemon=True)
        thread.start()
        last = 0.0
        try:
            while True:
                kind, value = events.get()
                if kind == "progress":
                    now = time.monotonic()
                    if now - last >= PROGRESS_EVERY or value >= 1.0:
                        last = now
                        yield {"progress": value}
                    continue
                break
        finally:
            thread.join()
        if kind == "error":
            if isinstance(value, _Stopped):
                yield {"cancelled": True}
                return
            raise value
        frames = max(1, int(window * int(model.samplerate)))
        for name, path in value.items():
            reader = AudioReader(path)
            for start in range(0, reader.frames, frames):
                if job_id in self._cancelled:
                    yield {"cancelled": True}
                    return
                yield {
                    "stem": name,
                    "start": start,
                    "audio": reader.read(start, min(reader.frames, start + frames)),
                }
            if reader.frames == 0:
                yield {"stem": name, "start": 0, "audio": reader.read(0, 0)}
        yield {
            "done": True,
            "seconds": time.monotonic() - started,
            **self._worker.sizes(request, model),
            "made_by": self._worker.made_by,
        }

    def _discard(self, job_id: str) -> None:
        staged = self._staged.pop(job_id, None)
        if staged is not None:
            staged.writer.abort()
            shutil.rmtree(staged.folder, ignore_errors=True)


def _own_scratch(temp: Path) -> tuple[Path, int | None]:
    """This actor's scratch folder in `temp`, and the descriptor that holds it locked while
    the process lives. Made under a name the sweep passes over and renamed once locked, so
    an actor starting beside another never removes the other's new folder."""
    _sweep(temp)
    starting = Path(tempfile.mkdtemp(prefix=STARTING_PREFIX, dir=temp))
    alive = None
    if fcntl is not None:
        alive = os.open(
            starting / ALIVE, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600
        )
        fcntl.flock(alive, fcntl.LOCK_EX)
    root = temp / (SCRATCH_PREFIX + starting.name[len(STARTING_PREFIX) :])
    os.rename(starting, root)
    return root, alive


def _sweep(temp: Path) -> None:
    """Remove the scratch folders of this user's actors that died on this machine (their
    lock is free); a folder whose actor lives, or anyone else's, is left alone."""
    if fcntl is None:
        return
    for folder in temp.glob(SCRATCH_PREFIX + "*"):
        try:
            st = folder.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            alive = os.open(folder / ALIVE, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(alive, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its actor is alive
        finally:
            os.close(alive)
        log.info("removing the scratch of a worker that died on this machine: %s", folder)
        shutil.rmtree(folder, ignore_errors=True)
