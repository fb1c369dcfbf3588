"""What a library dropped at once costs the intake, counted rather than timed: the work done
per file stays that file's own (a stat, its registry lookups), and what can be done once per
tick is (the inbox's links resolved, the queue announced, the waiting files logged)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable

import pytest

from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.events import QueueChanged
from stemdeck_watch.engine import scheduler as scheduler_module
from stemdeck_watch.engine.eta import Estimator
from stemdeck_watch.intake.stability import SWEEP_SECONDS, StabilityTracker
from stemdeck_watch.intake.watcher import InboxWatcher

from support.helpers import open_scheduler

FILES = 300
LANE = 20


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def counting(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, under: Path | None = None
) -> list[int]:
    """Count the calls of `owner.name` (only those about a path under `under`, if given)."""
    calls = [0]
    real: Callable[..., Any] = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        if under is None or str(args[0]).startswith(str(under)):
            calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def library(folder: Path, count: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"song{i:04}.wav" for i in range(count)]
    for path in paths:
        path.write_bytes(b"RIFF" + os.urandom(32))
    return paths


def test_a_library_settling_in_one_tick_costs_each_file_only_its_own_lookups(
    make_settings: Callable[..., Settings],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = make_settings(queue={"max_pending_files": LANE})
    scheduler = open_scheduler(settings)
    clock = Clock()
    watcher = InboxWatcher(settings.watch, settings.paths.inbox, scheduler, clock=clock)
    library(settings.paths.inbox, FILES)
    watcher.scan(settings.paths.inbox)
    watcher.admit_ready()  # the first look at each file decides nothing
    clock.now += settings.watch.settle_seconds + 0.1
    announced: list[QueueChanged] = []
    scheduler.bus.subscribe(QueueChanged, announced.append)
    realpaths = counting(monkeypatch, os.path, "realpath")
    lookups = counting(monkeypatch, scheduler.registry, "latest_for_source")
    with caplog.at_level(logging.DEBUG, logger="stemdeck_watch.engine.scheduler"):
        watcher.admit_ready()
    assert len(scheduler.queue.order()) == LANE
    assert len(scheduler.waiting()) == FILES - LANE
    assert lookups[0] == FILES  # one lookup per file, not one before the lock and one in it
    assert realpaths[0] == 1  # the inbox, once for the tick
    assert len(announced) == 1  # the queue and its waiting files, announced once
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == LANE + 2, lines[-5:]  # each job queued, the first file held, a sum
    assert lines[-1] == (
        f"queue full ({LANE} files pending): {FILES - LANE - 1} more files wait in the inbox"
    )
    scheduler.registry.close()


def test_the_tracker_looks_again_only_at_files_that_may_have_settled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between two sweeps (a tick apart) a call of `ready` stats only the files whose quiet
    period may be over: the intake calls it every few milliseconds while a library settles."""
    clock = Clock()
    tracker = StabilityTracker(3.0, clock)
    early, late = library(tmp_path / "early", 100), library(tmp_path / "late", 100)
    stats = counting(monkeypatch, os, "stat", under=tmp_path)

    def looked_at(now: float, settled: int) -> int:
        clock.now, stats[0] = now, 0
        assert len(tracker.ready()) == settled
        return stats[0]

    for song in early:
        tracker.touch(song)
    assert looked_at(1000.0, 0) == 100  # the first look at each
    clock.now = 1001.0
    for song in late:
        tracker.touch(song)
    assert looked_at(1001.0, 0) == 200  # a sweep, and the first look at the late ones
    assert looked_at(1002.9, 0) == 200  # a sweep
    assert looked_at(1003.0, 100) == 100  # the early ones are due: only they are looked at
    assert looked_at(1003.05, 0) == 0  # nothing due, no sweep: nothing looked at
    assert looked_at(1002.9 + SWEEP_SECONDS, 0) == 100  # a sweep looks at every one left


