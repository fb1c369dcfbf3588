"""Duplicates, seen from the outbox: a duplicate names a folder that holds its own song's
stems, `remove` deletes only the folder its job published, and the same song dropped twice
back to back is separated once even while the first copy is still being published.

Real service, real worker with the tiny model. The publish of the first copy is held back by
a gate on the real stem writer, so "the second copy was checked while the first was still
publishing" follows from the order of events, not from how fast this machine is.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.errors import PublishError
from stemdeck_watch.core.events import JobChanged
from stemdeck_watch.core.jobs import Job, JobState
from stemdeck_watch.stages import publish
from stemdeck_watch.stages.manifest import MANIFEST, read_manifest
from stemdeck_watch.util.safefile import sha256_of
from stemdeck_watch.service import Service
from stemdeck_watch.util.synth import write_song

from support.helpers import JobLog, outbox_entries, wait_for

pytestmark = pytest.mark.slow


def drop(song: Path, inbox: Path, name: str) -> Path:
    """Put a copy of `song` into the inbox in one step (a copy renamed into place)."""
    tmp = song.with_name(f"{song.stem}-copy{song.suffix}")
    shutil.copyfile(song, tmp)
    os.replace(tmp, inbox / name)
    return inbox / name


def manifest_of(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / MANIFEST).read_text())


def done(jobs: JobLog, count: int) -> list[Job]:
    """The jobs finished so far, oldest first, once there are `count`."""
    return sorted(jobs.wait_final(count), key=lambda job: job.created_at)


Started = Callable[[Settings], tuple[Service, JobLog]]


def moved_away_and_replaced(
    settings: Settings, service_factory: Started, tmp_path: Path
) -> tuple[Service, JobLog, Job, Job, Path]:
    """take.wav (song A) is published to outbox/take; the user moves that folder away; a new
    take.wav (song B) is published to outbox/take. Returns both jobs and song A's file."""
    service, jobs = service_factory(settings)
    songs = tmp_path / "songs"
    songs.mkdir()
    a = write_song(songs / "a.wav", 1.5, seed=1)
    b = write_song(songs / "b.wav", 1.5, seed=2)
    outbox = settings.paths.outbox
    drop(a, settings.paths.inbox, "take.wav")
    (first,) = done(jobs, 1)
    assert first.state is JobState.DONE and first.output == str(outbox / "take"), first
    shutil.move(outbox / "take", tmp_path / "moved away")
    drop(b, settings.paths.inbox, "take.wav")
    second = done(jobs, 2)[1]
    assert second.state is JobState.DONE and second.output == str(outbox / "take"), second
    assert manifest_of(second.output)["input"]["sha256"] == sha256_of(b)
    return service, jobs, first, second, a


def test_a_duplicate_never_points_at_another_songs_stems(
    make_settings, service_factory, tmp_path: Path
) -> None:
    settings = make_settings()
    _service, jobs, _first, second, a = moved_away_and_replaced(settings, service_factory, tmp_path)
    drop(a, settings.paths.inbox, "take.wav")  # song A again: its old folder holds song B now

    third = done(jobs, 3)[2]
    assert third.state is JobState.DONE and third.error is None, third  # not a "duplicate"
    assert third.output == str(settings.paths.outbox / "take (2)")
    assert manifest_of(third.output)["input"]["sha256"] == sha256_of(a)
    assert manifest_of(second.output)["job_id"] == second.id  # B's stems untouched
    assert outbox_entries(settings.paths.outbox) == {"take", "take (2)"}


def test_removing_an_old_job_never_deletes_the_stems_a_later_song_published_in_its_place(
    make_settings, service_factory, tmp_path: Path
) -> None:
    settings = make_settings()
    service, _jobs, first, second, _a = moved_away_and_replaced(settings, service_factory, tmp_path)
    assert service.scheduler.remove(first.id) == []

    assert service.registry.get(first.id) is None
    # outbox/take is song B's, published by the second job: still whole, still its own
    assert read_manifest(Path(second.output)) is not None
    assert manifest_of(second.output)["job_id"] == second.id
    assert service.registry.tombstone(second.output, "output") is False
    assert (tmp_path / "moved away" / MANIFEST).is_file()  # the user's copy: untouched


def test_removing_a_duplicate_leaves_the_original_songs_stems(
    make_settings, service_factory, tmp_path: Path
) -> None:
    settings = make_settings()
    service, jobs = service_factory(settings)
    song = write_song(tmp_path / "song.wav", 1.5, seed=3)
    drop(song, settings.paths.inbox, "song.wav")
    (original,) = done(jobs, 1)
    drop(song, settings.paths.inbox, "again.wav")
    duplicate = done(jobs, 2)[1]
    assert duplicate.output == original.output and "already separated" in (duplicate.error or "")

    assert service.scheduler.remove(duplicate.id) == []

    assert service.registry.get(duplicate.id) is None
    assert read_manifest(Path(original.output)) is not None  # the original's stems
    kept = service.registry.get(original.id)
    assert kept is not None and kept.state is JobState.DONE and kept.output == original.output
    assert service.registry.tombstone(original.output, "output") is False
    assert outbox_entries(settings.paths.outbox) == {"song"}
    # the original is still removed with its folder
    assert service.scheduler.remove(original.id) == []
    assert outbox_entries(settings.paths.outbox) == set()


