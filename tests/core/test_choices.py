"""Choices in the drop itself: a tag in the song's name or a sidecar file beside it."""

from __future__ import annotations

from pathlib import Path

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
