"""Control from the synced folder: a PAUSE file in the inbox, STATUS.txt in the outbox."""

from __future__ import annotations


import errno
import os

import pytest

from stemdeck_watch.ui.folder import STATUS_FILE, FolderRemote
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.util.synth import write_song

from support.helpers import open_scheduler, wait_for


@pytest.mark.slow
def test_a_pause_file_pauses_the_queue_while_it_exists(make_settings, service_factory):
    settings = make_settings()
    service, jobs = service_factory(settings)
    inbox, queue = settings.paths.inbox, service.queue
    pause = inbox / "Pause.txt"
    pause.write_text("paused from my phone")
    wait_for(lambda: queue.paused and queue.pause_reason == "folder", 10, "a folder pause")
    write_song(inbox / "song.wav", 1.0)
    wait_for(lambda: len(queue.order()) == 1, 30, "the song queued")
    pause.unlink()
    wait_for(lambda: not queue.paused, 10, "the queue to start when the file is gone")
    assert jobs.wait_final(1)[0].state is JobState.DONE
    assert not any(j.name.lower() == "pause" for j in jobs.jobs())  # never a job

    # a pause the user chose stays when the file comes and goes
    service.scheduler.pause("user")
    (inbox / "PAUSE").write_bytes(b"")
    (inbox / "PAUSE").unlink()
    service.folder_remote.check_pause_file()
    assert queue.paused and queue.pause_reason == "user"


@pytest.mark.slow
def test_pause_named_like_a_song_is_still_the_switch_not_a_job(make_settings, service_factory):
    settings = make_settings()
    service, jobs = service_factory(settings)
    write_song(settings.paths.inbox / "pause.wav", 1.0)
    wait_for(lambda: service.queue.pause_reason == "folder", 10, "a folder pause")
    service.intake.scan(settings.paths.inbox)
    assert service.intake.tracker.pending() == [] and jobs.jobs() == []


@pytest.mark.slow
def test_status_txt_shows_the_queue_waiting_files_and_failures(make_settings, service_factory):
    settings = make_settings(queue={"max_pending_files": 2})
    service, jobs = service_factory(settings)
    inbox = settings.paths.inbox
    (inbox / "broken.mp3").write_bytes(b"not audio at all" * 100)
    jobs.wait_final(1)
    service.scheduler.pause("user")
    for i, name in enumerate(("first", "second", "third")):
        write_song(inbox / f"{name}.wav", 1.0, seed=i)
        wait_for(
            lambda: len(service.queue.order()) + len(service.scheduler.waiting()) == i + 1,
            30,
            f"{name} admitted",
        )
    status_file = settings.paths.outbox / "STATUS.txt"

    def current() -> str:
        return status_file.read_text() if status_file.exists() else ""

    text = wait_for(lambda: "third.wav" in current() and current(), 15, "STATUS.txt updated")
    assert "paused by you" in text
    assert text.index("1. first") < text.index("2. second")
    assert "Waiting for room in the queue (1):" in text and "third.wav" in text
    assert "Recent failures:" in text and "broken:" in text
    assert [p.name for p in settings.paths.outbox.iterdir() if p.name.startswith(".")] == []
    service.shutdown()
    assert "The service is stopped." in current()


def test_a_failed_status_rewrite_keeps_the_last_status_and_leaves_no_temp_file(
    settings, monkeypatch, caplog
):
    """A sync client uploads whatever is in the outbox: a rewrite that fails (disk full, a
    network share gone) must leave the previous STATUS.txt whole and no hidden temp file."""
    scheduler = open_scheduler(settings)
    try:
        control = FolderRemote(scheduler, settings.paths.inbox, settings.paths.outbox)
        control.write_status()
        status = settings.paths.outbox / STATUS_FILE
        before = status.read_text()
        assert "Queue: running." in before

        def full(*_args: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        scheduler.pause("user")
        monkeypatch.setattr(os, "replace", full)
        control.write_status()
        monkeypatch.undo()
        assert status.read_text() == before
        assert sorted(p.name for p in settings.paths.outbox.iterdir()) == [STATUS_FILE]
        assert f"could not write {status}" in caplog.text
    finally:
        scheduler.registry.close()
