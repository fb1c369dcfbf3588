"""Wiring: build the parts in data-flow order, restore, run, and shut down cleanly.

intake → scheduler (registry + queue) → dispatcher → pipeline (decode, worker, publish) → outbox

A supervisor tick (once a second, on the thread that owns the service) restarts any part that
died: a dead thread must never leave songs sitting in the inbox unnoticed.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from stemdeck_watch.config import Settings
from stemdeck_watch.errors import ConfigError
from stemdeck_watch.control.api import ApiServer
from stemdeck_watch.control.folder import FolderControl
from stemdeck_watch.control.notify import Notifier
from stemdeck_watch.diskguard import DiskGuard
from stemdeck_watch.dispatcher import Dispatcher
from stemdeck_watch.events import EventBus
from stemdeck_watch.intake.watcher import Intake
from stemdeck_watch.jobqueue import JobQueue
from stemdeck_watch.lock import ServiceLock
from stemdeck_watch.pipeline.runner import Pipeline
from stemdeck_watch.pipeline.separate import WorkerClient
from stemdeck_watch.prefetch import Prefetcher
from stemdeck_watch.paths import default_state_dir, filesystem_type, is_network_filesystem
from stemdeck_watch.recovery import adopt_orphans, restore
from stemdeck_watch.registry import REGISTRY_FILE, Registry
from stemdeck_watch.scheduler import Scheduler

log = logging.getLogger(__name__)


class Service:
    def __init__(self, settings: Settings, *, bus: EventBus | None = None,
                 worker_env: dict[str, str] | None = None,
                 clock: Callable[[], float] = time.time):
        self.settings = settings
        self.folders = settings.paths
        self.bus = bus or EventBus()
        self._worker_env = worker_env
        self._clock = clock
        self._lock: ServiceLock | None = None
        self._started = False
        self.api: ApiServer | None = None  # the local API, once started (api.enabled)
        self.notifier: Notifier | None = None  # notify.urls, on threads of their own

    def start(self) -> None:
        folders = self.folders
        for folder in (folders.inbox, folders.outbox, folders.processed, folders.failed,
                       folders.state):
            folder.mkdir(parents=True, exist_ok=True)
        for preset in self.settings.presets:
            (folders.inbox / preset).mkdir(exist_ok=True)
        if is_network_filesystem(folders.state):
            raise ConfigError(
                f"folders.state = {folders.state} is on a network filesystem "
                f"({filesystem_type(folders.state)}), where SQLite's locking is unreliable; "
                f"choose a local folder (the default is {default_state_dir()})")
        self._lock = ServiceLock.acquire(folders.state)
        try:
            self.registry = Registry.open_or_rebuild(folders.state / REGISTRY_FILE, self._clock)
            self.queue = JobQueue()
            self.scheduler = Scheduler(self.registry, self.queue, self.bus, self.settings,
                                       self._clock)
            self.client = WorkerClient(self.settings.separation.device, self._worker_env)
            self.pipeline = Pipeline(
                self.settings, self.client, self.bus, self.scheduler.update,
                lambda sha, key: [job.output for job in self.registry.done_with(sha, key)
                                  if job.output])
            self.notifier = Notifier(self.bus, self.settings)
            self.notifier.start()  # before restore, which announces the restored jobs
            restore(self.scheduler, self.settings, self.pipeline.finish_published)
            adopt_orphans(self.scheduler, self.settings)
            self.scheduler.admit_waiting()  # files held back last time, if there is room now
            self.prefetcher = Prefetcher(self.scheduler, self.pipeline)
            self.dispatcher = Dispatcher(self.scheduler, self.pipeline, self.client, self.settings,
                                         self.prefetcher, DiskGuard(self.scheduler, self.settings))
            self.intake = Intake(self.settings.watch, folders.inbox, self.scheduler,
                                 links=self.settings.links.enabled)
            self.folder_control = FolderControl(self.scheduler, folders.inbox, folders.outbox)
            self.api = (ApiServer(self.scheduler, self.bus, self.settings.api, folders.state)
                        if self.settings.api.enabled else None)
        except BaseException:
            if self.notifier is not None:
                self.notifier.stop()
                self.notifier = None
            self._lock.release()
            raise
        self.dispatcher.start()
        self.prefetcher.start()
        self.intake.start()
        self.folder_control.start()
        self._started = True
        self._start_api()
        self._log_start()

    def _start_api(self) -> None:
        """The API is a control surface beside the data flow: if it cannot listen (the
        configured port is taken), songs are still separated; the log says why control is
        unavailable, and the CLI's control commands say the API is off."""
        api = self.api
        if api is None:
            return
        try:
            api.start()
        except OSError as exc:
            api.stop()
            self.api = None
            log.error("could not start the local API on %s port %d: %s; the queue page and the "
                      "CLI's pause/start/cancel/move/retry are unavailable", self.settings.api.host,
                      self.settings.api.port, exc.strerror or exc)

    def _log_start(self) -> None:
        folders, sep = self.folders, self.settings.separation
        log.info("stemdeck-watch is running: inbox %s → outbox %s", folders.inbox, folders.outbox)
        log.info("model %s%s on %s; state in %s", sep.model,
                 f" from {self.settings.model_repo}" if self.settings.model_repo else "",
                 sep.device, folders.state)
        if self.settings.links.playlists:
            log.warning("links.playlists = true is not supported yet: a playlist link gives "
                        "its first item only")

    def supervise(self) -> None:
        """Notice dead parts and restart them."""
        if not self._started:
            return
        if not self.dispatcher.alive():
            log.error("the dispatcher thread died; restarting it")
            self.dispatcher.start()
        if not self.prefetcher.alive():
            log.error("the prefetch thread died; restarting it")
            self.prefetcher.start()
        self.intake.check_health()
        if not self.folder_control.alive():
            log.error("the folder control thread died; restarting it")
            self.folder_control.start()
        if self.notifier is not None:
            self.notifier.restart_dead()

    def run_until(self, stop: threading.Event) -> None:
        """Run in the foreground until `stop` is set (by a signal handler or a test)."""
        self.start()
        try:
            self.supervise_until(stop)
        finally:
            self.shutdown()

    def supervise_until(self, stop: threading.Event) -> None:
        """The supervisor tick, once a second, until `stop` is set (on whichever thread: the
        tray owns the main thread while it runs)."""
        while not stop.wait(1.0):
            try:
                self.supervise()
            except Exception:
                log.exception("supervisor tick failed; going on")

    def shutdown(self) -> None:
        """Stop watching, cut off the running job (it goes back to the head of the queue, its
        partial output removed), stop the worker, close the registry."""
        if not self._started:
            return
        self._started = False
        log.info("stopping…")
        if self.api is not None:  # first: no control request may land on a closing service
            self.api.stop()
            self.api = None
        self.intake.stop()
        self.prefetcher.stop()
        self.dispatcher.stop()
        self.folder_control.stop()
        self.client.close()
        if self.notifier is not None:  # last: it sends what it still holds
            self.notifier.stop()
            self.notifier = None
        self.registry.close()
        if self._lock is not None:
            self._lock.release()
        log.info("stopped")

    def __enter__(self) -> "Service":
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.shutdown()
