"""Every writer that fills an inbox, imitated byte for byte on a real inbox watched by the
real watchdog observer (native inotify and polling where the difference matters).

Each writer pauses longer than the settle time while its file is unfinished — the moment a
careless intake would take half a song. What the user must see, checked after every writer
and again after a full rescan: exactly one job per song, queued with the song's complete
content, nothing for temporary or metadata files, nothing stranded.
"""

from __future__ import annotations

import hashlib
import json
import os
import plistlib
import shutil
import signal
import threading
from pathlib import Path

import pytest

from stemdeck_watch.core.jobs import FileSignature, JobState
from stemdeck_watch.engine.scheduler import CHANGED_WHILE_RUNNING
from stemdeck_watch.util.synth import write_song

from support.helpers import outbox_entries, wait_for, write_paced
from support.intake_harness import IntakeRig

SETTLE = 0.3
PAUSE = 0.7  # a writer's pause: longer than SETTLE (+ two intake ticks) and than POLL
POLL = 0.2
_ENCODED: dict[tuple[str, int], bytes] = {}


def audio(suffix: str = ".mp3", seed: int = 0, tmp: Path | None = None) -> bytes:
    """A real encoded song (1 s), made once per format and seed."""
    key = (suffix, seed)
    if key not in _ENCODED:
        assert tmp is not None
        _ENCODED[key] = write_song(tmp / f"enc{seed}{suffix}", 1.0, seed=seed).read_bytes()
    return _ENCODED[key]


def pieces(data: bytes, count: int = 2) -> list[bytes]:
    step = len(data) // count + 1
    return [data[i : i + step] for i in range(0, len(data), step)]


def slowly(path: Path, data: bytes, reopen: bool = False) -> None:
    """Write `data` in two pieces with a PAUSE after each (the last pause ends the file)."""
    write_paced(path, [*pieces(data), b""], PAUSE, reopen)


def watching(make_settings, mode: str) -> IntakeRig:
    return IntakeRig(
        make_settings(
            watch={"mode": mode, "poll_interval": POLL, "settle_seconds": SETTLE},
            api={"enabled": False},
        )
    )


@pytest.fixture(params=["native", "polling"])
def rig(request, make_settings):
    with watching(make_settings, request.param) as rig:
        yield rig


@pytest.fixture
def native(make_settings):
    with watching(make_settings, "native") as rig:
        yield rig


