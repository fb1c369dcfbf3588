"""The disk check before a job: its estimate follows the file, a duration probed ahead (by
the prefetcher, while the previous job separates) is not probed again between two jobs, and a
link is sized by its own length once anything tells it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from stemdeck_watch.core.choices import ChoiceError
from stemdeck_watch.engine import diskguard
from stemdeck_watch.engine.diskguard import DiskGuard
from stemdeck_watch.core.jobs import Job, JobKind, JobState, PlaylistRef
from stemdeck_watch.util.synth import write_song

from support.helpers import open_scheduler


def test_a_probed_duration_is_reused_until_the_file_changes(settings, monkeypatch) -> None:
    probed: list[str] = []
    real_probe = diskguard.probe_duration

    def counting_probe(source: Path) -> float | None:
        probed.append(Path(source).name)
        return real_probe(source)

    monkeypatch.setattr(diskguard, "probe_duration", counting_probe)
    scheduler = open_scheduler(settings)
    try:
        source = write_song(settings.paths.inbox / "song.wav", 20.0)
        job = Job(
            id="j1",
            name="song",
            kind=JobKind.FILE,
            state=JobState.QUEUED,
            source=str(source),
            rel_path="song.wav",
        )
        room = 10 * 2**20  # a 20 s song's stems and scratch need more than this
        guard = DiskGuard(scheduler, settings, free=lambda _path: room + diskguard.MARGIN)

        assert not guard.fits_ahead(job)  # ahead, as the prefetcher asks
        short = guard.shortfall(job)
        assert short is not None and short[1] > room + diskguard.MARGIN
        assert probed == ["song.wav"]  # the check before the job used the probe made ahead

        write_song(source, 1.0)  # replaced by a short take: the estimate follows the file
        assert guard.shortfall(job) is None
        assert probed == ["song.wav", "song.wav"]

        source.unlink()  # gone: assume a long song; the decode step will say what happened
        assert guard.shortfall(job) is not None
    finally:
        scheduler.registry.close()


def test_a_link_needs_room_for_its_download_only_until_its_length_is_known(
    settings, tmp_path
) -> None:
    scheduler = open_scheduler(settings)
    try:
        link = Job(
            id="l1",
            name="link",
            kind=JobKind.LINK,
            state=JobState.QUEUED,
            source=str(settings.paths.inbox / "link.url"),
            rel_path="link.url",
        )
        room = 100 * 10**6  # far less than a song of links.max_duration (30 min) needs
        guard = DiskGuard(scheduler, settings, free=lambda _path: room + diskguard.MARGIN)
        assert guard.shortfall(link) is None  # only its download, at most 1800 s of audio
        entry = dataclasses.replace(
            link, id="l2", playlist=PlaylistRef("p", "list", 1, 3, duration=1500.0)
        )  # the playlist gave its length: sized by it
        assert guard.shortfall(entry) is not None
        guard.learn_download(link, write_song(tmp_path / "media.wav", 2.0))
        assert guard.shortfall(link) is None  # two seconds, downloaded
        guard.learn_download(link, write_song(tmp_path / "media.wav", 60.0))
        assert guard.shortfall(link) is not None  # a minute: stems and scratch do not fit
    finally:
        scheduler.registry.close()


def test_the_disk_check_counts_the_outputs_a_song_chose_in_its_drop(settings) -> None:
    """A DJ stem file, practice renders or a DAW project's mix asked for by a sidecar, or mp3
    stems asked for by a tag in the name, change what the song needs on the outbox's disk
    before it starts."""
    scheduler = open_scheduler(settings)
    try:

        def needed(name: str, sidecar: str | None = None) -> int:
            source = write_song(settings.paths.inbox / name, 60.0)
            if sidecar is not None:
                Path(f"{source}.stemdeck.toml").write_text(sidecar)
            job = Job(
                id=name,
                name=Path(name).stem,
                kind=JobKind.FILE,
                state=JobState.QUEUED,
                source=str(source),
                rel_path=name,
            )
            guard = DiskGuard(scheduler, settings, free=lambda _path: diskguard.MARGIN)
            short = guard.shortfall(job)
            assert short is not None
            return short[1]

        plain = needed("plain.wav")
        minute = 60.0
        assert needed("dj.wav", "stem_file = true\n") - plain >= 5 * 256_000 / 8 * minute
        # a click, the song minus each of four stems, and the 75 % version: 128 kbit/s mp3s
        practice = needed("practice.wav", "practice = true\n") - plain
        assert practice >= 128_000 / 8 * minute * (1 + 4 + 100 / 75) * 0.99
        assert needed("small [mp3].wav") < plain  # mp3 stems take less than 16-bit wav
        # a DAW project plays the whole song on a muted track: one more 16-bit wav
        assert needed("daw.wav", 'session = ["reaper"]\n') - plain >= 44_100 * 4 * minute
    finally:
        scheduler.registry.close()


def test_a_song_whose_own_choices_need_more_than_the_disk_fails_alone(settings) -> None:
    """A sidecar asking for practice renders and a DJ stem file that the disk cannot hold
    fails that song, naming the sidecar; the queue pauses for disk only when the disk is
    short for every song (the song as configured would not fit either)."""
    scheduler = open_scheduler(settings)
    try:
        source = write_song(settings.paths.inbox / "big.wav", 20.0)
        job = Job(
            id="big",
            name="big",
            kind=JobKind.FILE,
            state=JobState.QUEUED,
            source=str(source),
            rel_path="big.wav",
        )
        short = DiskGuard(scheduler, settings, free=lambda _path: 0).shortfall(job)
        assert short is not None
        plain = short[1]  # as configured, margin included
        Path(f"{source}.stemdeck.toml").write_text("practice = true\nstem_file = true\n")
        room = plain + 1_000_000  # the song as configured fits; with its choices it does not
        guard = DiskGuard(scheduler, settings, free=lambda _path: room)
        with pytest.raises(ChoiceError) as caught:
            guard.hold(job)
        message = str(caught.value)
        assert "what the sidecar big.wav.stemdeck.toml chose" in message
        assert "output.practice" in message and "output.stem_file" in message
        assert not scheduler.queue.paused

        tight = DiskGuard(scheduler, settings, free=lambda _path: plain - 1_000_000)
        assert tight.hold(job)  # short for every song: the queue waits for room
        assert scheduler.queue.paused and scheduler.queue.pause_reason == "disk"
    finally:
        scheduler.registry.close()
