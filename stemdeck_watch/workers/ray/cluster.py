"""Connecting the service to a Ray cluster, and watching that connection.

`executor.address`: "local" starts a private cluster on this machine (for trying the Ray
executor out, or for using several workers on one big machine), "auto" joins the cluster
this machine was added to with `ray start`, "HOST:6379" joins a head node directly, and
"ray://HOST:10001" goes through Ray Client. If this process is connected to Ray already (a
test, a notebook) that connection is used and left open on shutdown.

A lost cluster must not fail job after job: `ClusterWatch` probes the cluster every few
seconds, pauses the queue with `pause_reason = "cluster"` when the probe fails or no machine
is left, and starts it again when the cluster answers — unless somebody paused it for
another reason meanwhile.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Callable

from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.workers import ray_installed
from stemdeck_watch.util.ticker import Ticker

log = logging.getLogger(__name__)

PAUSE_CLUSTER = "cluster"
PROBE_SECONDS = 2.0
CONNECT_TIMEOUT = 5.0
RECONNECT_SECONDS = 3600  # how long a lost head is waited for before Ray ends the service
INSTALL_HINT = "install it with: pip install 'stemdeck-watch[ray]'"


class Connection:
    """This process's connection to Ray; `close` ends it if `connect` opened it.
    `endpoint`: HOST:PORT the cluster answers on (its GCS, or the Ray Client server), which
    the watch probes without going through Ray (whose calls block while the head is gone)."""

    def __init__(self, address: str, owned: bool):
        self.address = address
        self.owned = owned
        self.endpoint: str | None = None
        if address.startswith("ray://"):
            self.endpoint = address[len("ray://") :]
        else:
            import ray

            self.endpoint = ray.get_runtime_context().gcs_address or None

    def close(self) -> None:
        if self.owned:
            import ray

            ray.shutdown()
            self.owned = False


def connect(address: str) -> Connection:
    """Connect to the cluster named by `executor.address`; a clear error if it cannot."""
    if not ray_installed():
        raise ConfigError(
            f'executor.kind = "ray" needs Ray, which is not installed; '
            f'{INSTALL_HINT}, or set executor.kind = "local"'
        )
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address != "local":
        # Ray ends a driver whose head has been unreachable for this long (default 60 s);
        # the service rather waits, paused, for the head to come back
        os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", str(RECONNECT_SECONDS))
    import ray

    if ray.is_initialized():
        return Connection(address, owned=False)
    kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": True}
    if address == "local":  # always a new private cluster, never one found on the machine
        kwargs["include_dashboard"] = False
    elif address != "auto":
        _reachable(address)  # ray.init retries an unreachable head for minutes
    try:
        ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(
            f"could not connect to the Ray cluster at executor.address = {address!r}: {exc}; "
            f"start the head with `ray start --head` (see docs/guide/scaling-out.md), check the "
            f'address and the auth token, or use address = "local"'
        ) from None
    log.info("connected to the Ray cluster at %s", address)
    return Connection(address, owned=True)


def _listening(endpoint: str, timeout: float) -> str | None:
    """None if something accepts connections at HOST:PORT, else why not."""
    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except (OSError, ValueError) as exc:
        return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return None


def _reachable(address: str, timeout: float = CONNECT_TIMEOUT) -> None:
    """Fail fast, and clearly, when nothing listens at the head's address."""
    why = _listening(address[len("ray://") :] if address.startswith("ray://") else address, timeout)
    if why is not None:
        raise ConfigError(
            f"could not connect to the Ray cluster at executor.address = {address!r}: "
            f"{why}; is the head running (`ray start --head`, see "
            f"docs/guide/scaling-out.md) and is the port open from this machine?"
        ) from None


def probe(endpoint: str | None = None) -> str | None:
    """None if the cluster answers and has a live machine; else what is wrong. With
    `endpoint` (Connection.endpoint) a head that does not accept connections is found
    without a Ray call (which would wait for it)."""
    import ray

    if endpoint:
        why = _listening(endpoint, PROBE_SECONDS)
        if why is not None:
            return f"the cluster's head at {endpoint} does not answer ({why})"
    try:
        if not ray.is_initialized():
            return "not connected to Ray"
        alive = [node for node in ray.nodes() if node.get("Alive")]
    except Exception as exc:  # a lost head or Ray Client connection raises many kinds
        return f"the cluster does not answer ({type(exc).__name__}: {exc})"
    if not alive:
        return "no machine of the cluster is alive"
    return None


def nodes() -> list[dict[str, Any]]:
    """The live machines: address, hostname and resources (doctor)."""
    import ray

    return [
        {
            "node_ip": n.get("NodeManagerAddress"),
            "hostname": n.get("NodeManagerHostname"),
            "node_id": n.get("NodeID"),
            "resources": n.get("Resources", {}),
        }
        for n in ray.nodes()
        if n.get("Alive")
    ]


def workers_for(
    resources: dict[str, Any], gpus_per_worker: float, cpus_per_worker: float
) -> tuple[int, float]:
    """How many workers a machine with `resources` holds under `executor.workers = "auto"`,
    and the GPUs each reserves: one per GPU (`gpus_per_worker` each, 1 when that is 0) on a
    machine with GPUs, else one per `cpus_per_worker` cores; never more than its cores hold."""
    cpus = int(float(resources.get("CPU", 0)) // cpus_per_worker)
    gpus = float(resources.get("GPU", 0))
    if gpus >= 1:
        each = gpus_per_worker or 1.0
        return min(int(gpus // each), cpus), each
    return cpus, 0.0


def machines() -> dict[str, dict[str, Any]]:
    """The live machines of the cluster: node id → its resources (totals)."""
    import ray

    return {
        str(n.get("NodeID")): dict(n.get("Resources") or {}) for n in ray.nodes() if n.get("Alive")
    }


class ClusterWatch(Ticker):
    """Pauses the queue while the cluster is gone, starts it when it is back."""

    name = "cluster-watch"

    def __init__(
        self,
        scheduler: Any,
        check: Callable[[], str | None] = probe,
        interval: float = PROBE_SECONDS,
    ):
        super().__init__(interval)
        self.scheduler = scheduler
        self._check = check
        self.problem: str | None = None  # the last probe's finding (status, tests)

    def tick(self) -> None:
        """One probe and its consequence (the loop's body; tests call it directly)."""
        problem = self._check()
        queue = self.scheduler.queue
        if problem is not None and self.problem is None:
            log.error(
                "the Ray cluster is unavailable: %s; the queue is paused until it is back", problem
            )
            if not queue.paused:
                self.scheduler.pause(PAUSE_CLUSTER)
        elif problem is None and self.problem is not None:
            log.info("the Ray cluster is back")
            if queue.paused and queue.pause_reason == PAUSE_CLUSTER:
                self.scheduler.start()
        self.problem = problem
