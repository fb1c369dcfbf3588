"""The workers the service separates with, built from `[executor]`.

`kind = "local"`: the one resident worker subprocess, exactly as before (Ray is not imported).
`kind = "ray"`: a connection to the cluster, `workers` Ray actors behind RayWorkerClients,
and a watch that pauses the queue while the cluster is unreachable. The dispatcher drives one
client per worker, so at most one job is in flight on each.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any

from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.cli.status import WORKERS_META

log = logging.getLogger(__name__)


class Executor:
    """The clients (one per worker) and, for Ray, the connection and its watch."""

    def __init__(self, kind: str, clients: list[Any], connection: Any = None):
        self.kind = kind
        self.clients = clients
        self.connection = connection
        self.watch: Any = None
        self._registry: Any = None
        self._jobs: dict[int, str | None] = {}  # the job each worker holds, by slot
        self._lock = threading.Lock()

    def attach(self, scheduler: Any) -> None:
        """Record the workers in the registry from now on (status reads them there), and
        for Ray pause the queue while the cluster is gone."""
        self._registry = scheduler.registry
        if self.kind != "ray":
            return
        from stemdeck_watch.workers.cluster import ClusterWatch, probe

        endpoint = self.connection.endpoint if self.connection is not None else None
        self.watch = ClusterWatch(scheduler, check=lambda: probe(endpoint))
        self.watch.start()

    def supervise(self) -> None:
        if self.watch is not None and not self.watch.alive():
            log.error("the cluster watch thread died; restarting it")
            self.watch.start()

    def workers(self) -> list[dict[str, Any]]:
        """Each worker for `status --json` and `doctor`: where it runs, its device, the job
        it holds (by name)."""
        out = []
        for index, client in enumerate(self.clients):
            info = {**client.info(), "executor": self.kind, "index": index,
                    "job": self._jobs.get(index)}
            if self.kind == "local":
                info.setdefault("hostname", _hostname())
            out.append(info)
        return out

    def record(self, slot: int, job: str | None) -> None:
        """Worker `slot` took `job` (None: it is free); the workers go to the registry."""
        with self._lock:
            self._jobs[slot] = job
            if self._registry is not None:
                self._registry.set_meta(WORKERS_META, json.dumps(self.workers()))

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
            self.watch = None
        for client in self.clients:
            client.close()
        if self.connection is not None:
            self.connection.close()
            self.connection = None


def build(settings: Settings, worker_env: dict[str, str] | None = None) -> Executor:
    """The executor `settings.executor` asks for; a ConfigError says what is wrong."""
    ex, sep = settings.executor, settings.separation
    if ex.kind == "local":
        if ex.workers != 1:
            raise ConfigError(f"executor.workers = {ex.workers} needs executor.kind = \"ray\": "
                              f"the local executor is one worker process (one job at a time)")
        from stemdeck_watch.workers.local import WorkerClient

        return Executor("local", [WorkerClient(sep.device, worker_env, threads=sep.threads,
                                               precision=sep.precision)])
    from stemdeck_watch.workers.cluster import connect

    connection = connect(ex.address)
    from stemdeck_watch.workers.ray_client import RayWorkerClient

    clients = [RayWorkerClient(sep.device, sep.threads, sep.precision,
                               gpus=ex.gpus_per_worker, cpus=ex.cpus_per_worker, index=i,
                               env=worker_env)
               for i in range(ex.workers)]
    log.info("separating with %d Ray worker(s) on the cluster at %s", ex.workers, ex.address)
    return Executor("ray", clients, connection)


def _hostname() -> str:
    import socket

    return socket.gethostname()
