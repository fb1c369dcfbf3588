"""The workers the service separates with, built from `[executor]`.

`kind = "local"`: the one resident worker subprocess, exactly as before (Ray is not imported).
`kind = "ray"`: a connection to the cluster, `workers` Ray actors behind RayWorkerClients,
and a watch that pauses the queue while the cluster is unreachable. The dispatcher drives one
client per worker, so at most one job is in flight on each.

`workers = "auto"` follows the machines the cluster has now: every few seconds the pool
looks at the live machines, starts the workers a machine that joined holds (one per GPU, or
per `cpus_per_worker` cores; each pinned to its machine) and lets go of those of a machine
that left. Whoever wired the workers (the service) hears of each change (`on_change`) and
starts or retires a dispatcher for each; the song a leaving worker held ends in a machine
fault and goes back to the queue.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import threading
import time
from typing import Any, Callable

from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.core.events import ModelDownloading
from stemdeck_watch.store.snapshot import WORKERS_META
from stemdeck_watch.util.ticker import Ticker
from stemdeck_watch.workers.separator import Separator

log = logging.getLogger(__name__)

DOWNLOAD_RECORD_EVERY = 1.0  # seconds between two registry writes of a download's progress
POOL_SECONDS = 5.0  # how often `workers = "auto"` looks at the cluster's machines

# builds one worker pinned to a machine: (index, node id, GPUs it reserves) -> client
MakeWorker = Callable[[int, str, float], Separator]
# told the workers that joined and those that left (auto): starts and retires dispatchers
OnChange = Callable[[list[Separator], list[Separator]], None]


def slot_of(client: Separator) -> int:
    """The queue slot of a worker: its index in the pool (0 for the local worker)."""
    return int(getattr(client, "index", 0))


class Executor:
    """The clients (one per worker) and, for Ray, the connection and its watch."""

    def __init__(
        self,
        kind: str,
        clients: list[Separator],
        connection: Any = None,
        make: MakeWorker | None = None,
        sizes: tuple[float, float] = (0.0, 1.0),
    ):
        self.kind = kind
        self.clients = clients
        self.connection = connection
        self.watch: Any = None
        self.on_change: OnChange | None = None  # auto: set by whoever runs the dispatchers
        self._make = make  # auto: the pool follows the cluster's machines
        self._sizes = sizes  # auto: (gpus_per_worker, cpus_per_worker)
        self._by_node: dict[str, list[Separator]] = {}
        self._indexes = itertools.count(len(clients))
        self._pool: _Pool | None = None
        self._registry: Any = None
        self._jobs: dict[int, str | None] = {}  # the job each worker holds, by slot
        self._recorded: str | None = None  # the workers as last written to the registry
        self._lock = threading.Lock()
        self._bus: Any = None
        self._download_written = 0.0  # when a download's progress was last recorded
        self._download_timer: threading.Timer | None = None  # records the latest, later
        self._downloading: dict[int, str] = {}  # the model each slot downloads
        self._closed = False

    @property
    def auto(self) -> bool:
        """Whether the workers follow the cluster's machines (`workers = "auto"`)."""
        return self._make is not None

    def attach(self, scheduler: Any) -> None:
        """Record the workers in the registry from now on (status reads them there), and
        for Ray pause the queue while the cluster is gone (and with "auto" follow its
        machines)."""
        self._registry = scheduler.registry
        self._bus = scheduler.bus
        for slot, client in enumerate(self.clients):
            if hasattr(client, "on_download"):  # the local worker reports its downloads
                client.on_download = functools.partial(self._downloaded, slot)
        if self.kind != "ray":
            return
        from stemdeck_watch.workers.ray.cluster import ClusterWatch, probe

        endpoint = self.connection.endpoint if self.connection is not None else None
        self.watch = ClusterWatch(scheduler, check=lambda: probe(endpoint))
        self.watch.start()
        if self.auto:
            self._pool = _Pool(self)
            self._pool.start()

    def supervise(self) -> None:
        if self.watch is not None and not self.watch.alive():
            log.error("the cluster watch thread died; restarting it")
            self.watch.start()
        if self._pool is not None and not self._pool.alive():
            log.error("the worker pool thread died; restarting it")
            self._pool.start()

    def follow(
        self, machines: dict[str, dict[str, Any]]
    ) -> tuple[list[Separator], list[Separator]]:
        """`workers = "auto"`: start the workers the live `machines` (node id → resources)
        hold and have none yet, let go of those of machines no longer there; returns
        (joined, left), after telling `on_change`."""
        from stemdeck_watch.workers.ray.cluster import workers_for

        assert self._make is not None
        joined: list[Separator] = []
        left: list[Separator] = []
        with self._lock:
            for node in [n for n in self._by_node if n not in machines]:
                left += self._by_node.pop(node)
            for node, resources in machines.items():
                count, gpus = workers_for(resources, *self._sizes)
                have = self._by_node.setdefault(node, [])
                while len(have) < count:
                    client = self._make(next(self._indexes), node, gpus)
                    have.append(client)
                    joined.append(client)
            self.clients = sorted((c for cs in self._by_node.values() for c in cs), key=slot_of)
            for client in left:
                self._jobs.pop(slot_of(client), None)
        for client in joined:
            log.info(
                "a machine of the cluster (%s) holds ray worker %d: started it",
                getattr(client, "node", "?"),
                slot_of(client),
            )
        for client in left:
            log.info(
                "ray worker %d's machine left the cluster: the worker goes with it", slot_of(client)
            )
        if (joined or left) and self.on_change is not None:
            self.on_change(joined, left)
        for client in left:
            client.close()
        if joined or left:
            self._write()
        return joined, left

    def workers(self) -> list[dict[str, Any]]:
        """Each worker for `status --json` and `doctor`: its device, threads, model and
        precision; a Ray worker also where it runs and the job it holds (by name)."""
        out = []
        for client in list(self.clients):
            info = client.info()
            if self.kind == "ray":
                index = slot_of(client)
                info = {**info, "executor": self.kind, "index": index, "job": self._jobs.get(index)}
            out.append(info)
        return out

    def record(self, slot: int, job: str | None) -> None:
        """Worker `slot` took `job` (None: it is free); the workers go to the registry, the
        one place their state is kept (status reads it there, also while the service is
        stopped). Written only when it changed: a registry write between two jobs is
        worker idle time."""
        with self._lock:
            self._jobs[slot] = job
        self._write()

    def _write(self) -> None:
        with self._lock:
            if self._registry is None:
                return
            text = json.dumps(self.workers())
            if text != self._recorded:
                self._registry.set_meta(WORKERS_META, text)
                self._recorded = text

    def _downloaded(self, slot: int, report: dict[str, Any] | None) -> None:
        """Worker `slot` reports a model download (None: it ended): recorded for `status`
        at most every DOWNLOAD_RECORD_EVERY seconds (its start and end at once, the latest
        figures once the interval is over, also if the transfer stalls), announced on the
        bus for the page and the tray."""
        with self._lock:
            if report is not None:
                self._downloading[slot] = report["model"]
            model = self._downloading.pop(slot, "") if report is None else report["model"]
            self._record_download(force=report is None)
        if self._bus is not None:
            self._bus.publish(
                ModelDownloading(
                    model,
                    report["done"] if report else 0,
                    report.get("total") if report else None,
                    ended=report is None,
                )
            )

    def _record_download(self, force: bool = False) -> None:
        """Write the workers now if the last download record is old enough (or `force`),
        else once it is (a timer). Called with the lock held."""
        wait = self._download_written + DOWNLOAD_RECORD_EVERY - time.monotonic()
        if wait > 0 and not force:
            if self._download_timer is None:
                self._download_timer = threading.Timer(wait, self._record_later)
                self._download_timer.daemon = True
                self._download_timer.start()
            return
        self._download_written = time.monotonic()
        if self._registry is not None:
            text = json.dumps(self.workers())
            if text != self._recorded:
                self._registry.set_meta(WORKERS_META, text)
                self._recorded = text

    def _record_later(self) -> None:
        try:
            with self._lock:
                self._download_timer = None
                if not self._closed:
                    self._record_download(force=True)
        except Exception:
            log.exception("could not record the workers' download progress")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._download_timer is not None:
                self._download_timer.cancel()
                self._download_timer = None
        if self._pool is not None:
            self._pool.stop()
            self._pool = None
        if self.watch is not None:
            self.watch.stop()
            self.watch = None
        for client in self.clients:
            client.close()
        if self.connection is not None:
            self.connection.close()
            self.connection = None


