"""Choices in the drop itself: a tag in the song's name or a sidecar file beside it."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from stemdeck_watch.core.choices import ChoiceError, for_job, name_choices, song_name
from stemdeck_watch.core.config import default_toml, settings_from_dict
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.core.jobs import Job, JobKind, JobState
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
        "Evil.wav",
    ):
        write_song(made / name, 1.5, seed=len(name))
    (made / "Sided.wav.stemdeck.toml").write_text(
        'format = "flac"\ntwo_stems = "bass"\ndevice = "cuda"\n'
    )
    (made / "Worse.wav.stemdeck.toml").write_text('modle = "htdemucs_6s"\n')
    (made / "Evil.wav.stemdeck.toml").write_text('model = "hf://evil/htdemucs"\n')
    _service, jobs = service_factory(settings)
    inbox = settings.paths.inbox
    # the sidecars first, as a person drops them together (a job reads its sidecar at start)
    for name in ("Sided.wav.stemdeck.toml", "Worse.wav.stemdeck.toml", "Evil.wav.stemdeck.toml"):
        (made / name).replace(inbox / name)
    for name in ("Tagged [vocals].wav", "Sided.wav", "Bad [vocal].wav", "Worse.wav", "Evil.wav"):
        (made / name).replace(inbox / name)
    (inbox / "karaoke").mkdir(exist_ok=True)  # the service makes preset folders
    (made / "Mixed [drums].wav").replace(inbox / "karaoke" / "Mixed [drums].wav")
    done = {Path(j.source).name: j for j in jobs.wait_final(6, timeout=240)}
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
    evil = done["Evil.wav"]  # a model by URL: refused before the worker is asked for it
    assert evil.state is JobState.FAILED
    assert evil.error.startswith('Evil.wav.stemdeck.toml: model = "hf://evil/htdemucs" is not')
    assert "Evil.wav.stemdeck.toml" in (failed / "Evil.wav.error.txt").read_text()

    # fixed where it failed, as the report says, and retried: the choices come back with it
    (failed / "Worse.wav.stemdeck.toml").write_text('format = "flac"\n')
    _service.scheduler.retry(worse.id)
    again = next(
        j for j in jobs.wait_final(7, timeout=120) if j.id not in {x.id for x in done.values()}
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


def _job(song: Path, preset: str | None = None) -> Job:
    return Job(
        id="j",
        name=song.stem,
        kind=JobKind.FILE,
        state=JobState.QUEUED,
        source=str(song),
        rel_path=song.name if preset is None else f"{preset}/{song.name}",
        preset=preset,
    )


def test_a_sidecar_naming_a_model_by_url_fails_the_song_naming_the_sidecar_before_any_load(
    settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`hf://` makes demucs fetch a repository and build whatever class its metadata names
    (code, as the service's user): a drop's model is a plain name from the allow-list, and
    the song fails before anything is loaded or fetched."""

    def no_network(*_args: object) -> None:
        raise AssertionError("a connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    song = write_song(settings.paths.inbox / "Song.wav", 0.5)
    sidecar = Path(f"{song}.stemdeck.toml")
    for model in ("hf://evil/htdemucs", "https://evil.example/htdemucs", "file:///tmp/x", "../x"):
        sidecar.write_text(f'model = "{model}"\n')
        with pytest.raises(ChoiceError) as caught:
            for_job(settings, _job(song))
        message = str(caught.value)
        assert message.startswith("Song.wav.stemdeck.toml: model = "), message
        assert "never a URL, a scheme such as hf:// or a path" in message


def test_a_drop_may_choose_only_models_demucs_defines_or_the_owner_configured(
    settings, tmp_path: Path
) -> None:
    song = write_song(settings.paths.inbox / "Song.wav", 0.5)
    sidecar = Path(f"{song}.stemdeck.toml")
    for model in ("htdemucs_ft", "mdx_extra", "htdemucs"):
        sidecar.write_text(f'model = "{model}"\n')
        assert for_job(settings, _job(song)).separation.model == model
    sidecar.write_text('model = "955717e8"\n')  # a file of demucs's hub, not a model it names
    with pytest.raises(ChoiceError, match=r"chosen by the sidecar Song.wav.stemdeck.toml\) is"):
        for_job(settings, _job(song))
    data = default_toml()
    data["folders"] = {n: str(tmp_path / n) for n in ("inbox", "outbox", "processed", "failed")}
    data["presets"] = {"mine": {"model": "mymodel"}, "local": {"model_repo": str(tmp_path)}}
    owner = settings_from_dict(data)
    sidecar.write_text('model = "mymodel"\n')  # the owner's own preset names it
    assert for_job(owner, _job(song)).separation.model == "mymodel"
    sidecar.write_text('model = "other"\n')  # any plain name: it loads from the owner's folder
    assert for_job(owner, _job(song, "local")).separation.model == "other"
    with pytest.raises(ChoiceError, match="is not a model a file in the inbox may choose"):
        for_job(owner, _job(song))


@pytest.mark.parametrize(
    "sidecar, message",
    [
        ("segment = 3600\n", r"segment = 3600 is longer than any model's own segment"),
        ("segment = 20\n", r"segment = 20 \(chosen by the sidecar .*\) is longer than the model"),
        ('model = "mdx_extra"\nsegment = 60\n', r"segment = 60 is longer"),
        ("shifts = 20\n", r"shifts = 20 is more than a file in the inbox may choose: 0 to 5"),
        ("overlap = 0.99\n", r"overlap = 0.99 is more than a file in the inbox may choose"),
        (
            "practice_speeds = [" + ", ".join(f"{25 + i / 100:.2f}" for i in range(7000)) + "]\n",
            r"practice_speeds lists 7000 entries; a file in the inbox may choose at most 8",
        ),
        (
            "[mixes]\n" + "".join(f'm{i} = ["drums"]\n' for i in range(9)),
            r"mixes lists 9 entries",
        ),
        ("stall_seconds = 1e9\n", r"stall_seconds cannot be chosen by a file in the inbox"),
        ("threads = 1024\n", r"threads cannot be chosen by a file in the inbox"),
        ("x = " + "[" * 3000 + "]" * 3000 + "\n", r"could not parse Song.wav.stemdeck.toml: it"),
        # Python 3.11's tomllib reads it and the gate refuses its depth; 3.10's tomli gives up
        # parsing it: either way a clear error naming the sidecar
        (
            "mixes." + ".".join(["a"] * 3000) + " = 1\n",
            r"mixes is nested deeper than|Song.wav.stemdeck.toml: it nests tables or arrays",
        ),
    ],
)
def test_a_sidecar_past_the_drops_bounds_fails_the_song_naming_the_sidecar(
    settings, sidecar: str, message: str
) -> None:
    """What one dropped file chooses cannot take the machine or the queue: a segment past
    the model's own (11.8 GB for a 1-second song), minutes of shifts, 7,000 practice
    renders, a watchdog turned off, or a table nested to exhaust the stack."""
    song = write_song(settings.paths.inbox / "Song.wav", 0.5)
    Path(f"{song}.stemdeck.toml").write_text(sidecar)
    with pytest.raises(ChoiceError, match=message) as caught:
        for_job(settings, _job(song))
    assert "Song.wav" in str(caught.value)


def test_within_the_drops_bounds_a_sidecar_still_chooses(settings) -> None:
    song = write_song(settings.paths.inbox / "Song.wav", 0.5)
    Path(f"{song}.stemdeck.toml").write_text(
        "segment = 7.8\nshifts = 5\noverlap = 0.5\npractice_speeds = [50, 75]\n"
    )
    chosen = for_job(settings, _job(song))
    assert (chosen.separation.segment, chosen.separation.shifts) == (7.8, 5)
    assert chosen.output.practice_speeds == (50.0, 75.0)
    assert chosen.origins["separation.segment"] == "sidecar Song.wav.stemdeck.toml"


def test_a_recipe_is_chosen_by_name_from_the_catalogue_only(settings) -> None:
    """`[best]`, a sidecar's or a preset's `recipe` choose a recipe of core/recipes.py, whose
    Demucs model becomes the song's model; a name not on that list (a checkpoint, a path, a
    URL) fails the song naming the sidecar and what may be chosen."""
    song = write_song(settings.paths.inbox / "Song [best].wav", 0.5)
    chosen = for_job(settings, _job(song))
    assert (chosen.separation.recipe, chosen.separation.model) == ("best", "htdemucs_ft")
    assert chosen.origins["separation.recipe"] == "name tag [best]"
    assert chosen.origins["separation.model"] == "name tag [best]"
    plain = write_song(settings.paths.inbox / "Plain.wav", 0.5)
    for value in ("bs_roformer_viperx_1297", "../models/x", "https://example.invalid/x.ckpt"):
        Path(f"{plain}.stemdeck.toml").write_text(f'recipe = "{value}"\n')
        with pytest.raises(ChoiceError, match="Plain.wav.stemdeck.toml: recipe = .* one of best"):
            for_job(settings, _job(plain))
    Path(f"{plain}.stemdeck.toml").write_text('recipe = "mel"\n')
    chosen = for_job(settings, _job(plain))
    assert (chosen.separation.recipe, chosen.separation.model) == ("mel", "htdemucs_ft")


def test_a_preset_names_a_recipe_and_the_config_checks_it() -> None:
    data = default_toml()
    data["presets"] = {"best": {"recipe": "best_quick"}}
    loaded = settings_from_dict(data)
    sep, _out = loaded.for_preset("best")
    assert (sep.recipe, sep.model) == ("best_quick", "htdemucs")
    data["presets"] = {"best": {"recipe": "fastest"}}
    with pytest.raises(ConfigError, match='presets.best.recipe = "fastest" is not allowed'):
        settings_from_dict(data)


def test_a_model_chosen_nearer_the_song_than_the_recipe_separates_it_alone(tmp_path: Path) -> None:
    """A recipe in the config, `[6s]` on a song: six stems from htdemucs_6s, no recipe; and
    `[best]` under a preset that names a model: the recipe."""
    data = default_toml()
    data["folders"] = {
        n: str(tmp_path / n) for n in ("inbox", "outbox", "processed", "failed", "state")
    }
    data["separation"]["recipe"] = "best"
    data["presets"] = {"six": {"model": "htdemucs_6s"}}
    settings = settings_from_dict(data)
    settings.paths.inbox.mkdir(parents=True)
    assert settings.for_preset("six")[0].recipe == ""
    six = for_job(settings, _job(write_song(settings.paths.inbox / "Six [6s].wav", 0.5)))
    assert (six.separation.recipe, six.separation.model) == ("", "htdemucs_6s")
    assert six.origins["separation.recipe"] == "name tag [6s]"
    (settings.paths.inbox / "six").mkdir()
    best = write_song(settings.paths.inbox / "six" / "Best [best].wav", 0.5)
    chosen = for_job(settings, _job(best, "six"))
    assert (chosen.separation.recipe, chosen.separation.model) == ("best", "htdemucs_ft")
    plain = for_job(settings, _job(write_song(settings.paths.inbox / "Plain.wav", 0.5)))
    assert (plain.separation.recipe, plain.separation.model) == ("best", "htdemucs_ft")
