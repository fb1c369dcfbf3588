"""Choices in the drop itself: a tag in the song's name or a sidecar file beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stemdeck_watch.core.choices import ChoiceError, name_choices, song_name
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.stages.manifest import read_manifest
from stemdeck_watch.util.synth import write_song


@pytest.mark.parametrize(
    "stem, name, chosen",
    [
        ("Song [6s]", "Song", {"model": "htdemucs_6s"}),
        ("Song [vocals, flac]", "Song", {"two_stems": "vocals", "format": "flac"}),
        ("Song [dj daw]", "Song", {"stem_file": True, "session": ["dawproject", "reaper"]}),
        ("Song [Live]", "Song [Live]", {}),  # capitals: part of the title
        ("Song [Official Video]", "Song [Official Video]", {}),
        ("song [live]", "song [live]", {}),  # nothing in it is or looks like a tag
        ("Song [vocals] (edit)", "Song [vocals] (edit)", {}),  # not at the end
        ("Song", "Song", {}),
    ],
)
def test_a_tag_group_at_the_end_of_the_name_chooses_settings(stem, name, chosen) -> None:
    assert song_name(stem) == name
    assert {k: v for k, (v, _origin) in name_choices(stem + ".mp3").items()} == chosen


@pytest.mark.parametrize(
    "filename, message",
    [
        (
            "Song [vocal].mp3",
            r"unknown tag \[vocal\] in the name 'Song \[vocal\].mp3' \(did you "
            r"mean \[vocals\]\?\); tags: \[6s\], \[ft\], \[vocals\]",
        ),
        ("Song [vocals drums].mp3", r"the tags \[vocals\] and \[drums\] .* both choose two_stems"),
        ("Song [flac 6x].mp3", r"unknown tag \[6x\] .*did you mean \[6s\]"),
    ],
)
def test_a_bad_tag_is_an_error_naming_it(filename, message) -> None:
    with pytest.raises(ChoiceError, match=message):
        name_choices(filename)


@pytest.mark.slow
def test_choices_in_the_drop_set_that_songs_settings_and_bad_ones_fail_it_naming_the_key(
    make_settings, service_factory, tmp_path: Path
) -> None:
    settings = make_settings(presets={"karaoke": {"two_stems": "vocals", "format": "flac"}})
    made = tmp_path / "made"
    for name in (
        "Tagged [vocals].wav",
        "Sided.wav",
        "Mixed [drums].wav",
        "Bad [vocal].wav",
        "Worse.wav",
    ):
        write_song(made / name, 1.5, seed=len(name))
    (made / "Sided.wav.stemdeck.toml").write_text(
        'format = "flac"\ntwo_stems = "bass"\ndevice = "cuda"\n'
    )
    (made / "Worse.wav.stemdeck.toml").write_text('modle = "htdemucs_6s"\n')
    _service, jobs = service_factory(settings)
    inbox = settings.paths.inbox
    # the sidecars first, as a person drops them together (a job reads its sidecar at start)
    for name in ("Sided.wav.stemdeck.toml", "Worse.wav.stemdeck.toml"):
        (made / name).replace(inbox / name)
    for name in ("Tagged [vocals].wav", "Sided.wav", "Bad [vocal].wav", "Worse.wav"):
        (made / name).replace(inbox / name)
    (inbox / "karaoke").mkdir(exist_ok=True)  # the service makes preset folders
    (made / "Mixed [drums].wav").replace(inbox / "karaoke" / "Mixed [drums].wav")
    done = {Path(j.source).name: j for j in jobs.wait_final(5, timeout=240)}
    outbox, processed, failed = (
        settings.paths.outbox,
        settings.paths.processed,
        settings.paths.failed,
    )

    tagged = read_manifest(outbox / "Tagged")  # published without its tag group
    assert [e["name"] for e in tagged["stems"]] == ["vocals", "no_vocals"]
    assert tagged["settings_from"]["separation.two_stems"] == "name tag [vocals]"
    assert tagged["settings_from"]["output.format"] == "config"
    assert (processed / "Tagged [vocals].wav").is_file()

    sided = read_manifest(outbox / "Sided")
    assert [e["file"] for e in sided["stems"]] == ["bass.flac", "no_bass.flac"]
    assert sided["settings_from"]["output.format"] == "sidecar Sided.wav.stemdeck.toml"
    # the device it asked for is recorded as asked; where it ran, as the worker said (the
    # tests' workers run on the CPU)
    assert sided["settings"]["separation"]["device"] == "cuda"
    assert sided["device"] == "cpu" and tagged["device"] == "cpu"
    assert (processed / "Sided.wav.stemdeck.toml").is_file()  # the choices go with the song
    assert not (inbox / "Sided.wav.stemdeck.toml").exists()

    mixed = read_manifest(outbox / "karaoke" / "Mixed")  # the tag is stronger than the preset
    assert [e["file"] for e in mixed["stems"]] == ["drums.flac", "no_drums.flac"]
    assert mixed["settings_from"]["separation.two_stems"] == "name tag [drums]"
    assert mixed["settings_from"]["output.format"] == "preset karaoke"

    bad = done["Bad [vocal].wav"]
    assert bad.state is JobState.FAILED
    assert "unknown tag [vocal]" in bad.error and "did you mean [vocals]" in bad.error
    assert (failed / "Bad [vocal].wav").is_file()
    worse = done["Worse.wav"]
    assert worse.state is JobState.FAILED
    assert worse.error.startswith("Worse.wav.stemdeck.toml: unknown key modle")
    assert "did you mean 'model'" in worse.error
    assert (failed / "Worse.wav").is_file() and (failed / "Worse.wav.stemdeck.toml").is_file()
    assert "modle" in (failed / "Worse.wav.error.txt").read_text()

    # fixed where it failed, as the report says, and retried: the choices come back with it
    (failed / "Worse.wav.stemdeck.toml").write_text('format = "flac"\n')
    _service.scheduler.retry(worse.id)
    again = next(
        j for j in jobs.wait_final(6, timeout=120) if j.id not in {x.id for x in done.values()}
    )
    assert again.state is JobState.DONE, again.error
    retried = read_manifest(outbox / "Worse")
    assert retried["settings_from"]["output.format"] == "sidecar Worse.wav.stemdeck.toml"
    assert not (failed / "Worse.wav.stemdeck.toml").exists()


def test_a_sidecar_cannot_choose_where_models_load_from(settings, tmp_path: Path) -> None:
    """A file in the inbox may choose a song's settings, never a folder of model files (the
    worker loads them as code) or the hub they come from."""
    from stemdeck_watch.core.choices import for_job
    from stemdeck_watch.core.jobs import Job, JobKind

    song = write_song(settings.paths.inbox / "Song.wav", 0.5)
    job = Job(
        id="j",
        name="Song",
        kind=JobKind.FILE,
        state=JobState.QUEUED,
        source=str(song),
        rel_path="Song.wav",
    )
    sidecar = Path(f"{song}.stemdeck.toml")
    for line in (f'model_repo = "{tmp_path}"\n', 'model_hub = "https://example.invalid/"\n'):
        sidecar.write_text(line)
        with pytest.raises(ChoiceError) as caught:
            for_job(settings, job)
        key = line.split(" ")[0]
        assert f"Song.wav.stemdeck.toml: {key} cannot be chosen by a file in the inbox" in str(
            caught.value
        )
    sidecar.write_text('format = "flac"\n')  # what a song's own settings are stays open
    assert for_job(settings, job).output.format == "flac"


# ------------------------------------------------------------------ a sidecar and its song's moves


def _published(settings: Any, job: Any, sidecar: str | None) -> Path:
    """A song folder as the job published it, its manifest naming the sidecar it used."""
    import hashlib
    import json

    output = settings.paths.outbox / job.name
    output.mkdir()
    (output / "vocals.wav").write_bytes(b"")
    manifest = {
        "job_id": job.id,
        "stems": [{"file": "vocals.wav"}],
        "settings_from": {"output.format": "config"},
        "sidecar": (
            {
                "file": f"{job.name}.wav.stemdeck.toml",
                "sha256": hashlib.sha256(sidecar.encode()).hexdigest(),
            }
            if sidecar is not None
            else None
        ),
    }
    (output / "stemdeck.json").write_text(json.dumps(manifest))
    return output


def test_a_sidecar_that_came_after_its_song_started_stays_in_the_inbox_saying_so(
    settings: Any,
) -> None:
    """The song was separated without it: moving it into processed/ beside the song would
    say it was used. It stays where a song dropped again beside it is separated with it; the
    job's note and the log say why. A sidecar the song did use goes with it."""
    from stemdeck_watch.engine.pipeline import Pipeline
    from stemdeck_watch.workers.local import WorkerClient

    from support.helpers import add_job, open_scheduler

    scheduler = open_scheduler(settings)
    try:
        pipeline = Pipeline(settings, WorkerClient(), scheduler.bus, scheduler.update)
        inbox, processed = settings.paths.inbox, settings.paths.processed
        late = add_job(scheduler, settings, "late", JobState.PUBLISHING)
        output = _published(settings, late, None)
        (inbox / "late.wav.stemdeck.toml").write_text('format = "flac"\n')  # came meanwhile
        done = pipeline.file_input(late, Path(late.source), output)
        assert done.state is JobState.DONE and (processed / "late.wav").is_file()
        assert (inbox / "late.wav.stemdeck.toml").is_file()
        assert not (processed / "late.wav.stemdeck.toml").exists()
        assert "late.wav.stemdeck.toml arrived after the song started" in (done.error or "")

        edited = add_job(scheduler, settings, "edited", JobState.PUBLISHING)
        output = _published(settings, edited, 'format = "mp3"\n')
        (inbox / "edited.wav.stemdeck.toml").write_text('format = "flac"\n')  # changed since
        done = pipeline.file_input(edited, Path(edited.source), output)
        assert (inbox / "edited.wav.stemdeck.toml").is_file()
        assert "edited.wav.stemdeck.toml changed after the song started" in (done.error or "")

        used = add_job(scheduler, settings, "used", JobState.PUBLISHING)
        output = _published(settings, used, 'format = "flac"\n')
        (inbox / "used.wav.stemdeck.toml").write_text('format = "flac"\n')
        done = pipeline.file_input(used, Path(used.source), output)
        assert done.error is None and (processed / "used.wav.stemdeck.toml").is_file()
    finally:
        scheduler.registry.close()


