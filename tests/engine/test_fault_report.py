"""A song's report after machine faults: where the song's own drop chose how it separates,
the report names those choices instead of saying the song was not the cause."""

from __future__ import annotations

from pathlib import Path

from stemdeck_watch.core.choices import separation_choices
from stemdeck_watch.core.jobs import Fault, Job, JobKind, JobState
from stemdeck_watch.engine.faults import failure
from stemdeck_watch.util.synth import write_song


def test_a_machine_fault_under_a_songs_own_choices_names_them_in_its_report(settings) -> None:
    song = write_song(settings.paths.inbox / "Song [ft].wav", 0.5)
    Path(f"{song}.stemdeck.toml").write_text('segment = 7.8\nshifts = 5\nformat = "flac"\n')
    job = Job(
        id="j",
        name="Song",
        kind=JobKind.FILE,
        state=JobState.QUEUED,
        source=str(song),
        rel_path=song.name,
    )
    chosen = separation_choices(settings, job)
    assert chosen == (
        "model = 'htdemucs_ft' by the name tag [ft]; "
        "shifts = 5, segment = 7.8 by the sidecar Song [ft].wav.stemdeck.toml"
    )
    faults = tuple(Fault("stalled", f"stalled {n}", worker="w") for n in range(3))
    message, _details = failure(faults, chosen)
    assert message.startswith(
        f"the worker failed on all 3 attempts, with the song's own choices ({chosen}), "
        f"which may have caused it: 1) stalled 0"
    )
    assert "never because of the song" not in message
    single, _ = failure(faults[:1], chosen)
    assert (
        single == f"the worker failed with the song's own choices ({chosen}), which may "
        "have caused it: stalled 0"
    )
    plain, _ = failure(faults)  # the config's settings: the song was not the cause
    assert "never because of the song" in plain