def test_files_queued_in_one_tick_rewrite_no_order_and_keep_it_on_disk(
    make_settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new job goes to the end of the queue, where a job without a saved place comes on
    disk: nothing to rewrite (every queued job's place per new job was quadratic), and a
    restart finds the queue in its order."""
    settings = make_settings(queue={"max_pending_files": 10 * FILES})
    scheduler = open_scheduler(settings)
    clock = Clock()
    watcher = InboxWatcher(settings.watch, settings.paths.inbox, scheduler, clock=clock)
    library(settings.paths.inbox, FILES)
    watcher.scan(settings.paths.inbox)
    watcher.admit_ready()
    clock.now += settings.watch.settle_seconds + 0.1
    orders = counting(monkeypatch, scheduler.registry, "save_order")
    kinds = counting(monkeypatch, scheduler, "_kind_of")
    writes = counting(monkeypatch, scheduler.registry, "add_all")
    watcher.admit_ready()
    assert len(scheduler.queue.order()) == FILES
    assert writes[0] == 1  # the tick's jobs in one transaction, not one disk sync per job
    assert orders[0] == 0
    assert kinds[0] == 0  # a lane far from full is not counted job by job
    scheduler.queue.move(scheduler.queue.order()[-1], after=None)  # as `move --first` does
    scheduler._save_order()
    watcher.tracker.touch(settings.paths.inbox / "song9999.wav")
    (settings.paths.inbox / "song9999.wav").write_bytes(b"RIFF")
    watcher.admit_ready()
    clock.now += settings.watch.settle_seconds + 0.1
    watcher.admit_ready()
    assert scheduler.registry.queued_order() == scheduler.queue.order()
    last = scheduler.registry.latest_for_source(str(settings.paths.inbox / "song9999.wav"))
    assert last is not None and scheduler.queue.order()[-1] == last.id
    scheduler.registry.close()


def test_the_estimate_kept_for_status_is_built_without_a_snapshot(
    make_settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the estimator keeps for `status` is the estimate alone: a snapshot of a library
    dropped at once is a status object per job and per waiting file, every refresh."""
    settings = make_settings(queue={"max_pending_files": 40})
    scheduler = open_scheduler(settings)
    scheduler.eta = Estimator(scheduler.registry, settings, scheduler.bus, clock=lambda: 1000.0)
    clock = Clock()
    watcher = InboxWatcher(settings.watch, settings.paths.inbox, scheduler, clock=clock)
    library(settings.paths.inbox, 60)
    watcher.scan(settings.paths.inbox)
    watcher.admit_ready()
    clock.now += settings.watch.settle_seconds + 0.1
    watcher.admit_ready()
    snapshots = counting(monkeypatch, scheduler_module, "build_snapshot")
    eta = scheduler.estimate()
    assert snapshots[0] == 0
    assert eta is not None and eta["songs"] == 40
    assert eta == scheduler.snapshot()["eta"]  # the same estimate a snapshot holds
    scheduler.registry.close()


def test_a_file_deleted_while_its_tick_is_admitted_becomes_no_job(
    make_settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tick's jobs are written at its end: a file deleted before then (its delete found
    no job to cancel yet) makes none, and the lane counts the jobs the tick is making."""
    settings = make_settings(queue={"max_pending_files": 50})
    scheduler = open_scheduler(settings)
    clock = Clock()
    watcher = InboxWatcher(settings.watch, settings.paths.inbox, scheduler, clock=clock)
    songs = library(settings.paths.inbox, 80)
    watcher.scan(settings.paths.inbox)
    watcher.admit_ready()
    clock.now += settings.watch.settle_seconds + 0.1
    submit = scheduler.submit_file
    submitted: list[Path] = []

    def submit_then_delete(*args: Any) -> Any:
        if len(submitted) == 30:  # the first one is a job of this tick by now
            submitted[0].unlink()
            scheduler.file_gone(submitted[0])
        submitted.append(args[0])
        return submit(*args)

    monkeypatch.setattr(scheduler, "submit_file", submit_then_delete)
    watcher.admit_ready()
    assert len(submitted) == len(songs)
    assert scheduler.registry.latest_for_source(str(submitted[0])) is None
    # the lane counted the tick's own jobs: 50 made (one of them dropped), the rest wait
    assert len(scheduler.queue.order()) == 49
    assert len(scheduler.waiting()) == 30
    assert scheduler.registry.queued_order() == scheduler.queue.order()
    scheduler.registry.close()
