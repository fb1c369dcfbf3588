"""The registry on disk, and what a restart makes of the jobs the last run left behind."""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath


from stemdeck_watch.core.config import Settings, default_toml, settings_from_dict
from stemdeck_watch.core.jobs import FileSignature, Job, JobKind, JobState
from stemdeck_watch.store.registry import Registry
from stemdeck_watch.engine.scheduler import PAUSE_RESTORE, PAUSE_USER

from support.helpers import add_job, open_scheduler, run_restore


def test_registry_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    registry = Registry.open(path)
    job = registry.add(
        Job(
            id="a",
            name="a",
            kind=JobKind.FILE,
            state=JobState.QUEUED,
            source="/x/a.wav",
            rel_path="a.wav",
            signature=FileSignature(1, 2, 3),
        )
    )
    updated = registry.update("a", state=JobState.SEPARATING, progress=0.5)
    assert updated.version == job.version + 1 and updated.progress == 0.5
    registry.save_order(["a"])
    registry.set_meta("pause_reason", "user")
    registry.close()
    again = Registry.open_readonly(path)
    assert again is not None
    assert again.get("a") == updated
    assert again.latest_for_source("/x/a.wav").signature == FileSignature(1, 2, 3)
    assert again.get_meta("pause_reason") == "user"
    again.close()
    assert Registry.open_readonly(tmp_path / "missing.sqlite3") is None


def test_a_job_published_before_the_crash_is_done_not_separated_again(settings: Settings) -> None:
    scheduler = open_scheduler(settings)
    job = add_job(scheduler, settings, "song", JobState.PUBLISHING)
    (settings.paths.outbox / "song").mkdir()  # someone else's song of the same name
    folder = settings.paths.outbox / "song (2)"
    folder.mkdir()
    (folder / "vocals.wav").write_bytes(b"x")
    (folder / "stemdeck.json").write_text(
        json.dumps({"job_id": job.id, "stems": [{"file": "vocals.wav"}]})
    )
    scheduler.registry.close()

    scheduler, restored = run_restore(settings)
    done = scheduler.registry.get(job.id)
    assert restored == 0
    assert done.state is JobState.DONE and done.output == str(folder)
    assert (settings.paths.processed / "song.wav").exists()
    assert not (settings.paths.inbox / "song.wav").exists()
    scheduler.registry.close()


def test_a_job_cut_off_half_way_goes_back_to_the_head_paused(settings: Settings) -> None:
    scheduler = open_scheduler(settings)
    waiting = add_job(scheduler, settings, "waiting", JobState.QUEUED)
    cut = add_job(scheduler, settings, "cut", JobState.SEPARATING)
    scheduler.registry.save_order([waiting.id])
    partial = settings.paths.staging / cut.id
    partial.mkdir(parents=True)
    (partial / "drums.wav").write_bytes(b"half")
    scratch = settings.paths.scratch / cut.id
    scratch.mkdir(parents=True)
    scheduler.registry.close()

    scheduler, restored = run_restore(settings)
    assert restored == 2
    assert scheduler.queue.order() == [cut.id, waiting.id]
    job = scheduler.registry.get(cut.id)
    assert job.state is JobState.QUEUED and job.attempts == 1  # counted before it runs again
    assert not partial.exists() and not scratch.exists()
    assert scheduler.queue.paused and scheduler.queue.pause_reason == PAUSE_RESTORE
    # a new file lifts the restore pause
    new = settings.paths.inbox / "new.wav"
    new.write_bytes(b"x")
    scheduler.submit_file(new, PurePosixPath("new.wav"), FileSignature.of(new.stat()))
    assert not scheduler.queue.paused
    scheduler.registry.close()


def test_a_job_cut_off_twice_fails_with_instructions(settings: Settings) -> None:
    scheduler = open_scheduler(settings)
    job = add_job(scheduler, settings, "crasher", JobState.SEPARATING, attempts=1)
    scheduler.registry.close()

    scheduler, restored = run_restore(settings)
    failed = scheduler.registry.get(job.id)
    assert restored == 0 and failed.state is JobState.FAILED
    assert "interrupted by a restart twice — drop the file again to retry" in failed.error
    assert (settings.paths.failed / "crasher.wav").exists()
    report = (settings.paths.failed / "crasher.wav.error.txt").read_text()
    assert "interrupted by a restart twice" in report
    assert not scheduler.queue.paused
    scheduler.registry.close()


def test_jobs_whose_input_vanished_while_stopped_are_cancelled(settings: Settings) -> None:
    scheduler = open_scheduler(settings)
    gone = add_job(scheduler, settings, "gone", JobState.QUEUED)
    Path(gone.source).unlink()
    scheduler.registry.close()
    scheduler, restored = run_restore(settings)
    assert restored == 0
    assert scheduler.registry.get(gone.id).state is JobState.CANCELLED
    scheduler.registry.close()


def test_a_pause_the_user_chose_survives_a_restart(settings: Settings) -> None:
    scheduler = open_scheduler(settings)
    scheduler.pause(PAUSE_USER)
    scheduler.registry.close()
    scheduler, _ = run_restore(settings)
    assert scheduler.queue.paused and scheduler.queue.pause_reason == PAUSE_USER
    new = settings.paths.inbox / "new.wav"
    new.write_bytes(b"x")
    scheduler.submit_file(new, PurePosixPath("new.wav"), FileSignature.of(new.stat()))
    assert scheduler.queue.paused  # only the user's Start lifts the user's pause
    scheduler.registry.close()


