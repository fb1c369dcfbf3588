"""Wiring: build the parts in data-flow order, restore, run, and shut down cleanly.

intake → scheduler (registry + queue) → dispatcher → pipeline (decode, worker, publish) → outbox

A supervisor tick (once a second, on the thread that owns the service) restarts any part that
died: a dead thread must never leave songs sitting in the inbox unnoticed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.ui.web.api import ApiServer
from stemdeck_watch.ui.folder import FolderRemote
from stemdeck_watch.ui.desktop.notify import Notifier
from stemdeck_watch.engine.diskguard import DiskGuard
from stemdeck_watch.engine.dispatcher import Dispatcher
from stemdeck_watch.engine.eta import Estimator
from stemdeck_watch.core.events import EventBus
from stemdeck_watch.workers import executor as pool
from stemdeck_watch.intake.ownership import InboxOwnership
from stemdeck_watch.intake.watcher import InboxWatcher
from stemdeck_watch.store.jobqueue import JobQueue
from stemdeck_watch.core.lock import ServiceLock
from stemdeck_watch.engine.inflight import SongsInFlight
from stemdeck_watch.engine.pipeline import Pipeline
from stemdeck_watch.engine.playlists import Playlists
from stemdeck_watch.engine.prefetch import Prefetcher
from stemdeck_watch.core.paths import (
    default_state_dir,
    filesystem_type,
    is_network_filesystem,
    private_dir,
)
from stemdeck_watch.engine.recovery import adopt_orphans, restore
from stemdeck_watch.store.registry import REGISTRY_FILE, Registry
from stemdeck_watch.engine.scheduler import Scheduler
from stemdeck_watch.engine.shares import ShareWatch, unmounted_at_start
from stemdeck_watch.stages import songfolder
from stemdeck_watch.workers.separator import Separator

log = logging.getLogger(__name__)
WARM_JOIN_SECONDS = 30  # how long a stop waits for the beat tracker still loading


class Service:
    def __init__(
        self,
        settings: Settings,
        *,
        bus: EventBus | None = None,
        worker_env: dict[str, str] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.settings = settings
        self.folders = settings.paths
        self.bus = bus or EventBus()
        self._worker_env = worker_env
        self._clock = clock
        self._lock: ServiceLock | None = None
        self._started = False
        self._warming: threading.Thread | None = None
        self.api: ApiServer | None = None  # the local API, once started (api.enabled)
        self.notifier: Notifier | None = None  # notify.urls, on threads of their own
        self.ownership: InboxOwnership | None = None  # the heartbeat in inbox/.stemdeck/
        self.executor: pool.Executor | None = None  # the workers (executor.kind)
        self._workers_lock = threading.Lock()  # the dispatchers change as workers come and go
        self._guard: DiskGuard | None = None
        self._playlists: Playlists | None = None
        self.shares: ShareWatch | None = None  # which folders answer (made at start)

    def _estimate(self) -> dict[str, Any]:
        """What the estimator keeps in the registry for `status`: the estimate alone, not a
        whole snapshot of the queue."""
        return {"eta": self.scheduler.estimate()}

    @property
    def started(self) -> bool:
        """False until `start` has started every part (a standby wait may end without)."""
        return self._started

    def start(self, stop: threading.Event | None = None) -> None:
        """Start every part. With `watch.standby` this first waits until another computer's
        service gives up the inbox; `stop` set meanwhile returns without starting."""
        folders = self.folders
        private_dir(folders.state)
        roles = {
            "inbox": folders.inbox,
            "outbox": folders.outbox,
            "processed": folders.processed,
            "failed": folders.failed,
        }
        # a folder whose share is not mounted yet (the NAS after a reboot) is waited for,
        # never made on the local disk under its mount point
        unmounted = unmounted_at_start(folders.state, roles)
        for role, mount in unmounted.items():
            log.warning(
                "the %s %s is on a share that is not mounted at %s; waiting for it",
                role,
                roles[role],
                mount,
            )
        for folder in [f for role, f in roles.items() if role not in unmounted]:
            folder.mkdir(parents=True, exist_ok=True)
        for preset in self.settings.presets if "inbox" not in unmounted else ():
            (folders.inbox / preset).mkdir(exist_ok=True)
        if is_network_filesystem(folders.state):
            raise ConfigError(
                f"folders.state = {folders.state} is on a network filesystem "
                f"({filesystem_type(folders.state)}), where SQLite's locking is unreliable; "
                f"choose a local folder (the default is {default_state_dir()})"
            )
        self._lock = ServiceLock.acquire(folders.state)
        try:
            self.ownership = InboxOwnership(
                folders.inbox, standby=self.settings.watch.standby, clock=self._clock
            )
            self.ownership.away = lambda: "inbox" in unmounted
            if not self.ownership.claim(stop):
                self.ownership = None
                self._lock.release()
                return
            self.registry = Registry.open_or_rebuild(folders.state / REGISTRY_FILE, self._clock)
            self.queue = JobQueue()
            self.scheduler = Scheduler(
                self.registry, self.queue, self.bus, self.settings, self._clock
            )
            # the workers: one local process, or `executor.workers` Ray actors; one
            # pipeline (and below, one dispatcher) per worker
            self.executor = pool.build(self.settings, self._worker_env)
            self.eta = Estimator(
                self.registry,
                self.settings,
                self.bus,
                lanes=len(self.executor.clients),
                clock=self._clock,
            )
            self.scheduler.eta = self.eta
            self.client = self.executor.clients[0]
            self._songs = (
                SongsInFlight()
            )  # a song separating on one worker is no new song on another
            self.pipelines = [self._pipeline(client) for client in self.executor.clients]
            self.pipeline = self.pipelines[0]
            # which folders answer: looked at once now (what each one is, the moves kept
            # from last time), then every second on its own thread
            self.shares = ShareWatch(self.scheduler, self.settings)
            for pipeline in self.pipelines:
                pipeline.shares = self.shares
            self.ownership.away = lambda: self.shares.away("inbox")
            for role in roles:  # before the restore: an input out of reach is not removed
                self.shares.look(role)
            self.notifier = Notifier(self.bus, self.settings)
            self.notifier.start()  # before restore, which announces the restored jobs
            self._playlists = Playlists(self.scheduler)
            for pipeline in self.pipelines:
                pipeline.playlists = self._playlists
            restore(
                self.scheduler,
                self.settings,
                self.pipeline.file_input,
                unreachable=lambda _source: self.shares.away("inbox"),
            )
            self._playlists.tidy()  # entries of a playlist link removed while stopped
            adopt_orphans(self.scheduler, self.settings)
            self.scheduler.admit_waiting()  # files held back last time, if there is room now
            self._guard = guard = DiskGuard(self.scheduler, self.settings)
            for pipeline in self.pipelines:
                pipeline.disk = guard
            self.prefetcher = Prefetcher(self.scheduler, self.pipeline, guard)
            self.dispatchers = [self._dispatcher(pipeline) for pipeline in self.pipelines]
            self.dispatcher = self.dispatchers[0]
            self._retired: list[Dispatcher] = []  # their workers left (executor.workers = "auto")
            self.intake = InboxWatcher(
                self.settings.watch,
                folders.inbox,
                self.scheduler,
                links=self.settings.links.enabled,
            )
            self.intake.shares = self.shares
            self.shares.subscribe(self.intake.share_changed)
            self.shares.tick()  # learn the folders, do the moves kept from last time
            self.folder_remote = FolderRemote(self.scheduler, folders.inbox, folders.outbox)
            self.folder_remote.away = self.shares.away
            self.api = (
                ApiServer(
                    self.scheduler,
                    self.bus,
                    self.settings.api,
                    folders.state,
                    base=self.settings.source.parent if self.settings.source else None,
                )
                if self.settings.api.enabled
                else None
            )
        except BaseException:
            if self.executor is not None:
                self.executor.close()
                self.executor = None
            if self.notifier is not None:
                self.notifier.stop()
                self.notifier = None
            if self.ownership is not None:
                self.ownership.stop()
                self.ownership = None
            self._lock.release()
            raise
        self.ownership.start()
        self.shares.start()
        self.executor.on_change = self._workers_changed
        self.executor.attach(self.scheduler)
        for dispatcher in self.dispatchers:
            dispatcher.start()
        self.prefetcher.start()
        self.intake.start()
        self.folder_remote.start()
        self.eta.start(self._estimate)
        self._started = True
        self._start_api()
        self._log_start()
        # the beat tracker loads beside the model, not on the first song (stages/beats.py)
        self._warming = threading.Thread(
            target=songfolder.warm, args=(self.settings,), name="warm-outputs", daemon=True
        )
        self._warming.start()

    def _pipeline(self, client: Separator) -> Pipeline:
        """A worker's pipeline; they share the songs in flight, the playlists and the disk
        check."""
        pipeline = Pipeline(
            self.settings,
            client,
            self.bus,
            self.scheduler.update,
            lambda sha, key: [
                job.output for job in self.registry.done_with(sha, key) if job.output
            ],
            self._songs,
        )
        pipeline.playlists, pipeline.disk = self._playlists, self._guard  # once made
        pipeline.shares = self.shares
        return pipeline

    def _dispatcher(self, pipeline: Pipeline) -> Dispatcher:
        assert self.executor is not None
        dispatcher = Dispatcher(
            self.scheduler,
            pipeline,
            pipeline.client,
            self.settings,
            self.prefetcher,
            self._guard,
            slot=pool.slot_of(pipeline.client),
            record=self.executor.record,
        )
        dispatcher.shares = self.shares
        return dispatcher

    def _workers_changed(self, joined: list[Separator], left: list[Separator]) -> None:
        """The cluster's machines changed (`executor.workers = "auto"`): a dispatcher for
        each worker that joined, and those of the workers that left retired (their songs
        go back to the queue)."""
        with self._workers_lock:
            if not self._started:
                return
            gone = [d for d in self.dispatchers if d.client in left]
            for dispatcher in gone:
                dispatcher.retire()
            added = [self._dispatcher(self._pipeline(client)) for client in joined]
            self._retired += gone
            self.dispatchers = [d for d in self.dispatchers if d not in gone] + added
            self.pipelines = [d.pipeline for d in self.dispatchers]
            if self.dispatchers:  # the first worker's, for what needs one: work ahead
                self.dispatcher = self.dispatchers[0]
                self.pipeline, self.client = self.dispatcher.pipeline, self.dispatcher.client
                self.prefetcher.pipeline = self.pipeline
            for dispatcher in added:
                dispatcher.start()

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
            log.error(
                "could not start the local API on %s port %d: %s; the queue page and the "
                "CLI's pause/start/cancel/move/retry are unavailable",
                self.settings.api.host,
                self.settings.api.port,
                exc.strerror or exc,
            )

    def _log_start(self) -> None:
        folders, sep = self.folders, self.settings.separation
        log.info("stemdeck-watch is running: inbox %s → outbox %s", folders.inbox, folders.outbox)
        log.info(
            "model %s%s on %s; state in %s",
            sep.model,
            f" from {self.settings.model_repo}" if self.settings.model_repo else "",
            sep.device,
            folders.state,
        )
        if self.settings.links.playlists:
            log.info(
                "playlist links become one job per entry (at most %d)",
                self.settings.links.max_entries,
            )

    def supervise(self) -> None:
        """Notice dead parts and restart them."""
        if not self._started:
            return
        with self._workers_lock:
            for dispatcher in self.dispatchers:
                if not dispatcher.alive():
                    log.error("the dispatcher thread %d died; restarting it", dispatcher.slot)
                    dispatcher.start()
        self.executor.supervise()
        if not self.prefetcher.alive():
            log.error("the prefetch thread died; restarting it")
            self.prefetcher.start()
        self.intake.check_health()
        if not self.shares.alive():
            log.error("the share watch thread died; restarting it")
            self.shares.start()
        if not self.folder_remote.alive():
            log.error("the folder control thread died; restarting it")
            self.folder_remote.start()
        if not self.eta.alive():
            log.error("the estimate thread died; restarting it")
            self.eta.start(self._estimate)
        if self.notifier is not None:
            self.notifier.restart_dead()
        if self.ownership is not None and not self.ownership.alive():
            log.error("the heartbeat thread died; restarting it")
            self.ownership.start()

    def run_until(self, stop: threading.Event) -> None:
        """Run in the foreground until `stop` is set (by a signal handler or a test)."""
        self.start(stop)
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
        self.shares.stop()  # before the dispatchers: a song waiting for its outbox gives up
        self.prefetcher.stop()
        with self._workers_lock:  # no worker joins meanwhile
            for dispatcher in [*self.dispatchers, *self._retired]:
                dispatcher.stop()
        self.folder_remote.stop()
        self.executor.close()
        self.eta.stop()
        self.eta.write(None)  # what was measured, for the next start
        if self.notifier is not None:  # last: it sends what it still holds
            self.notifier.stop()
            self.notifier = None
        self.registry.close()
        if self._warming is not None:  # seconds at most, and only just after a start
            # joined, so that the interpreter never exits in the middle of librosa's import;
            # bounded, so that a stuck import never holds the stop up
            self._warming.join(WARM_JOIN_SECONDS)
            if self._warming.is_alive():
                log.warning(
                    "the beat tracker was still loading after %g s; stopping without it",
                    WARM_JOIN_SECONDS,
                )
            self._warming = None
        if self.ownership is not None:  # after the last move: a standby may take over now
            self.ownership.stop()
            self.ownership = None
        if self._lock is not None:
            self._lock.release()
        log.info("stopped")

    def __enter__(self) -> Service:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.shutdown()