def test_a_sidecar_never_lands_under_a_numbered_name_of_its_own(settings: Any) -> None:
    """`b.wav.stemdeck (2).toml` is no song's sidecar. A song goes where its sidecar's name
    is free too (processed/, failed/); a retried song's old sidecar stays in failed/ where
    the inbox already holds a new one for it."""
    from stemdeck_watch.engine.pipeline import Pipeline
    from stemdeck_watch.stages.quarantine import quarantine
    from stemdeck_watch.workers.local import WorkerClient

    from support.helpers import add_job, open_scheduler

    scheduler = open_scheduler(settings)
    try:
        pipeline = Pipeline(settings, WorkerClient(), scheduler.bus, scheduler.update)
        inbox, processed, failed = (
            settings.paths.inbox,
            settings.paths.processed,
            settings.paths.failed,
        )
        processed.mkdir(exist_ok=True)
        (processed / "b.wav.stemdeck.toml").write_text("# an older song's\n")
        job = add_job(scheduler, settings, "b", JobState.PUBLISHING)
        (inbox / "b.wav.stemdeck.toml").write_text('format = "flac"\n')
        done = pipeline.file_input(
            job, Path(job.source), _published(settings, job, 'format = "flac"\n')
        )
        assert Path(done.source) == processed / "b (2).wav", done
        assert (processed / "b (2).wav.stemdeck.toml").read_text() == 'format = "flac"\n'
        assert (processed / "b.wav.stemdeck.toml").read_text() == "# an older song's\n"

        failed.mkdir(exist_ok=True)
        (failed / "c.wav.stemdeck.toml").write_text("# an older song's\n")
        job = add_job(scheduler, settings, "c", JobState.DECODING)
        (inbox / "c.wav.stemdeck.toml").write_text('modle = "x"\n')
        where = quarantine(job, failed, stage="reading its choices", message="unknown key")
        assert where == failed / "c (2).wav" and (failed / "c (2).wav.stemdeck.toml").is_file()
        scheduler.update(job.id, state=JobState.FAILED, source=str(where))

        (inbox / "c.wav.stemdeck.toml").write_text('format = "flac"\n')  # fixed in the inbox
        scheduler.retry(job.id)
        assert (inbox / "c.wav").is_file()
        assert (inbox / "c.wav.stemdeck.toml").read_text() == 'format = "flac"\n'
        assert (failed / "c (2).wav.stemdeck.toml").read_text() == 'modle = "x"\n'
        for folder in (inbox, processed, failed):
            assert not list(folder.glob("*.stemdeck (*).toml")), sorted(folder.iterdir())
    finally:
        scheduler.registry.close()