def test_capacity_lane_holds_files_back_in_arrival_order(
    settings: Settings, tmp_path: Path
) -> None:
    data = default_toml()
    data["folders"] = {
        n: str(getattr(settings.paths, n))
        for n in ("inbox", "outbox", "processed", "failed", "state")
    }
    data["queue"]["max_pending_files"] = 2
    small = settings_from_dict(data)
    scheduler = open_scheduler(small)
    jobs = []
    for name in ("a", "b", "c", "d"):
        path = small.paths.inbox / f"{name}.wav"
        path.write_bytes(b"x")
        jobs.append(
            scheduler.submit_file(path, PurePosixPath(path.name), FileSignature.of(path.stat()))
        )
    assert [j is not None for j in jobs] == [True, True, False, False]
    assert [Path(s).name for s in scheduler.waiting()] == ["c.wav", "d.wav"]
    assert [Path(s).name for s, _, _ in scheduler.registry.waiting()] == ["c.wav", "d.wav"]
    control = scheduler.next_job(timeout=0)  # a job leaves the queue: room for one more
    assert control is not None
    assert [Path(s).name for s in scheduler.waiting()] == ["d.wav"]
    names = [scheduler.registry.get(i).name for i in scheduler.queue.order()]
    assert names == ["b", "c"]
    scheduler.registry.close()


def test_files_held_back_before_a_restart_are_admitted_after_it(settings: Settings) -> None:
    scheduler = open_scheduler(settings)
    held = settings.paths.inbox / "held.wav"
    held.write_bytes(b"x")
    scheduler.registry.save_waiting([(str(held), JobKind.FILE, 1.0)])
    scheduler.registry.close()
    scheduler = open_scheduler(settings)  # what Service.start does after restore
    assert scheduler.waiting() == [str(held)]
    scheduler.admit_waiting()
    assert scheduler.waiting() == []
    assert [scheduler.registry.get(i).name for i in scheduler.queue.order()] == ["held"]
    scheduler.registry.close()


def test_a_registry_from_the_first_release_gains_the_new_columns(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE jobs (id TEXT PRIMARY KEY, name TEXT NOT NULL, kind TEXT NOT NULL,
            state TEXT NOT NULL, source TEXT NOT NULL, rel_path TEXT NOT NULL, preset TEXT,
            progress REAL NOT NULL DEFAULT 0, output TEXT, error TEXT, stage TEXT, size INTEGER,
            mtime_ns INTEGER, inode INTEGER, attempts INTEGER NOT NULL DEFAULT 0,
            position INTEGER, created_at REAL NOT NULL, updated_at REAL NOT NULL,
            finished_at REAL, version INTEGER NOT NULL DEFAULT 0);
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);
        CREATE TABLE waiting (source TEXT PRIMARY KEY, kind TEXT NOT NULL, since REAL NOT NULL);
        INSERT INTO jobs (id, name, kind, state, source, rel_path, created_at, updated_at)
            VALUES ('old', 'song', 'file', 'done', '/x/song.wav', 'song.wav', 1, 1);
        PRAGMA user_version = 1;
    """)
    db.close()
    registry = Registry.open(path)
    job = registry.get("old")
    assert job is not None and job.state is JobState.DONE and job.sha256 is None
    registry.update("old", sha256="ab", settings_key="cd")
    assert [j.id for j in registry.done_with("ab", "cd")] == ["old"]
    registry.close()


def test_a_crash_after_the_input_moved_but_before_done_was_stored(settings: Settings) -> None:
    scheduler = open_scheduler(settings)
    job = add_job(scheduler, settings, "song", JobState.PUBLISHING)
    folder = settings.paths.outbox / "song"
    folder.mkdir()
    (folder / "vocals.wav").write_bytes(b"x")
    (folder / "stemdeck.json").write_text(
        json.dumps({"job_id": job.id, "stems": [{"file": "vocals.wav"}]})
    )
    Path(job.source).rename(settings.paths.processed / "song.wav")  # moved; then the crash
    scheduler.registry.close()

    scheduler, restored = run_restore(settings)
    done = scheduler.registry.get(job.id)
    assert restored == 0 and done.state is JobState.DONE
    assert done.source == str(settings.paths.processed / "song.wav")  # where it really is
    scheduler.registry.close()


def drop(settings: Settings, name: str) -> tuple[Path, FileSignature]:
    path = settings.paths.inbox / name
    path.write_bytes(b"RIFF....WAVE" + name.encode())
    return path, FileSignature.of(path.stat())


def test_a_new_file_starts_a_restored_queue_even_when_the_lane_is_full(settings: Settings) -> None:
    data = default_toml()
    data["folders"] = {
        n: str(getattr(settings.paths, n))
        for n in ("inbox", "outbox", "processed", "failed", "state")
    }
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


def published_folder(folder: Path, job_id: str) -> None:
    folder.mkdir()
    (folder / "vocals.wav").write_bytes(b"x")
    (folder / "stemdeck.json").write_text(
        json.dumps({"job_id": job_id, "stems": [{"file": "vocals.wav"}]})
    )


def test_a_song_published_to_a_numbered_folder_is_not_separated_again_when_the_first_is_gone(
    settings: Settings,
) -> None:
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


def test_a_job_quarantined_just_before_a_crash_is_failed_with_its_report(settings) -> None:
    scheduler = open_scheduler(settings)
    job = add_job(scheduler, settings, "song", JobState.SEPARATING)
    scheduler.registry.update(
        job.id, error="the separation worker stopped unexpectedly", stage="separating"
    )  # recorded before the move
    os.replace(job.source, settings.paths.failed / "song.wav")  # moved; then the power went
    scheduler.registry.close()

    scheduler, restored = run_restore(settings)
    failed = scheduler.registry.get(job.id)
    assert restored == 0 and failed.state is JobState.FAILED
    assert failed.source == str(settings.paths.failed / "song.wav")
    report = (settings.paths.failed / "song.wav.error.txt").read_text()
    assert "the separation worker stopped unexpectedly" in report
    scheduler.registry.close()