def at_once(*writes: tuple) -> None:
    """Run several writers side by side, as a sync client fetching several files does."""
    threads = [threading.Thread(target=w[0], args=w[1:]) for w in writes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def settled(rig: IntakeRig, songs: dict[str, bytes]) -> None:
    """Wait for the songs' jobs, then rescan the whole inbox: the verdict must not change."""
    wait_for(lambda: len(rig.jobs()) >= len(songs), 30, f"{len(songs)} job(s)")
    rig.quiet()
    rig.intake.scan(rig.inbox)
    rig.quiet()
    rig.assert_songs(songs)


# ---------------------------------------------------------------- in place


@pytest.mark.parametrize("reopen", [False, True], ids=["one-open", "reopen-per-chunk"])
def test_slow_in_place_writes_with_pauses_longer_than_the_poll_interval(
    make_settings, tmp_path, reopen
):
    # settle must outlast the writer's pauses (that is the rule); the poll interval need not
    for mode in ("native", "polling"):
        settings = make_settings(
            watch={"mode": mode, "poll_interval": POLL, "settle_seconds": 1.0},
            folders={
                "inbox": str(tmp_path / mode / "inbox"),
                "state": str(tmp_path / mode / "state"),
            },
        )
        with IntakeRig(settings) as rig:
            data = audio(".wav", 1, tmp_path)
            slowly(rig.inbox / "slow.wav", data, reopen)
            settled(rig, {"slow.wav": data})


# ---------------------------------------------------------------- temp name, then rename


def syncthing(inbox: Path, name: str, data: bytes) -> None:
    """Syncthing: `.syncthing.NAME.tmp` beside the target, the source's mtime set, renamed."""
    target = inbox / name
    tmp = target.with_name(f".syncthing.{target.name}.tmp")
    slowly(tmp, data)
    os.utime(tmp, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    os.rename(tmp, target)


def nextcloud(inbox: Path, name: str, data: bytes) -> None:
    """Nextcloud desktop client: `.NAME.~<8 hex>`, then renamed."""
    target = inbox / name
    tmp = target.with_name(f".{target.name}.~4f2a9c1e")
    slowly(tmp, data)
    os.rename(tmp, target)


def resilio(inbox: Path, name: str, data: bytes) -> None:
    """Resilio Sync: `NAME.!sync` while it downloads, then renamed."""
    target = inbox / name
    tmp = target.with_name(target.name + ".!sync")
    slowly(tmp, data)
    os.rename(tmp, target)


def chrome(inbox: Path, name: str, data: bytes) -> None:
    """Chrome: `Unconfirmed NNN.crdownload`, renamed to `NAME.crdownload` once the name is
    known, finished there, then renamed to NAME."""
    target = inbox / name
    first = target.with_name("Unconfirmed 812345.crdownload")
    half = len(data) // 2
    write_paced(first, [data[:half], b""], PAUSE, False)
    named = target.with_name(target.name + ".crdownload")
    os.rename(first, named)
    with open(named, "ab") as handle:
        handle.write(data[half:])
    threading.Event().wait(PAUSE)
    os.rename(named, target)


def google_drive(inbox: Path, name: str, data: bytes) -> None:
    """Google Drive for desktop: written in `.tmp.drivedownload/` at the top, then moved."""
    folder = inbox / ".tmp.drivedownload"
    folder.mkdir(exist_ok=True)
    tmp = folder / "1834.tmp"
    slowly(tmp, data)
    os.rename(tmp, inbox / name)


def onedrive(inbox: Path, name: str, data: bytes) -> None:
    """OneDrive: written in its hidden GUID folder at the top of the synced folder, then
    moved into place."""
    folder = inbox / ".849C9593-D756-4E56-8D6E-42412F2A707B"
    folder.mkdir(exist_ok=True)
    tmp = folder / "6a1f3b2c"
    slowly(tmp, data)
    os.rename(tmp, inbox / name)


# polling sees a temp-then-rename writer only as the final file appearing: two suffice there
@pytest.mark.parametrize(
    "mode,writer",
    [
        *[("native", w) for w in (syncthing, nextcloud, resilio, chrome, google_drive, onedrive)],
        ("polling", syncthing),
        ("polling", chrome),
    ],
    ids=lambda p: getattr(p, "__name__", p),
)
def test_temp_name_then_rename(make_settings, tmp_path, mode, writer):
    with watching(make_settings, mode) as rig:
        (rig.inbox / "Album").mkdir()
        songs = {"song.mp3": audio(".mp3", 0, tmp_path)}
        if writer in (syncthing, nextcloud, resilio):  # their temps sit beside the target
            songs["Album/track.flac"] = audio(".flac", 2, tmp_path)
        at_once(*[(writer, rig.inbox, name, data) for name, data in songs.items()])
        settled(rig, songs)


# ---------------------------------------------------------------- browsers


def test_firefox_zero_byte_file_then_part_renamed_over_it(rig, tmp_path):
    data = audio(".mp3", 3, tmp_path)
    target = rig.inbox / "download.mp3"
    target.touch()  # the final name, empty, at once
    part = target.with_name(target.name + ".part")
    slowly(part, data)  # the bytes go to NAME.part
    os.replace(part, target)  # renamed over the empty file
    settled(rig, {"download.mp3": data})


def test_safari_download_bundle(rig, tmp_path):
    data = audio(".m4a", 4, tmp_path)
    bundle = rig.inbox / "song.m4a.download"
    bundle.mkdir()
    (bundle / "Info.plist").write_bytes(
        plistlib.dumps(
            {
                "DownloadEntryURL": "https://example.com/song.m4a",
                "DownloadEntryProgressBytesSoFar": 0,
            },
            fmt=plistlib.FMT_BINARY,
        )
    )
    slowly(bundle / "song.m4a", data)  # the unfinished file has the final name
    os.rename(bundle / "song.m4a", rig.inbox / "song.m4a")
    shutil.rmtree(bundle)
    settled(rig, {"song.m4a": data})


# ---------------------------------------------------------------- sync clients' leftovers


def test_icloud_placeholder_later_becomes_the_file(rig, tmp_path):
    data = audio(".mp3", 5, tmp_path)
    placeholder = rig.inbox / ".song.mp3.icloud"
    placeholder.write_bytes(
        plistlib.dumps(
            {"NSURLNameKey": "song.mp3", "NSURLFileSizeKey": len(data)}, fmt=plistlib.FMT_BINARY
        )
    )
    threading.Event().wait(PAUSE * 2)  # evicted: only the placeholder exists
    rig.quiet()
    assert rig.jobs() == []
    tmp = rig.inbox / ".song.mp3.sb-a1b2c3d4-XyZ"  # downloaded beside it, then swapped in
    slowly(tmp, data)
    os.rename(tmp, rig.inbox / "song.mp3")
    placeholder.unlink()
    settled(rig, {"song.mp3": data})


def test_sync_conflict_copies_appledouble_and_synology_metadata(native, tmp_path):
    rig = native
    data = audio(".mp3", 6, tmp_path)
    songs = {"song.mp3": data, "Live/set.flac": audio(".flac", 7, tmp_path)}
    (rig.inbox / "Live").mkdir()
    # Syncthing keeps the losing side of a conflict beside the file
    conflict = ("song.sync-conflict-20261130-072401-7QXDG2K.mp3", audio(".mp3", 8, tmp_path))
    at_once(
        *[(syncthing, rig.inbox, name, content) for name, content in (*songs.items(), conflict)]
    )
    # macOS writes AppleDouble resource forks beside files on SMB/exFAT shares
    header = b"\x00\x05\x16\x07\x00\x02\x00\x00" + b"Mac OS X        " + b"\x00\x02"
    (rig.inbox / "._song.mp3").write_bytes(header + b"\x00" * (4096 - len(header)))
    (rig.inbox / "Live" / "._set.flac").write_bytes(header + b"\x00" * (4096 - len(header)))
    # Synology's indexer: @eaDir/NAME/ folders with thumbnails and streams
    for folder in (rig.inbox / "@eaDir" / "song.mp3", rig.inbox / "Live" / "@eaDir" / "set.flac"):
        folder.mkdir(parents=True)
        (folder / "SYNOFILE_THUMB_M.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 60)
        (folder.parent / f"{folder.name}@SynoEAStream").write_bytes(b"\x00" * 120)
        shutil.copy(rig.inbox / "song.mp3", folder / "SYNOAUDIO_preview.mp3")
    (rig.inbox / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" + b"\x00" * 60)
    settled(rig, songs)


def test_a_whole_album_folder_copied_in_at_once(rig, tmp_path):
    staging = tmp_path / "staging" / "Some Album (2026)"
    songs = {}
    for disc, tracks in (("CD 1", 3), ("CD 2", 2)):
        for i in range(tracks):
            rel = f"Some Album (2026)/{disc}/{i + 1:02} Track.flac"
            data = audio(".flac", 10 + len(songs), tmp_path)
            (staging / disc).mkdir(parents=True, exist_ok=True)
            (staging / disc / f"{i + 1:02} Track.flac").write_bytes(data)
            songs[rel] = data
    (staging / "cover.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 60)
    (staging / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    shutil.copytree(staging, rig.inbox / staging.name)  # cp -r: folder first, then the files
    settled(rig, songs)


# ---------------------------------------------------------------- replaced while queued


def test_a_file_replaced_in_place_while_queued_keeps_its_job(rig, tmp_path):
    old, new = audio(".wav", 20, tmp_path), audio(".wav", 21, tmp_path) * 2
    target = rig.inbox / "take.wav"
    target.write_bytes(old)
    [job] = rig.wait_jobs(1)
    assert job.signature.size == len(old)
    slowly(target, new)  # rewritten in place (truncated, written)
    wait_for(
        lambda: rig.jobs()[0].signature == FileSignature.of(os.stat(target)),
        30,
        "the job to take the new version",
    )
    settled(rig, {"take.wav": new})
    assert rig.jobs()[0].id == job.id and rig.scheduler.queue.order() == [job.id]


def test_a_file_replaced_by_rename_while_queued_keeps_its_place(native, tmp_path):
    rig = native
    first, second = audio(".wav", 22, tmp_path), audio(".wav", 23, tmp_path)
    (rig.inbox / "a.wav").write_bytes(first)
    rig.wait_jobs(1)
    (rig.inbox / "b.wav").write_bytes(second)
    rig.wait_jobs(2)
    order = rig.scheduler.queue.order()
    newer = audio(".wav", 24, tmp_path) * 3
    staged = rig.inbox / ".a.wav.new"  # an editor's save: temp, then rename
    staged.write_bytes(newer)
    os.replace(staged, rig.inbox / "a.wav")
    wait_for(
        lambda: rig.jobs_by_path()["a.wav"][0].signature.size == len(newer),
        30,
        "the job to take the new version",
    )
    settled(rig, {"a.wav": newer, "b.wav": second})
    assert rig.scheduler.queue.order() == order


# ---------------------------------------------------------------- replaced while running


@pytest.mark.slow
def test_a_file_replaced_while_running_is_cancelled_and_the_new_version_separated(
    make_settings, service_factory, tmp_path
):
    settings = make_settings(api={"enabled": False})
    service, jobs = service_factory(settings)
    target = settings.paths.inbox / "take.wav"
    write_song(tmp_path / "old.wav", 20.0, seed=30)
    os.rename(tmp_path / "old.wav", target)
    wait_for(
        lambda: any(j.state is JobState.SEPARATING for j in jobs.jobs()),
        60,
        "the first version to be separated",
    )
    newer = write_song(tmp_path / "new.wav", 2.0, seed=31)
    digest = hashlib.sha256(newer.read_bytes()).hexdigest()
    os.replace(newer, target)  # a newer version saved over it
    finished = jobs.wait_final(2)
    states = {j.state: j for j in finished}
    assert sorted(states) == sorted([JobState.CANCELLED, JobState.DONE])
    assert states[JobState.CANCELLED].error == CHANGED_WHILE_RUNNING
    assert outbox_entries(settings.paths.outbox) == {"take"}
    manifest = json.loads((settings.paths.outbox / "take" / "stemdeck.json").read_text())
    assert manifest["input"]["sha256"] == digest
    assert (
        hashlib.sha256((settings.paths.processed / "take.wav").read_bytes()).hexdigest() == digest
    )
    assert not target.exists() and len(jobs.jobs()) == 2


def replace_atomically(path: Path, seconds: float, seed: int, scratch: Path) -> None:
    """Save a new version the way editors and sync clients do: a new file renamed over."""
    tmp = scratch / ("new-" + path.name)
    write_song(tmp, seconds, seed=seed)
    os.replace(tmp, path)


@pytest.mark.slow
def test_a_new_version_saved_while_its_job_fails_stays_in_the_inbox_and_is_separated(
    make_settings, service_factory, tmp_path: Path
) -> None:
    # no second attempt after a machine fault: the worker's death fails the job
    settings = make_settings(
        watch={"rescan_seconds": 0}, separation={"shifts": 4}, queue={"worker_retries": 0}
    )
    service, jobs = service_factory(settings)
    song = settings.paths.inbox / "song.wav"
    write_song(song, 12.0, seed=1)
    first = wait_for(
        lambda: next(
            (j for j in jobs.jobs() if j.state is JobState.SEPARATING and j.progress > 0.06), None
        ),
        60,
        "the song to be separating",
    )
    replace_atomically(song, 3.0, seed=2, scratch=tmp_path)
    os.kill(service.client.pid, signal.SIGTERM)  # the old version's job fails

    wait_for(
        lambda: jobs.latest.get(first.id) and jobs.latest[first.id].state.is_final,
        60,
        "the first job to fail",
    )
    failed = jobs.latest[first.id]
    assert failed.state is JobState.FAILED
    assert not (settings.paths.failed / "song.wav").exists()  # the new version was not moved
    report = (settings.paths.failed / "song.wav.error.txt").read_text()
    assert "replaced by a new version" in report and "stays in the inbox" in report
    # the new version is separated as a new job at once (no rescan is configured)
    done = wait_for(
        lambda: [j for j in jobs.final() if j.state is JobState.DONE],
        60,
        "the new version to be separated",
    )
    assert done[0].id != first.id
    manifest = json.loads((Path(done[0].output) / "stemdeck.json").read_text())
    assert abs(manifest["input"]["duration"] - 3.0) < 0.01
    assert (settings.paths.processed / "song.wav").is_file()


@pytest.mark.slow
def test_a_file_changed_while_its_job_runs_is_separated_again_without_a_rescan(
    make_settings, service_factory, tmp_path: Path
) -> None:
    settings = make_settings(watch={"rescan_seconds": 0}, separation={"shifts": 3})
    service, jobs = service_factory(settings)
    song = settings.paths.inbox / "song.wav"
    write_song(song, 8.0, seed=1)
    first = wait_for(
        lambda: next((j for j in jobs.jobs() if j.state is JobState.SEPARATING), None),
        60,
        "the song to be separating",
    )
    replace_atomically(song, 2.0, seed=2, scratch=tmp_path)

    finished = jobs.wait_final(2, timeout=120)
    by_id = {j.id: j for j in finished}
    # changed while running: the run is cancelled and the new content queued
    assert by_id[first.id].state is JobState.CANCELLED
    assert by_id[first.id].error == CHANGED_WHILE_RUNNING
    second = next(j for j in finished if j.id != first.id)
    assert second.state is JobState.DONE
    manifest = json.loads((Path(second.output) / "stemdeck.json").read_text())
    assert round(manifest["input"]["duration"]) == 2


def test_a_file_renamed_into_place_waits_the_short_settle_not_the_full_one(make_settings, tmp_path):
    """A browser or sync client renames its finished file into place: the writer has said it
    is done, so the file waits the close-after-write second, not `settle_seconds` (a
    minute here, longer than the wait below)."""
    data = audio(".mp3", 9, tmp_path)
    settings = make_settings(
        watch={"mode": "native", "settle_seconds": 60.0}, api={"enabled": False}
    )
    with IntakeRig(settings) as rig:
        part = rig.inbox / "renamed.mp3.part"
        with open(part, "wb") as handle:  # written and closed under the temporary name
            handle.write(data)
        os.replace(part, rig.inbox / "renamed.mp3")
        jobs = rig.wait_jobs(1, timeout=20.0)
    assert [Path(job.source).name for job in jobs] == ["renamed.mp3"]
    assert jobs[0].signature is not None and jobs[0].signature.size == len(data)
