"""Work done ahead of a job, or a signature taken before it, must not outlive the input it was
made from: a link edited after its download was prepared, a song replaced by one of the same
size and time after it was decoded ahead, a song replaced between its job being taken and its
first state write.

Real service, real worker with the tiny model, real watcher; a link's media comes from a
loopback server. Each window is held open with a gate on the service's own steps, not with
sleeps. Work beside the worker is on, as users with a GPU (or a free core) get it.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.jobs import FileSignature, JobState
from stemdeck_watch.engine import pipeline as runner
from stemdeck_watch.service import Service
from stemdeck_watch.util.synth import write_song

from support.helpers import JobLog, SeparationGate, wait_for
from support.media import MediaServer, url_file

pytestmark = pytest.mark.slow


def manifest_of(folder: str | None) -> dict[str, Any]:
    assert folder is not None
    return json.loads((Path(folder) / "stemdeck.json").read_text())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def queue_paused(service: Service, drops: list[Callable[[], object]]) -> list[str]:
    """Job ids, in order, of the inputs `drops` write one after another into the paused queue."""
    service.scheduler.pause("user")
    for count, drop in enumerate(drops, 1):
        drop()
        wait_for(lambda n=count: len(service.queue.order()) == n, 30, f"input {count} queued")
    return service.queue.order()


def replace(path: Path, content: Path, keep_time_of: Path | None = None) -> FileSignature:
    """Save `content` over `path` as editors and sync clients do (renamed over it: a new
    inode), with `keep_time_of`'s modification time if given (`cp -p`, `rsync -t`)."""
    if keep_time_of is not None:
        st = keep_time_of.stat()
        os.utime(content, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(content, path)
    return FileSignature.of(path.stat())


@pytest.fixture
def media(tmp_path: Path) -> Iterator[MediaServer]:
    folder = tmp_path / "served"
    write_song(folder / "old.wav", 2.0, seed=1)
    write_song(folder / "new.wav", 3.0, seed=2)
    server = MediaServer(folder)
    yield server
    server.close()


@pytest.mark.parametrize("intake_sees_the_edit", [True, False])
def test_a_link_edited_after_its_download_was_prepared_publishes_the_new_url(
    make_settings, service_factory, media: MediaServer, tmp_path: Path, intake_sees_the_edit: bool
) -> None:
    settings = make_settings(queue={"work_beside": "on"})
    service, jobs = service_factory(settings)
    inbox = settings.paths.inbox
    first, a = queue_paused(
        service,
        [
            lambda: write_song(inbox / "first.wav", 3.0),
            lambda: url_file(inbox, "a.url", media.url("old.wav")),
        ],
    )
    gate = SeparationGate(service.client, first)  # "first" separates until the edit is made
    service.scheduler.start()

    downloaded = settings.paths.scratch / a / "download"
    wait_for(
        lambda: any(downloaded.glob("media.*")) and not any(downloaded.glob("*.part")),
        60,
        "the old URL downloaded ahead",
    )
    assert jobs.latest[first].state is JobState.SEPARATING
    assert jobs.latest[a].state is JobState.QUEUED
    if not intake_sees_the_edit:
        service.intake.stop()  # the edit lands after the job is taken: only the job sees it
    edited = replace(inbox / "a.url", url_file(tmp_path, "a.url", media.url("new.wav")))
    if intake_sees_the_edit:  # "changed while queued": the job keeps its place...
        wait_for(lambda: jobs.latest[a].signature == edited, 30, "the edit to be seen")
        # ...and the new URL is fetched ahead in its turn, while "first" still separates
        wait_for(lambda: "/new.wav" in media.requests, 60, "the new URL fetched ahead")
        assert jobs.latest[first].state is JobState.SEPARATING
    gate.open()

    done = wait_for(lambda: jobs.latest[a].state.is_final and jobs.latest[a], 120, "a to end")
    assert done.state is JobState.DONE and done.error is None, done
    manifest = manifest_of(done.output)
    assert manifest["link"]["url"] == media.url("new.wav")
    assert round(manifest["input"]["duration"]) == 3
    assert "/new.wav" in media.requests
    processed = settings.paths.processed / "a.url"
    assert media.url("new.wav") in processed.read_text() and not (inbox / "a.url").exists()
    wait_for(lambda: not any(settings.paths.scratch.rglob("*")), 10, "scratch to be empty")


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The job ids of the real decodes that ended, in order."""
    ended: list[str] = []
    real_decode = runner.decode_to_file

    def recorded_decode(source, target, *args, **kwargs):  # type: ignore[no-untyped-def]
        audio = real_decode(source, target, *args, **kwargs)
        ended.append(Path(target).parent.name)
        return audio

    monkeypatch.setattr(runner, "decode_to_file", recorded_decode)
    return ended


def b_decoded_ahead(
    settings: Settings, service_factory: Callable[..., Any], decoded: list[str]
) -> tuple[Service, JobLog, str, str, SeparationGate]:
    """The service, its job log, "first" separating (held by the gate until the test opens
    it) and b.wav, queued behind it, decoded ahead."""
    inbox = settings.paths.inbox
    service, jobs = service_factory(settings)
    first, b = queue_paused(
        service,
        [
            lambda: write_song(inbox / "first.wav", 3.0),
            lambda: write_song(inbox / "b.wav", 2.0, seed=1),
        ],
    )
    gate = SeparationGate(service.client, first)
    service.scheduler.start()
    wait_for(lambda: b in decoded, 60, "b decoded ahead")
    assert jobs.latest[first].state is JobState.SEPARATING
    assert jobs.latest[b].state is JobState.QUEUED
    return service, jobs, first, b, gate


@pytest.mark.parametrize("intake_sees_the_copy", [True, False])
def test_a_song_replaced_by_one_of_the_same_size_and_time_is_not_published_with_the_old_audio(
    make_settings, service_factory, decoded: list[str], tmp_path: Path, intake_sees_the_copy: bool
) -> None:
    settings = make_settings(queue={"work_beside": "on"})
    inbox = settings.paths.inbox
    service, jobs, first, b, gate = b_decoded_ahead(settings, service_factory, decoded)
    if not intake_sees_the_copy:
        service.intake.stop()  # the copy lands after the job is taken: only the job sees it
    copy = write_song(tmp_path / "b.wav", 2.0, seed=2)
    new_sha = sha256(copy)
    old = (inbox / "b.wav").stat()
    replaced = replace(inbox / "b.wav", copy, keep_time_of=inbox / "b.wav")
    assert (replaced.size, replaced.mtime_ns) == (old.st_size, old.st_mtime_ns)
    assert replaced.inode != old.st_ino
    if intake_sees_the_copy:  # "changed while queued": the job keeps its place...
        wait_for(lambda: jobs.latest[b].signature == replaced, 30, "the copy to be seen")
        # ...and the copy is decoded ahead in its turn, while "first" still separates
        wait_for(lambda: decoded.count(b) == 2, 60, "the copy decoded ahead")
        assert jobs.latest[first].state is JobState.SEPARATING
    gate.open()

    done = wait_for(lambda: jobs.latest[b].state.is_final and jobs.latest[b], 120, "b to end")
    assert done.state is JobState.DONE and done.error is None, done
    assert manifest_of(done.output)["input"]["sha256"] == new_sha
    assert sha256(settings.paths.processed / "b.wav") == new_sha
    assert not (inbox / "b.wav").exists()


def test_a_song_replaced_as_its_job_is_taken_is_separated_once_and_leaves_the_inbox(
    make_settings, service_factory, tmp_path: Path
) -> None:
    settings = make_settings()
    service, jobs = service_factory(settings)
    inbox = settings.paths.inbox
    (song,) = queue_paused(service, [lambda: write_song(inbox / "song.wav", 2.0, seed=1)])

    # hold the job between being taken and its first state write
    taken, release = threading.Event(), threading.Event()
    update = service.pipeline._update

    def held(job_id: str, **fields: Any):  # type: ignore[no-untyped-def]
        if job_id == song and not taken.is_set():
            taken.set()
            release.wait(60)
        return update(job_id, **fields)

    service.pipeline._update = held
    service.scheduler.start()
    assert taken.wait(30), "the job was not taken"
    assert jobs.latest[song].state is JobState.QUEUED
    new = write_song(tmp_path / "song.wav", 3.0, seed=2)
    new_sha = sha256(new)
    replaced = replace(inbox / "song.wav", new)
    # the intake records the new version on the job it still sees queued
    wait_for(lambda: jobs.latest[song].signature == replaced, 30, "the new version to be seen")
    release.set()

    done = wait_for(
        lambda: jobs.latest[song].state.is_final and jobs.latest[song], 120, "the job to end"
    )
    # the new version was separated: that is the one the job checks after publishing
    assert done.state is JobState.DONE and done.error is None, done
    manifest = manifest_of(done.output)
    assert manifest["input"]["sha256"] == new_sha and round(manifest["input"]["duration"]) == 3
    assert sha256(settings.paths.processed / "song.wav") == new_sha
    assert not (inbox / "song.wav").exists()
    assert len(jobs.jobs()) == 1


def test_a_song_overwritten_in_place_by_cp_p_is_not_published_with_the_old_audio(
    make_settings, service_factory, decoded: list[str], tmp_path: Path
) -> None:
    """`cp -p new.wav inbox/b.wav` onto the file that is there writes into the same inode and
    sets the old modification time back: size, time and inode all stay, and nothing but
    the file's change time (ctime) says it is another song."""
    settings = make_settings(queue={"work_beside": "on"})
    inbox = settings.paths.inbox
    service, jobs, first, b, gate = b_decoded_ahead(settings, service_factory, decoded)
    copy = write_song(tmp_path / "b.wav", 2.0, seed=2)
    new_sha = sha256(copy)
    old = (inbox / "b.wav").stat()
    with open(inbox / "b.wav", "r+b") as handle:  # what `cp -p` does onto an existing file
        handle.write(copy.read_bytes())
        handle.truncate()
    os.utime(inbox / "b.wav", ns=(old.st_atime_ns, old.st_mtime_ns))
    assert FileSignature.of((inbox / "b.wav").stat()) == FileSignature.of(old)
    gate.open()

    done = wait_for(lambda: jobs.latest[b].state.is_final and jobs.latest[b], 120, "b to end")
    assert done.state is JobState.DONE and done.error is None, done
    assert manifest_of(done.output)["input"]["sha256"] == new_sha
    assert sha256(settings.paths.processed / "b.wav") == new_sha
