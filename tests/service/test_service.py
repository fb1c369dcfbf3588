"""The whole path as a user meets it: real folders, real watchdog, the real worker process."""

from __future__ import annotations

import io
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile

from stemdeck_watch.core.events import JobSeparated
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.util.synth import song, write_song

from support.helpers import outbox_entries, wait_for, write_paced

pytestmark = pytest.mark.slow
SR = 44100


def stem_frames(folder: Path) -> dict[str, int]:
    return {p.stem: soundfile.info(p).frames for p in folder.glob("*.wav")}


def test_three_songs_dropped_at_once_become_stems_in_one_worker(
    make_settings, service_factory, tmp_path
):
    settings = make_settings()
    service, jobs = service_factory(settings)
    pids: list[int] = []
    service.bus.subscribe(JobSeparated, lambda e: pids.append(e.worker_pid))
    lengths = {"alpha.wav": 3.0, "beta.flac": 2.5, "gamma.mp3": 2.0}
    staging = tmp_path / "elsewhere"
    for i, (name, seconds) in enumerate(lengths.items()):
        write_song(staging / name, seconds, seed=i)
    for name in lengths:
        shutil.copy(staging / name, settings.paths.inbox / name)

    finished = jobs.wait_final(3)
    assert sorted(j.state for j in finished) == [JobState.DONE] * 3
    for name, seconds in lengths.items():
        folder = settings.paths.outbox / Path(name).stem
        frames = stem_frames(folder)
        assert sorted(frames) == ["bass", "drums", "other", "vocals"]
        for stem, count in frames.items():
            assert abs(count - int(seconds * SR)) <= 1, (name, stem, count)
        assert (folder / "stemdeck.json").is_file()
        assert (settings.paths.processed / name).is_file()
        assert not (settings.paths.inbox / name).exists()
    assert len(pids) == 3 and len(set(pids)) == 1  # one resident worker served all three
    assert not any(settings.paths.staging.glob("*"))