class _Pool(Ticker):
    """`workers = "auto"`: follows the cluster's machines every POOL_SECONDS."""

    name = "worker-pool"

    def __init__(self, executor: Executor):
        super().__init__(POOL_SECONDS)
        self.executor = executor

    def tick(self) -> None:
        from stemdeck_watch.workers.ray.cluster import machines

        watch = self.executor.watch
        if watch is not None and watch.problem is not None:
            return  # the cluster does not answer: the queue is paused, the pool waits
        self.executor.follow(machines())


def build(settings: Settings, worker_env: dict[str, str] | None = None) -> Executor:
    """The executor `settings.executor` asks for; a ConfigError says what is wrong."""
    ex, sep = settings.executor, settings.separation
    env = {**worker_env_for(settings), **(worker_env or {})}
    if ex.kind == "local":
        if ex.workers != 1:
            raise ConfigError(
                f"executor.workers = {ex.workers!r} needs executor.kind = "
                f'"ray": the local executor is one worker process (one job '
                f"at a time)"
            )
        from stemdeck_watch.workers.local import WorkerClient

        from stemdeck_watch.workers.compiled.cache import CompileSettings

        compiling = CompileSettings(
            sep.compile, settings.paths.state / "compiled", sep.compile_cache_mb
        )
        return Executor(
            "local",
            [
                WorkerClient(
                    sep.device,
                    env,
                    threads=sep.threads,
                    precision=sep.precision,
                    compiling=compiling,
                    stall_seconds=sep.stall_seconds,
                )
            ],
        )
    from stemdeck_watch.workers.ray.cluster import connect

    connection = connect(ex.address)
    from stemdeck_watch.workers.ray.client import RayWorkerClient

    if ex.workers == "auto":
        from stemdeck_watch.workers.ray.cluster import machines

        def make(index: int, node: str, gpus: float) -> Separator:
            return RayWorkerClient(
                sep.device,
                sep.threads,
                sep.precision,
                gpus=gpus,
                cpus=ex.cpus_per_worker,
                index=index,
                env=env,
                node=node,
            )

        executor = Executor(
            "ray", [], connection, make=make, sizes=(ex.gpus_per_worker, ex.cpus_per_worker)
        )
        try:
            executor.follow(machines())
        except BaseException:
            executor.close()
            raise
        if not executor.clients:
            executor.close()
            raise ConfigError(
                f'executor.workers = "auto": no machine of the Ray cluster at {ex.address} '
                f"has room for a worker ({ex.cpus_per_worker:g} CPU each, "
                f"executor.cpus_per_worker); add a machine, or lower cpus_per_worker"
            )
        log.info(
            "separating with %d Ray worker(s) on the cluster at %s, following its machines",
            len(executor.clients),
            ex.address,
        )
        return executor
    assert isinstance(ex.workers, int)
    clients: list[Separator] = [
        RayWorkerClient(
            sep.device,
            sep.threads,
            sep.precision,
            gpus=ex.gpus_per_worker,
            cpus=ex.cpus_per_worker,
            index=i,
            env=env,
        )
        for i in range(ex.workers)
    ]
    log.info("separating with %d Ray worker(s) on the cluster at %s", ex.workers, ex.address)
    return Executor("ray", clients, connection)


def worker_env_for(settings: Settings) -> dict[str, str]:
    """What a worker needs from the configuration in its environment: the model hub it
    downloads missing models from, where it is not demucs's own (the worker's default)."""
    from stemdeck_watch.workers.demucs.models import DEFAULT_HUB, HUB_ENV

    hub = settings.separation.model_hub
    return {} if hub == DEFAULT_HUB else {HUB_ENV: hub}
