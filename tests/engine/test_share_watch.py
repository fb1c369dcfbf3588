"""The share watch on local folders: an inbox that vanishes (renamed away, as a share's folder
does when the mount below it goes) or loses the `.stemdeck/` folder the service keeps there
(the empty local folder a mount point leaves). The real registry, queue, scheduler and
pipeline; the mounts themselves are in tests/service/test_share_outage.py."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from stemdeck_watch.cli import status
from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.events import Event, ShareAway, ShareBack
from stemdeck_watch.core.jobs import FileSignature, JobState
from stemdeck_watch.engine.pipeline import Pipeline
from stemdeck_watch.engine.scheduler import PAUSE_RESTORE, PAUSE_USER, Scheduler
from stemdeck_watch.engine.shares import ShareWatch
from stemdeck_watch.store.registry import Registry
from stemdeck_watch.ui.folder import render_status_text
from stemdeck_watch.ui.desktop.notify import Composer
from stemdeck_watch.workers.local import WorkerClient

from support.helpers import add_job, open_scheduler


def reason(scheduler: Scheduler) -> str | None:
    return scheduler.queue.pause_reason if scheduler.queue.paused else None


def heard(scheduler: Scheduler) -> list[Event]:
    events: list[Event] = []
    scheduler.bus.subscribe(Event, events.append)
    return events


def test_an_inbox_that_vanishes_pauses_the_queue_until_it_answers(settings: Settings) -> None:
    scheduler = open_scheduler(settings)
    events = heard(scheduler)
    watch = ShareWatch(scheduler, settings, grace=0.0)
    watch.tick()
    assert reason(scheduler) is None
    inbox = settings.paths.inbox
    aside = inbox.with_name("elsewhere")

    inbox.rename(aside)  # the mount below the inbox went away: the inbox is missing
    watch.tick()
    assert reason(scheduler) == "inbox" and watch.away("inbox")
    watch.tick()  # the grace period (0 here) is over: announced once
    [away] = [e for e in events if isinstance(e, ShareAway)]
    note = Composer(settings.paths, ["share_away"]).notes(away)[0]
    assert "inbox" in note.title and "no song is lost" in note.body
    scheduler.start()  # a Start meanwhile does not start a queue whose inbox is away
    watch.tick()
    assert reason(scheduler) == "inbox"

    aside.rename(inbox)
    watch.tick()
    assert reason(scheduler) is None and not watch.away("inbox")
    assert [e.role for e in events if isinstance(e, ShareBack)] == ["inbox"]
    scheduler.registry.close()


def test_a_pause_the_user_chose_outlives_the_share_and_other_pauses_come_back(
    settings: Settings,
) -> None:
    scheduler = open_scheduler(settings)
    watch = ShareWatch(scheduler, settings)
    watch.tick()
    inbox, aside = settings.paths.inbox, settings.paths.inbox.with_name("elsewhere")

    scheduler.pause(PAUSE_RESTORE)  # restored jobs wait for Start
    inbox.rename(aside)
    watch.tick()
    assert reason(scheduler) == "inbox"
    aside.rename(inbox)
    watch.tick()
    assert reason(scheduler) == PAUSE_RESTORE

    scheduler.start()
    inbox.rename(aside)
    watch.tick()
    scheduler.pause(PAUSE_USER)  # the user pauses while the share is away
    aside.rename(inbox)
    watch.tick()
    assert reason(scheduler) == PAUSE_USER
    scheduler.registry.close()


def test_a_mount_point_left_as_an_empty_folder_is_a_share_away(settings: Settings) -> None:
    marker = settings.paths.inbox / ".stemdeck"
    marker.mkdir()
    scheduler = open_scheduler(settings)
    watch = ShareWatch(scheduler, settings)
    watch.tick()
    marker.rmdir()  # what is left is a local folder without the service's .stemdeck/
    watch.tick()
    assert reason(scheduler) == "inbox"
    assert ".stemdeck" in watch.away_now()["inbox"]
    marker.mkdir()  # mounted again
    watch.tick()
    assert reason(scheduler) is None
    scheduler.registry.close()


def test_a_done_songs_input_that_cannot_be_reached_moves_to_processed_when_it_answers(
    settings: Settings,
) -> None:
    scheduler = open_scheduler(settings)
    watch = ShareWatch(scheduler, settings)
    watch.tick()
    pipeline = Pipeline(settings, WorkerClient(), scheduler.bus, scheduler.update)
    pipeline.shares = watch
    job = add_job(scheduler, settings, "song", JobState.PUBLISHING)
    output = settings.paths.outbox / "song"
    output.mkdir()
    inbox, aside = settings.paths.inbox, settings.paths.inbox.with_name("elsewhere")

    inbox.rename(aside)  # the share goes away just as the stems are out
    watch.tick()
    done = pipeline.file_input(job, Path(job.source), output)
    assert done.state is JobState.DONE and done.source == job.source and done.error is None
    snapshot = scheduler.snapshot()
    assert [m["job"] for m in snapshot["pending_moves"]] == [job.id]
    shown = status.render(snapshot)
    assert "share cannot be reached" in shown and "pending: 1 input" in shown
    assert "share cannot be reached" in render_status_text(snapshot)  # STATUS.txt
    scheduler.registry.close()

    # the service restarts while the share is still away; then the share answers
    scheduler = open_scheduler(settings)
    watch = ShareWatch(scheduler, settings)
    watch.tick()
    aside.rename(inbox)
    signature = FileSignature.of(os.stat(job.source))
    assert not scheduler.wants(Path(job.source), signature)  # no second job for the song
    watch.tick()
    assert (settings.paths.processed / "song.wav").is_file()
    assert not Path(job.source).exists()
    assert scheduler.registry.get(job.id).source == str(settings.paths.processed / "song.wav")
    assert scheduler.registry.pending_moves() == []
    scheduler.registry.close()


def test_a_registry_from_before_pending_moves_gains_them(tmp_path: Path) -> None:
    path = tmp_path / "registry.sqlite3"
    Registry.open(path).close()
    db = sqlite3.connect(path)
    # as version 3 left it: no pending moves, no faults or made_by column
    db.executescript(
        "DROP TABLE pending_moves; ALTER TABLE jobs DROP COLUMN faults;"
        " ALTER TABLE jobs DROP COLUMN made_by; PRAGMA user_version = 3;"
    )
    db.close()
    registry = Registry.open(path)
    assert registry.pending_moves() == []
    registry.close()


def test_a_users_pause_survives_a_restart_while_the_inbox_is_away(settings: Settings) -> None:
    from stemdeck_watch.engine.recovery import restore

    scheduler = open_scheduler(settings)
    watch = ShareWatch(scheduler, settings)
    watch.tick()
    add_job(scheduler, settings, "song", JobState.QUEUED)
    scheduler.pause(PAUSE_USER)
    scheduler.registry.close()
    inbox, aside = settings.paths.inbox, settings.paths.inbox.with_name("elsewhere")
    inbox.rename(aside)

    scheduler = open_scheduler(settings)  # as Service.start does it
    watch = ShareWatch(scheduler, settings)
    for role in ("inbox", "outbox", "processed", "failed"):
        watch.look(role)
    pipeline = Pipeline(settings, WorkerClient(), scheduler.bus, scheduler.update)
    pipeline.shares = watch
    assert (
        restore(
            scheduler,
            settings,
            pipeline.file_input,
            unreachable=lambda _source: watch.away("inbox"),
        )
        == 1
    )
    watch.tick()
    assert reason(scheduler) == PAUSE_USER
    aside.rename(inbox)
    watch.tick()
    assert reason(scheduler) == PAUSE_USER
    assert [job.state for job in scheduler.registry.jobs()] == [JobState.QUEUED]
    scheduler.registry.close()
