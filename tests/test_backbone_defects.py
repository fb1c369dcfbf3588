"""Regression tests for defects found in the backbone from the outside (issue: "Eight defects
in the backbone"). Each is named after what the user saw; where a crash must land between two
steps, the state it leaves on disk is built directly, never reached by sleeping."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import threading
from pathlib import Path, PurePosixPath

import pytest

from stemdeck_watch.cli import main as cli
from stemdeck_watch.core.config import Settings, default_toml, settings_from_dict
from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.core.jobs import FileSignature, JobState
from stemdeck_watch.core.paths import move_file
from stemdeck_watch.stages.quarantine import quarantine
from stemdeck_watch.store.registry import REGISTRY_FILE
from stemdeck_watch.engine.scheduler import CHANGED_WHILE_RUNNING, PAUSE_RESTORE
from stemdeck_watch.util.synth import write_song

from conftest import add_job, open_scheduler, run_restore, wait_for, write_config


def drop(settings: Settings, name: str) -> tuple[Path, FileSignature]:
    path = settings.paths.inbox / name
    path.write_bytes(b"RIFF....WAVE" + name.encode())
    return path, FileSignature.of(path.stat())


# 1 ---------------------------------------------------------------------------------------------

def test_a_new_file_starts_a_restored_queue_even_when_the_lane_is_full(settings: Settings) -> None:
    data = default_toml()
    data["folders"] = {n: str(getattr(settings.paths, n)) for n in
                       ("inbox", "outbox", "processed", "failed", "state")}
    data["queue"]["max_pending_files"] = 2
    small = settings_from_dict(data)
    scheduler = open_scheduler(small)
    for name in ("a", "b"):
        add_job(scheduler, small, name, JobState.QUEUED)
    scheduler.registry.close()

    scheduler, restored = run_restore(small)
    assert restored == 2 and scheduler.queue.pause_reason == PAUSE_RESTORE
    path, sig = drop(small, "new.wav")
    assert scheduler.submit_file(path, PurePosixPath("new.wav"), sig) is None  # lane full
    assert scheduler.waiting() == [str(path)]
    assert not scheduler.queue.paused  # the restored songs run; the new one waits its turn
    scheduler.registry.close()


# 2 and 3 ---------------------------------------------------------------------------------------

def replace_atomically(path: Path, seconds: float, seed: int, scratch: Path) -> None:
    """Save a new version the way editors and sync clients do: a new file renamed over."""
    tmp = scratch / ("new-" + path.name)
    write_song(tmp, seconds, seed=seed)
    os.replace(tmp, path)


@pytest.mark.slow
def test_a_new_version_saved_while_its_job_fails_stays_in_the_inbox_and_is_separated(
        make_settings, service_factory, tmp_path: Path) -> None:
    settings = make_settings(watch={"rescan_seconds": 0}, separation={"shifts": 4})
    service, jobs = service_factory(settings)
    song = settings.paths.inbox / "song.wav"
    write_song(song, 12.0, seed=1)
    first = wait_for(lambda: next((j for j in jobs.jobs()
                                   if j.state is JobState.SEPARATING and j.progress > 0.06),
                                  None), 60, "the song to be separating")
    replace_atomically(song, 3.0, seed=2, scratch=tmp_path)
    os.kill(service.client.pid, signal.SIGKILL)  # the old version's job fails

    wait_for(lambda: jobs.latest.get(first.id) and jobs.latest[first.id].state.is_final, 60,
             "the first job to fail")
    failed = jobs.latest[first.id]
    assert failed.state is JobState.FAILED
    assert not (settings.paths.failed / "song.wav").exists()  # the new version was not moved
    report = (settings.paths.failed / "song.wav.error.txt").read_text()
    assert "replaced by a new version" in report and "stays in the inbox" in report
    # the new version is separated as a new job at once (no rescan is configured)
    done = wait_for(lambda: [j for j in jobs.final() if j.state is JobState.DONE], 60,
                    "the new version to be separated")
    assert done[0].id != first.id
    manifest = json.loads((Path(done[0].output) / "stemdeck.json").read_text())
    assert abs(manifest["input"]["duration"] - 3.0) < 0.01
    assert (settings.paths.processed / "song.wav").is_file()


@pytest.mark.slow
def test_a_file_changed_while_its_job_runs_is_separated_again_without_a_rescan(
        make_settings, service_factory, tmp_path: Path) -> None:
    settings = make_settings(watch={"rescan_seconds": 0}, separation={"shifts": 3})
    service, jobs = service_factory(settings)
    song = settings.paths.inbox / "song.wav"
    write_song(song, 8.0, seed=1)
    first = wait_for(lambda: next((j for j in jobs.jobs() if j.state is JobState.SEPARATING),
                                  None), 60, "the song to be separating")
    replace_atomically(song, 2.0, seed=2, scratch=tmp_path)

    finished = jobs.wait_final(2, timeout=120)
    by_id = {j.id: j for j in finished}
    # design §1: changed while running, the run is cancelled and the new content queued
    assert by_id[first.id].state is JobState.CANCELLED
    assert by_id[first.id].error == CHANGED_WHILE_RUNNING
    second = next(j for j in finished if j.id != first.id)
    assert second.state is JobState.DONE
    manifest = json.loads((Path(second.output) / "stemdeck.json").read_text())
    assert round(manifest["input"]["duration"]) == 2


# 4 ---------------------------------------------------------------------------------------------

def test_a_file_deleted_while_it_is_being_admitted_leaves_no_job_and_no_report(
        settings: Settings) -> None:
    scheduler = open_scheduler(settings)
    path, sig = drop(settings, "song.wav")
    assert scheduler.wants(path, sig)  # the intake decided to admit it…
    path.unlink()  # …the user deleted it, and the delete event found no job to cancel
    scheduler.file_gone(path)
    assert scheduler.submit_file(path, PurePosixPath("song.wav"), sig) is None
    assert scheduler.registry.jobs() == [] and scheduler.queue.order() == []
    assert list(settings.paths.failed.iterdir()) == []
    scheduler.registry.close()


# 5 ---------------------------------------------------------------------------------------------

def published_folder(folder: Path, job_id: str) -> None:
    folder.mkdir()
    (folder / "vocals.wav").write_bytes(b"x")
    (folder / "stemdeck.json").write_text(json.dumps(
        {"job_id": job_id, "stems": [{"file": "vocals.wav"}]}))


def test_a_song_published_to_a_numbered_folder_is_not_separated_again_when_the_first_is_gone(
        settings: Settings) -> None:
    scheduler = open_scheduler(settings)
    job = add_job(scheduler, settings, "song", JobState.PUBLISHING)
    # it published to "song (2)" because "song" existed; then "song" was moved away
    published_folder(settings.paths.outbox / "song (2)", job.id)
    scheduler.registry.close()

    scheduler, restored = run_restore(settings)
    done = scheduler.registry.get(job.id)
    assert restored == 0 and done.state is JobState.DONE
    assert done.output == str(settings.paths.outbox / "song (2)")
    scheduler.registry.close()


# 6 ---------------------------------------------------------------------------------------------

def test_a_move_cut_off_after_the_hard_link_is_finished_not_duplicated(settings: Settings) -> None:
    scheduler = open_scheduler(settings)
    job = add_job(scheduler, settings, "song", JobState.PUBLISHING)
    published_folder(settings.paths.outbox / "song", job.id)
    os.link(job.source, settings.paths.processed / "song.wav")  # crash before the unlink
    scheduler.registry.close()

    scheduler, _ = run_restore(settings)
    assert scheduler.registry.get(job.id).state is JobState.DONE
    assert sorted(p.name for p in settings.paths.processed.iterdir()) == ["song.wav"]
    assert not Path(job.source).exists()
    scheduler.registry.close()


def test_a_copy_cut_off_before_the_source_was_removed_is_finished(tmp_path: Path) -> None:
    src, dst = tmp_path / "inbox" / "song.wav", tmp_path / "failed" / "song.wav"
    src.parent.mkdir()
    dst.parent.mkdir()
    src.write_bytes(b"audio" * 1000)
    shutil.copy2(src, dst)  # what the cross-filesystem move had done when the power went
    assert move_file(src, dst) == dst
    assert not src.exists() and sorted(p.name for p in dst.parent.iterdir()) == ["song.wav"]
    other = tmp_path / "inbox" / "song.wav"
    other.write_bytes(b"other" * 1000)  # same name, other content: a new number
    assert move_file(other, dst) == dst.with_name("song (2).wav")


# 7 ---------------------------------------------------------------------------------------------

def test_a_retried_file_that_fails_again_gets_a_fresh_report_beside_it(settings: Settings) -> None:
    scheduler = open_scheduler(settings)
    job = add_job(scheduler, settings, "song", JobState.SEPARATING)
    first = quarantine(job, settings.paths.failed, stage="decoding", message="first failure")
    assert first == settings.paths.failed / "song.wav"
    # the user moves it back into the inbox, as the report says, and it fails again
    shutil.move(first, job.source)
    again = add_job(scheduler, settings, "song2", JobState.SEPARATING)
    again = scheduler.registry.update(again.id, source=job.source, rel_path="song.wav",
                                      signature=FileSignature.of(os.stat(job.source)))
    second = quarantine(again, settings.paths.failed, stage="decoding", message="second failure")
    assert second == settings.paths.failed / "song (2).wav"
    report = settings.paths.failed / "song (2).wav.error.txt"
    assert "second failure" in report.read_text()
    assert "first failure" in (settings.paths.failed / "song.wav.error.txt").read_text()
    scheduler.registry.close()


# 8 ---------------------------------------------------------------------------------------------

@pytest.fixture
def config_file(tmp_path: Path, model_repo: Path) -> Path:
    return write_config(tmp_path, model_repo)


def test_status_of_a_registry_created_a_moment_ago_says_no_jobs(settings, config_file, capsys):
    sqlite3.connect(settings.paths.state / REGISTRY_FILE).close()  # file there, no tables yet
    assert cli.main(["--config", str(config_file), "status"]) == 0
    out = capsys.readouterr().out
    assert "queued:  0" in out and "Traceback" not in out
    assert cli.main(["--config", str(config_file), "status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["jobs"] == []


def test_status_of_a_damaged_registry_names_the_file_and_what_to_do(settings, config_file,
                                                                     capsys):
    path = settings.paths.state / REGISTRY_FILE
    path.write_bytes(b"this is not a database, it was cut off by a disk error" * 100)
    assert cli.main(["--config", str(config_file), "status"]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and "damaged" in err and "move it aside" in err
    assert "Traceback" not in err


# suspected: a cancel and the next job -----------------------------------------------------------

def test_the_job_that_was_cancelled_cannot_hand_on_a_worker_that_is_still_being_stopped() -> None:
    control = JobControl("a")
    killing, release, order = threading.Event(), threading.Event(), []

    def slow_kill() -> None:  # stopping a worker takes a moment
        killing.set()
        release.wait(10)
        order.append("worker stopped")

    def pipeline_step() -> None:
        with control.registered(slow_kill):
            killing.wait(10)
        order.append("step left")  # from here the dispatcher would take the next job

    step = threading.Thread(target=pipeline_step)
    step.start()
    canceller = threading.Thread(target=control.cancel, args=("removed",))
    canceller.start()
    step.join(0.5)  # without the fix the step leaves at once, before the worker is stopped
    release.set()
    step.join(10)
    canceller.join(10)
    assert order == ["worker stopped", "step left"]


# suspected: a crash after the move to failed/ but before the registry heard of it ---------------

def test_a_job_quarantined_just_before_a_crash_is_failed_with_its_report(settings) -> None:
    scheduler = open_scheduler(settings)
    job = add_job(scheduler, settings, "song", JobState.SEPARATING)
    scheduler.registry.update(job.id, error="the separation worker stopped unexpectedly",
                              stage="separating")  # recorded before the move
    os.replace(job.source, settings.paths.failed / "song.wav")  # moved; then the power went
    scheduler.registry.close()

    scheduler, restored = run_restore(settings)
    failed = scheduler.registry.get(job.id)
    assert restored == 0 and failed.state is JobState.FAILED
    assert failed.source == str(settings.paths.failed / "song.wav")
    report = (settings.paths.failed / "song.wav.error.txt").read_text()
    assert "the separation worker stopped unexpectedly" in report
    scheduler.registry.close()


# found by the stress test: a song taken away just as its job starts --------------------------

@pytest.mark.slow
def test_a_song_taken_away_as_its_job_starts_is_cancelled_not_quarantined(make_settings,
                                                                          service_factory):
    settings = make_settings()
    service, jobs = service_factory(settings)
    service.scheduler.pause("user")
    song = write_song(settings.paths.inbox / "song.wav", 2.0)
    wait_for(lambda: service.queue.order(), 30, "the song queued")
    service.intake.stop()  # its delete event is late (a `mv` out is reported ~0.5 s later)
    song.unlink()
    service.scheduler.start()
    job = jobs.wait_final(1)[0]
    assert job.state is JobState.CANCELLED and job.error == "the input was removed from the inbox"
    assert list(settings.paths.failed.iterdir()) == []