def test_a_slow_writer_becomes_exactly_one_complete_job(make_settings, service_factory):
    settings = make_settings(watch={"settle_seconds": 1.0})
    service, jobs = service_factory(settings)
    audio = song(4.0)
    target = settings.paths.inbox / "slow.wav"
    reopening = settings.paths.inbox / "reopened.wav"

    def chunks_of(seed: int) -> list[bytes]:  # two different songs: the same one is a duplicate
        buffer = io.BytesIO()
        soundfile.write(buffer, song(4.0, seed=seed), SR, subtype="PCM_16", format="WAV")
        data = buffer.getvalue()
        step = len(data) // 12 + 1
        return [data[i : i + step] for i in range(0, len(data), step)]

    # written over ~3.5 s, once through one open file and once reopening it for every chunk
    writers = [
        threading.Thread(target=write_paced, args=(target, chunks_of(0), 0.3, False)),
        threading.Thread(target=write_paced, args=(reopening, chunks_of(1), 0.3, True)),
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    finished = jobs.wait_final(2)
    assert len(jobs.jobs()) == 2
    assert [j.state for j in finished] == [JobState.DONE, JobState.DONE]
    for name in ("slow", "reopened"):
        frames = stem_frames(settings.paths.outbox / name)
        assert set(frames.values()) == {len(audio)}


def test_bad_inputs_end_in_failed_with_a_reason_and_the_service_goes_on(
    make_settings, service_factory, tmp_path
):
    settings = make_settings()
    service, jobs = service_factory(settings)
    inbox, failed = settings.paths.inbox, settings.paths.failed
    good = write_song(tmp_path / "good.flac", 2.0)
    truncated = write_song(tmp_path / "truncated.wav", 3.0)
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    cut_flac = write_song(tmp_path / "cut.flac", 3.0)
    cut_flac.write_bytes(cut_flac.read_bytes()[: cut_flac.stat().st_size // 2])
    one = tmp_path / "one.wav"
    soundfile.write(one, np.zeros((1, 2), np.float32), SR)
    bad = {
        "noise.mp3": os.urandom(30_000),
        "notes.wav": b"these are my lyrics\n" * 100,
        "truncated.wav": truncated.read_bytes(),
        "cut.flac": cut_flac.read_bytes(),
        "one.wav": one.read_bytes(),
    }
    for name, data in bad.items():
        (inbox / name).write_bytes(data)
    (inbox / "download.mp3").touch()  # a browser's placeholder: unfinished, not bad
    shutil.copy(good, inbox / "good.flac")

    finished = jobs.wait_final(len(bad) + 1)
    states = {Path(j.rel_path).name: j.state for j in finished}
    assert states.pop("good.flac") is JobState.DONE
    assert set(states.values()) == {JobState.FAILED}
    reasons = {
        "noise.mp3": "not an audio",
        "notes.wav": "not an audio",
        "truncated.wav": "truncated",
        "cut.flac": "cut.flac",
        "one.wav": "at least",
    }
    for name, reason in reasons.items():
        assert (failed / name).read_bytes() == bad[name]  # the input is kept, byte for byte
        report = (failed / f"{name}.error.txt").read_text()
        assert reason in report and "Stage:   decoding" in report and name in report
        assert not (inbox / name).exists()
    # the empty download is still waiting, never failed; once it lands it is separated
    assert (inbox / "download.mp3").exists() and not (failed / "download.mp3").exists()
    shutil.copy(write_song(tmp_path / "landed.mp3", 2.0), inbox / "download.mp3")
    later = jobs.wait_final(len(bad) + 2)
    assert any(j.rel_path == "download.mp3" and j.state is JobState.DONE for j in later)


def test_a_model_that_cannot_load_fails_the_job_not_the_service(
    make_settings, service_factory, tmp_path
):
    settings = make_settings(
        separation={"model": "htdemucs_ft"}, presets={"good": {"model": "tiny"}}
    )
    service, jobs = service_factory(settings)
    write_song(settings.paths.inbox / "first.wav", 2.0)
    failed = jobs.wait_final(1)[0]
    assert failed.state is JobState.FAILED and failed.stage == "separating"
    assert "htdemucs_ft" in failed.error and "separation.model_repo" in failed.error
    report = (settings.paths.failed / "first.wav.error.txt").read_text()
    assert "could not load model 'htdemucs_ft'" in report
    write_song(settings.paths.inbox / "good" / "second.wav", 2.0)  # preset folder
    done = wait_for(lambda: [j for j in jobs.final() if j.rel_path == "good/second.wav"], 60)[0]
    assert done.state is JobState.DONE and done.preset == "good"
    assert (settings.paths.outbox / "good" / "second" / "vocals.wav").is_file()
    assert "chosen by" not in failed.error  # the config's own model: nothing to point at
    # a model the drop chose: the error says where that choice was made
    write_song(settings.paths.inbox / "good" / "third [6s].wav", 2.0)
    tagged = wait_for(lambda: [j for j in jobs.final() if "third" in j.rel_path], 60)[0]
    assert tagged.state is JobState.FAILED and "could not load model 'htdemucs_6s'" in tagged.error
    assert "(separation.model = 'htdemucs_6s' was chosen by the name tag [6s])" in tagged.error


def test_removing_or_renaming_an_input_cancels_its_job(make_settings, service_factory, tmp_path):
    settings = make_settings()
    service, jobs = service_factory(settings)
    service.scheduler.pause("user")  # keep both queued while we act on them
    inbox = settings.paths.inbox
    write_song(inbox / "drop.wav", 2.0)
    write_song(inbox / "rename.wav", 2.0, seed=1)
    wait_for(lambda: len(service.queue.order()) == 2, 30, "two queued jobs")
    os.rename(inbox / "drop.wav", tmp_path / "drop.wav")  # moved out of the inbox
    os.rename(inbox / "rename.wav", inbox / "renamed.wav")
    wait_for(
        lambda: len([j for j in jobs.final() if j.state is JobState.CANCELLED]) == 2,
        30,
        "both jobs cancelled",
    )
    assert all(j.error == "the input was removed from the inbox" for j in jobs.final())
    wait_for(lambda: len(service.queue.order()) == 1, 30, "the renamed file queued")
    os.rename(tmp_path / "drop.wav", inbox / "drop.wav")  # dropped again, same file
    wait_for(lambda: len(service.queue.order()) == 2, 30, "the returned file queued again")
    service.scheduler.start()
    wait_for(
        lambda: len([j for j in jobs.final() if j.state is JobState.DONE]) == 2,
        60,
        "both separated",
    )
    assert outbox_entries(settings.paths.outbox) == {"renamed", "drop"}


def test_a_full_queue_holds_files_back_and_admits_them_in_order(make_settings, service_factory):
    settings = make_settings(queue={"max_pending_files": 1})
    service, jobs = service_factory(settings)
    service.scheduler.pause("user")
    for i, name in enumerate(("one", "two", "three")):
        write_song(settings.paths.inbox / f"{name}.wav", 1.5, seed=i)
        wait_for(
            lambda n=i: len(service.queue.order()) + len(service.scheduler.waiting()) > n,
            30,
            f"{name} seen",
        )
    assert len(service.queue.order()) == 1 and len(service.scheduler.waiting()) == 2
    service.scheduler.start()
    finished = jobs.wait_final(3)
    order = [j.name for j in sorted(finished, key=lambda j: j.finished_at)]
    assert order == ["one", "two", "three"]


def test_a_folder_moved_into_the_inbox_keeps_its_structure(
    make_settings, service_factory, tmp_path
):
    settings = make_settings()
    service, jobs = service_factory(settings)
    album = tmp_path / "Album Name"
    write_song(album / "01 Intro.wav", 1.5)
    write_song(album / "02 Song.mp3", 1.5, seed=1)
    (album / "cover.jpg").write_bytes(b"\xff\xd8")  # not audio: ignored
    os.rename(album, settings.paths.inbox / "Album Name")  # one event for the whole folder
    finished = jobs.wait_final(2)
    assert [j.state for j in finished] == [JobState.DONE, JobState.DONE]
    assert (settings.paths.outbox / "Album Name" / "01 Intro" / "vocals.wav").is_file()
    assert (settings.paths.outbox / "Album Name" / "02 Song" / "drums.wav").is_file()
    assert (settings.paths.processed / "Album Name" / "02 Song.mp3").is_file()
    assert (settings.paths.inbox / "Album Name" / "cover.jpg").is_file()


def test_polling_mode_finds_dropped_files(make_settings, service_factory):
    settings = make_settings(watch={"mode": "polling", "poll_interval": 0.2})
    service, jobs = service_factory(settings)
    assert service.intake.mode == "polling"
    write_song(settings.paths.inbox / "polled.flac", 1.5)
    assert jobs.wait_final(1)[0].state is JobState.DONE
    assert (settings.paths.outbox / "polled" / "bass.wav").is_file()


@pytest.mark.slow
def test_a_song_taken_away_as_its_job_starts_is_cancelled_not_quarantined(
    make_settings, service_factory
):
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


def test_a_beat_tracker_stuck_loading_never_holds_the_stop_up(
    make_settings, service_factory, monkeypatch, caplog
):
    """The beat tracker loads beside the model at start; one whose import hangs (a broken
    numba cache) is waited for a bounded time at the stop, said in the log."""
    from stemdeck_watch import service as service_module
    from stemdeck_watch.stages import songfolder

    stuck = threading.Event()
    monkeypatch.setattr(songfolder, "warm", lambda settings: stuck.wait(60))
    monkeypatch.setattr(service_module, "WARM_JOIN_SECONDS", 0.5)
    service, _ = service_factory(make_settings())
    try:
        done = threading.Event()
        threading.Thread(target=lambda: (service.shutdown(), done.set()), daemon=True).start()
        assert done.wait(30), "the stop waited for the stuck beat tracker"
        assert "the beat tracker was still loading" in caplog.text
    finally:
        stuck.set()