@pytest.mark.slow
def test_a_sidecar_dropped_while_its_song_separates_is_left_for_the_next_drop(
    make_settings: Any, service_factory: Any, tmp_path: Path
) -> None:
    """Through the service: the song is separated with the settings it started with (its
    manifest says so), the sidecar that came meanwhile stays in the inbox, and the job says
    why."""
    from support.helpers import SeparationGate, wait_for

    settings = make_settings()
    service, jobs = service_factory(settings)
    inbox = settings.paths.inbox
    write_song(tmp_path / "Late.wav", 1.5, seed=3)
    (tmp_path / "Late.wav").replace(inbox / "Late.wav")
    job = wait_for(
        lambda: service.registry.latest_for_source(str(inbox / "Late.wav")), 20, "Late queued"
    )
    gate = SeparationGate(service.client, job.id)
    wait_for(
        lambda: jobs.latest.get(job.id) and jobs.latest[job.id].state is JobState.SEPARATING,
        60,
        "Late separating",
    )
    (inbox / "Late.wav.stemdeck.toml").write_text('format = "flac"\n')
    gate.open()
    [done] = jobs.wait_final(1, timeout=120)
    assert done.state is JobState.DONE, done.error
    assert "Late.wav.stemdeck.toml arrived after the song started" in (done.error or "")
    assert (inbox / "Late.wav.stemdeck.toml").is_file()
    assert not (settings.paths.processed / "Late.wav.stemdeck.toml").exists()
    manifest = read_manifest(Path(done.output or ""))
    assert manifest is not None and manifest["sidecar"] is None
    assert manifest["settings_from"]["output.format"] == "config"
