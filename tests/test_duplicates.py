"""Duplicates, seen from the outbox: a duplicate names a folder that holds its own song's
stems, and `remove` deletes only the folder its job published.

Real service, real worker with the tiny model.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from stemdeck_watch.config import Settings
from stemdeck_watch.jobs import Job, JobState
from stemdeck_watch.pipeline import publish
from stemdeck_watch.service import Service
from stemdeck_watch.synth import write_song

from conftest import JobLog, outbox_entries

pytestmark = pytest.mark.slow


def drop(song: Path, inbox: Path, name: str) -> Path:
    """Put a copy of `song` into the inbox in one step (a copy renamed into place)."""
    tmp = song.with_name(f"{song.stem}-copy{song.suffix}")
    shutil.copyfile(song, tmp)
    os.replace(tmp, inbox / name)
    return inbox / name


def manifest_of(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / publish.MANIFEST).read_text())


def done(jobs: JobLog, count: int) -> list[Job]:
    """The jobs finished so far, oldest first, once there are `count`."""
    return sorted(jobs.wait_final(count), key=lambda job: job.created_at)


Started = Callable[[Settings], tuple[Service, JobLog]]


def moved_away_and_replaced(settings: Settings, service_factory: Started,
                            tmp_path: Path) -> tuple[Service, JobLog, Job, Job, Path]:
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
    assert manifest_of(second.output)["input"]["sha256"] == publish.sha256_of(b)
    return service, jobs, first, second, a


def test_a_duplicate_never_points_at_another_songs_stems(
        make_settings, service_factory, tmp_path: Path) -> None:
    settings = make_settings()
    _service, jobs, _first, second, a = moved_away_and_replaced(settings, service_factory,
                                                               tmp_path)
    drop(a, settings.paths.inbox, "take.wav")  # song A again: its old folder holds song B now

    third = done(jobs, 3)[2]
    assert third.state is JobState.DONE and third.error is None, third  # not a "duplicate"
    assert third.output == str(settings.paths.outbox / "take (2)")
    assert manifest_of(third.output)["input"]["sha256"] == publish.sha256_of(a)
    assert manifest_of(second.output)["job_id"] == second.id  # B's stems untouched
    assert outbox_entries(settings.paths.outbox) == {"take", "take (2)"}


def test_removing_an_old_job_never_deletes_the_stems_a_later_song_published_in_its_place(
        make_settings, service_factory, tmp_path: Path) -> None:
    settings = make_settings()
    service, _jobs, first, second, _a = moved_away_and_replaced(settings, service_factory,
                                                               tmp_path)
    assert service.scheduler.remove(first.id) == []

    assert service.registry.get(first.id) is None
    # outbox/take is song B's, published by the second job: still whole, still its own
    assert publish.read_manifest(Path(second.output)) is not None
    assert manifest_of(second.output)["job_id"] == second.id
    assert service.registry.tombstone(second.output, "output") is False
    assert (tmp_path / "moved away" / publish.MANIFEST).is_file()  # the user's copy: untouched


def test_removing_a_duplicate_leaves_the_original_songs_stems(
        make_settings, service_factory, tmp_path: Path) -> None:
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
    assert publish.read_manifest(Path(original.output)) is not None  # the original's stems
    kept = service.registry.get(original.id)
    assert kept is not None and kept.state is JobState.DONE and kept.output == original.output
    assert service.registry.tombstone(original.output, "output") is False
    assert outbox_entries(settings.paths.outbox) == {"song"}
    # the original is still removed with its folder
    assert service.scheduler.remove(original.id) == []
    assert outbox_entries(settings.paths.outbox) == set()