class FirstPublishHeld:
    """Holds the real stem writer for the song `name` until the job `second` has been
    checked against it: it started separating (the same song separated twice), or it says
    it waits for the song in flight. Then the write goes on, or (`fail`) fails as a full
    disk would."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, service: Service, name: str, fail: bool = False
    ) -> None:
        self.checked = threading.Event()
        self.held_for_nothing = False  # the gate gave up waiting: the check never came
        self._second: str | None = None
        real = publish.write_song

        def held(
            staging: Path, stems: Any, samplerate: int, song: str, *args: Any, **kwargs: Any
        ) -> Any:
            if song == name:
                self.held_for_nothing = not self.checked.wait(120)
                if fail:
                    raise PublishError(f"could not write the stems of {song}: injected")
            return real(staging, stems, samplerate, song, *args, **kwargs)

        monkeypatch.setattr(publish, "write_song", held)
        service.bus.subscribe(JobChanged, self._on_change)
        gate = self

        class Waits(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "in flight" in record.getMessage():
                    gate.checked.set()

        self._handler = Waits(logging.INFO)
        self._logger = logging.getLogger("stemdeck_watch.engine.pipeline")
        self._level = self._logger.level
        self._logger.addHandler(self._handler)
        self._logger.setLevel(logging.INFO)

    def second(self, job_id: str) -> None:
        self._second = job_id

    def _on_change(self, event: JobChanged) -> None:
        if event.job.id == self._second and event.job.state is JobState.SEPARATING:
            self.checked.set()

    def close(self) -> None:
        self.checked.set()
        self._logger.removeHandler(self._handler)
        self._logger.setLevel(self._level)


def twins_back_to_back(
    settings: Settings,
    service: Service,
    jobs: JobLog,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    fail: bool,
) -> tuple[dict[str, Job], Path]:
    """song.wav and `song copy.wav` (the same bytes) dropped back to back; the first one's
    publish is held until the second has been checked. Returns the jobs by name."""
    gate = FirstPublishHeld(monkeypatch, service, "song", fail=fail)
    try:
        song = write_song(tmp_path / "song.wav", 1.5, seed=4)
        service.scheduler.pause("user")
        drop(song, settings.paths.inbox, "song.wav")
        wait_for(lambda: len(service.queue.order()) == 1, 30, "song queued")
        drop(song, settings.paths.inbox, "song copy.wav")
        wait_for(lambda: len(service.queue.order()) == 2, 30, "song copy queued")
        gate.second(service.queue.order()[1])
        service.scheduler.start()
        finished = {job.name: job for job in jobs.wait_final(2, timeout=240)}
    finally:
        gate.close()
    assert not gate.held_for_nothing
    return finished, song


def test_the_same_song_dropped_twice_back_to_back_is_separated_once(
    make_settings, service_factory, monkeypatch, tmp_path: Path
) -> None:
    settings = make_settings(queue={"work_beside": "on"})
    service, jobs = service_factory(settings)
    finished, song = twins_back_to_back(settings, service, jobs, monkeypatch, tmp_path, fail=False)

    first, second = finished["song"], finished["song copy"]
    assert first.state is JobState.DONE and first.error is None, first
    # the second waited for the first and is its duplicate: one folder, one separation
    assert second.state is JobState.DONE and second.output == first.output, second
    assert "already separated" in (second.error or "")
    assert outbox_entries(settings.paths.outbox) == {"song"}
    assert manifest_of(first.output)["input"]["sha256"] == sha256_of(song)
    assert len(service.client.busy) == 1  # the worker separated it once
    assert {p.name for p in settings.paths.processed.iterdir()} == {"song.wav", "song copy.wav"}


def test_a_song_whose_twin_in_flight_fails_is_separated_itself(
    make_settings, service_factory, monkeypatch, tmp_path: Path
) -> None:
    settings = make_settings(queue={"work_beside": "on"})
    service, jobs = service_factory(settings)
    finished, song = twins_back_to_back(settings, service, jobs, monkeypatch, tmp_path, fail=True)

    first, second = finished["song"], finished["song copy"]
    assert first.state is JobState.FAILED and "injected" in (first.error or ""), first
    assert second.state is JobState.DONE and second.error is None, second
    assert second.output == str(settings.paths.outbox / "song copy")
    assert manifest_of(second.output)["input"]["sha256"] == sha256_of(song)
    assert outbox_entries(settings.paths.outbox) == {"song copy"}
    assert (settings.paths.failed / "song.wav").is_file()


def test_a_song_checked_while_the_outbox_is_away_waits_for_it_and_is_still_a_duplicate(
    make_settings, service_factory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The outbox's share drops just as the same song, dropped again, is checked against
    the folder its first copy was published to: an outbox that cannot be read is no answer,
    the check waits for it, and the song is not separated a second time."""
    from stemdeck_watch.engine import pipeline

    settings = make_settings()
    service, jobs = service_factory(settings)
    song = write_song(tmp_path / "song.wav", 1.5, seed=5)
    drop(song, settings.paths.inbox, "song.wav")
    (first,) = done(jobs, 1)
    assert first.state is JobState.DONE and first.output, first
    outbox, aside = settings.paths.outbox, tmp_path / "outbox away"
    real = pipeline.read_manifest
    dropped: list[threading.Timer] = []

    def share_drops(folder: Path) -> Any:
        if Path(folder) == Path(first.output or "") and not dropped:
            outbox.rename(aside)  # the mount under the outbox drops, for two seconds
            dropped.append(threading.Timer(2.0, aside.rename, (outbox,)))
            dropped[0].start()
        return real(folder)

    monkeypatch.setattr(pipeline, "read_manifest", share_drops)
    drop(song, settings.paths.inbox, "song again.wav")
    second = done(jobs, 2)[1]
    assert dropped, "the check never looked at the first copy's folder"
    dropped[0].join()
    assert second.state is JobState.DONE and second.output == first.output, second
    assert "already separated" in (second.error or "")
    assert outbox_entries(outbox) == {"song"}
    assert len(service.client.busy) == 1  # the worker separated it once
