"""Names as people and other systems spell them: two Unicode spellings of one name, 255-byte
names, newlines, leading dashes, `%`, deep folders — and symbolic links, never followed out of
the inbox."""

from __future__ import annotations

import os
import unicodedata

import pytest

from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.core.paths import report_path
from stemdeck_watch.util.synth import write_song

from support.helpers import outbox_entries, wait_for
from support.intake_harness import IntakeRig

NFC = unicodedata.normalize("NFC", "Café Olé")
NFD = unicodedata.normalize("NFD", "Café Olé")


@pytest.fixture
def rig(make_settings):
    with IntakeRig(make_settings(api={"enabled": False})) as rig:
        yield rig


def test_two_unicode_spellings_of_one_song_are_one_job(rig, tmp_path):
    assert NFC != NFD
    song = write_song(tmp_path / "song.mp3", 1.0)
    folder = rig.inbox / unicodedata.normalize("NFD", "Señor")
    folder.mkdir()
    # a Mac's sync client writes the decomposed name, a Linux copy the composed one;
    # both carry the song's time, as sync clients keep it
    for name in (f"{NFD}.mp3", f"{NFC}.mp3"):
        target = folder / name
        target.write_bytes(song.read_bytes())
        os.utime(target, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    [job] = rig.wait_jobs(1)
    rig.quiet()
    rig.intake.scan(rig.inbox)
    rig.quiet()
    assert len(rig.jobs()) == 1
    assert job.name == NFC and job.rel_path == f"Señor/{NFC}.mp3"  # composed, whichever came


def test_a_different_song_under_the_other_spelling_is_its_own_job(rig, tmp_path):
    (rig.inbox / f"{NFD}.wav").write_bytes(write_song(tmp_path / "a.wav", 1.0).read_bytes())
    rig.wait_jobs(1)
    (rig.inbox / f"{NFC}.wav").write_bytes(write_song(tmp_path / "b.wav", 1.5, seed=1).read_bytes())
    jobs = rig.wait_jobs(2)
    assert {j.name for j in jobs} == {NFC}


def test_a_name_that_is_not_utf8_is_renamed_readable_and_holds_up_no_other_song(
    rig, tmp_path, caplog
):
    """`Caf\xe9.wav` from an old zip or an SMB share: no database or page can carry its
    name, so it is renamed in place (as Windows-1252 wrote it), then queued like any song;
    the songs beside it are queued meanwhile. One in a folder whose name is not UTF-8
    is left where it is, said once in the log."""
    song = write_song(tmp_path / "song.wav", 1.0).read_bytes()
    inbox = os.fsencode(rig.inbox)
    os.mkdir(os.path.join(inbox, b"Alt\xe9"))
    long = b"\xe9" * 200 + b" - 07.wav"  # 209 bytes; readable, each byte takes two
    for name in (b"Caf\xe9.wav", long):  # their choices go with them
        with open(os.path.join(inbox, name + b".stemdeck.toml"), "w") as handle:
            handle.write('two_stems = "vocals"\n')
    for name in (b"Caf\xe9.wav", b"Alpha.wav", b"Zulu \x81.wav", b"Alt\xe9/inside.wav", long):
        with open(os.path.join(inbox, name), "wb") as handle:
            handle.write(song)
    jobs = rig.wait_jobs(4)
    rig.quiet()
    cut = next(j.rel_path for j in jobs if j.rel_path.endswith(" - 07.wav"))
    assert len(cut.encode()) <= 255 and cut.startswith("é") and "…" in cut
    assert sorted(j.rel_path for j in rig.jobs() if j.rel_path != cut) == [
        "Alpha.wav",
        "Café.wav",
        "Zulu _.wav",
    ]
    assert sorted(os.listdir(inbox)) == sorted(
        [
            b"Alpha.wav",
            b"Alt\xe9",
            b"Caf\xc3\xa9.wav",
            b"Caf\xc3\xa9.wav.stemdeck.toml",
            b"Zulu _.wav",
            cut.encode(),
            cut.encode() + b".stemdeck.toml",
        ]
    )
    assert all(j.state is JobState.QUEUED for j in jobs)
    # the old names' deletions are nothing the queue knew: no error, no rescan for them
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


def test_a_link_to_a_file_elsewhere_is_refused_with_a_reason(rig, tmp_path):
    elsewhere = write_song(tmp_path / "private" / "secret.wav", 1.0)
    before = elsewhere.read_bytes()
    (rig.inbox / "sub").mkdir()
    os.symlink(elsewhere, rig.inbox / "sub" / "linked.wav")
    [job] = rig.wait_jobs(1)
    assert job.state is JobState.FAILED
    assert "outside the inbox" in job.error and str(elsewhere) in job.error
    moved = rig.settings.paths.failed / "sub" / "linked.wav"
    assert job.source == str(moved) and moved.is_symlink()  # the link, not its target
    assert "links are not followed" in report_path(moved).read_text()
    assert elsewhere.read_bytes() == before and not (rig.inbox / "sub" / "linked.wav").exists()


@pytest.mark.parametrize("planted", ["link", "file"])
def test_a_link_is_never_set_aside_through_what_was_planted_in_failed(rig, tmp_path, planted):
    """failed/ may be shared too: a link or a file planted where the refused link's folder
    would go is not gone through (nor does it keep the link in the inbox); the refused link
    goes to the top of failed/ instead."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    rig.settings.paths.failed.mkdir(parents=True, exist_ok=True)
    if planted == "link":
        os.symlink(elsewhere, rig.settings.paths.failed / "sub")
    else:
        (rig.settings.paths.failed / "sub").write_bytes(b"someone's file")
    (rig.inbox / "sub").mkdir()
    os.symlink(write_song(tmp_path / "private.wav", 1.0), rig.inbox / "sub" / "linked.wav")
    [job] = rig.wait_jobs(1)
    assert job.state is JobState.FAILED
    assert job.source == str(rig.settings.paths.failed / "linked.wav")
    assert list(elsewhere.iterdir()) == []


def test_a_link_to_a_song_in_the_inbox_is_not_a_second_job(rig, tmp_path):
    real = write_song(rig.inbox / "real.wav", 1.0)
    os.symlink(real, rig.inbox / "alias.wav")
    wait_for(lambda: len(rig.jobs()) == 2, 30, "the song queued and the link refused")
    rig.quiet()
    by_path = rig.jobs_by_path()
    assert [j.state for j in by_path["real.wav"]] == [JobState.QUEUED]
    assert by_path["alias.wav"][0].state is JobState.FAILED
    assert "in the inbox" in by_path["alias.wav"][0].error


def test_a_linked_folder_is_not_walked(rig, tmp_path, caplog):
    library = tmp_path / "Music Library"
    for i in range(2):
        write_song(library / f"{i}.wav", 1.0, seed=i)
    os.symlink(library, rig.inbox / "Library")  # appears as one new folder
    write_song(rig.inbox / "marker.wav", 1.0)
    rig.wait_jobs(1)
    rig.intake.scan(rig.inbox)
    rig.quiet()
    assert [j.rel_path for j in rig.jobs()] == ["marker.wav"]
    assert sorted(p.name for p in library.iterdir()) == ["0.wav", "1.wav"]


@pytest.mark.slow
def test_awkward_names_are_separated_and_kept(make_settings, service_factory, tmp_path):
    settings = make_settings(api={"enabled": False})
    service, jobs = service_factory(settings)
    long_stem = "L" * (255 - len(".wav"))
    deep = "/".join(f"level{i}" for i in range(12))
    names = [
        f"{long_stem}.wav",
        "-rf --help.wav",
        "100% mix %s %d.wav",
        "two\nlines.wav",
        f"{deep}/deep.wav",
        f"{NFD}.wav",
    ]
    assert len(names[0].encode()) == 255
    for i, name in enumerate(names):
        write_song(tmp_path / "stage" / f"{i}.wav", 1.0, seed=i)
        (settings.paths.inbox / name).parent.mkdir(parents=True, exist_ok=True)
        os.rename(tmp_path / "stage" / f"{i}.wav", settings.paths.inbox / name)
    finished = jobs.wait_final(len(names), timeout=240)
    assert [j.state for j in finished] == [JobState.DONE] * len(names), [
        (j.name, j.error) for j in finished
    ]
    outbox = settings.paths.outbox
    assert outbox_entries(outbox) == {
        long_stem,
        "-rf --help",
        "100% mix %s %d",
        "two\nlines",
        "level0",
        NFC,
    }
    for folder in (outbox / long_stem, outbox / "two\nlines", outbox / deep / "deep", outbox / NFC):
        assert (folder / "vocals.wav").is_file() and (folder / "stemdeck.json").is_file()
    processed = settings.paths.processed
    assert (processed / names[0]).is_file() and (processed / deep / "deep.wav").is_file()
    assert (processed / f"{NFC}.wav").is_file()  # composed: one name whichever way it came
