"""Playlist links (`links.playlists = true`): one job per entry, in playlist order, each an
ordinary link job — limited, cancelled with the link file, resumed after a restart.

The playlists are XSPF lists and HTML pages of <audio> tags served by the loopback server of
tests/links/test_links.py: yt-dlp's generic extractor lists both offline. Every URL is on 127.0.0.1.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path, PurePosixPath
from typing import Iterator

import pytest

from stemdeck_watch.cli import status
from stemdeck_watch.links.linkfile import read_link
from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.core.jobs import FileSignature, Job, JobKind, JobState, PlaylistRef
from stemdeck_watch.core.errors import DownloadError
from stemdeck_watch.links import fetch, listing
from stemdeck_watch.engine.playlists import Playlists
from stemdeck_watch.util.synth import write_song

from support.helpers import open_scheduler, outbox_entries, run_restore, wait_for

from support.media import MediaServer, url_file


class PlaylistServer(MediaServer):
    """The media server, plus playlists: `lists[name]` is served as XSPF or HTML."""

    def __init__(self, folder: Path):
        self.lists: dict[str, bytes] = {}
        super().__init__(folder)

    def handle(self, h) -> None:
        name = h.path.lstrip("/").split("?")[0]
        body = self.lists.get(name)
        if body is None:
            super().handle(h)
            return
        self._head(h, "application/xspf+xml" if name.endswith(".xspf") else "text/html", len(body))
        if h.command != "HEAD":
            h.wfile.write(body)

    def xspf(self, name: str, tracks: list[tuple[str, str, float | None]]) -> str:
        """An XSPF playlist of (file, title, seconds or None) served as `name`; its URL."""
        items = "".join(
            f"<track><location>{file}</location><title>{title}</title>"
            + (f"<duration>{int(seconds * 1000)}</duration>" if seconds else "")
            + "</track>"
            for file, title, seconds in tracks
        )
        self.lists[name] = (
            '<?xml version="1.0" encoding="UTF-8"?><playlist version="1" '
            f'xmlns="http://xspf.org/ns/0/"><title>Mix</title><trackList>{items}</trackList>'
            "</playlist>"
        ).encode()
        return self.url(name)


@pytest.fixture
def media(tmp_path: Path) -> Iterator[PlaylistServer]:
    folder = tmp_path / "served"
    for i in range(3):
        write_song(folder / f"s{i}.wav", 1.5, seed=10 + i)
    write_song(folder / "long.wav", 12.0, seed=4)
    server = PlaylistServer(folder)
    yield server
    server.close()


def downloads(media: MediaServer, file: str) -> int:
    """How often the file itself was fetched (yt-dlp probes a direct link once, then gets it)."""
    return media.requests.count(f"/{file}")


# ------------------------------------------------------------------ listing (no service)


def list_playlist(url: str, links, tmp_path: Path):
    return fetch.download(
        url,
        tmp_path / "dl",
        links,
        control=JobControl("listing"),
        on_progress=lambda _v: None,
        link_name="Mix.url",
        expand=True,
    )


def test_an_xspf_list_and_an_html_page_are_listed_in_order_without_downloading(
    settings, media: PlaylistServer, tmp_path: Path
) -> None:
    url = media.xspf(
        "mix.xspf", [("s0.wav", "Alpha", 1.5), ("s1.wav", "Beta", None), ("s2.wav", "Gam/ma", None)]
    )
    found = list_playlist(url, settings.links, tmp_path)
    assert isinstance(found, listing.Playlist)
    assert [e.title for e in found.entries] == ["Alpha", "Beta", "Gam_ma"]  # sanitised
    assert [e.url for e in found.entries] == [media.url(f"s{i}.wav") for i in range(3)]
    assert [e.duration for e in found.entries] == [1.5, None, None]
    assert found.total == 3 and found.title == "Mix"

    media.lists["page.htm"] = (
        b"<html><head><title>Live set</title></head><body>"
        b'<audio src="s0.wav"></audio><audio src="s1.wav"></audio>'
        b"</body></html>"
    )
    page = list_playlist(media.url("page.htm"), settings.links, tmp_path)
    assert isinstance(page, listing.Playlist)
    assert [e.url for e in page.entries] == [media.url("s0.wav"), media.url("s1.wav")]
    assert page.title == "Live set"
    assert not any(downloads(media, f"s{i}.wav") for i in range(3))  # listed, not fetched


def test_a_playlist_longer_than_max_entries_is_cut_and_says_so(settings, media, tmp_path):
    url = media.xspf("big.xspf", [(f"s{i % 3}.wav", f"Song {i}", None) for i in range(7)])
    links = dataclasses.replace(settings.links, max_entries=4)
    found = list_playlist(url, links, tmp_path)
    assert [e.title for e in found.entries] == ["Song 0", "Song 1", "Song 2", "Song 3"]
    assert found.total == 7


def test_a_playlist_of_one_and_a_plain_file_are_plain_downloads(settings, media, tmp_path):
    one = list_playlist(
        media.xspf("one.xspf", [("s1.wav", "Only", None)]), settings.links, tmp_path
    )
    assert isinstance(one, fetch.Downloaded) and one.title == "Only" and one.path.is_file()
    plain = list_playlist(media.url("s2.wav"), settings.links, tmp_path / "b")
    assert isinstance(plain, fetch.Downloaded) and plain.title == "s2"


def test_an_entry_longer_than_the_playlist_says_fails_before_its_download(
    settings, media, tmp_path
) -> None:
    links = dataclasses.replace(settings.links, max_duration=5)
    ref = PlaylistRef("p1", "Mix", 2, 3, duration=12.0)
    with pytest.raises(DownloadError, match="links.max_duration"):
        fetch.download(
            media.url("long.wav"),
            tmp_path / "dl",
            links,
            control=JobControl("t"),
            on_progress=lambda _v: None,
            link_name="02 - Long.url",
            playlist=ref,
            title="Long",
        )
    assert downloads(media, "long.wav") == 0


# ------------------------------------------------------------------ through the service


UNDER_WAY = (JobState.DOWNLOADING, JobState.DECODING, JobState.SEPARATING)  # not yet out


def entries(jobs: list[Job]) -> list[Job]:

    found = [j for j in jobs if j.playlist is not None and not j.playlist.is_link]
    return sorted(found, key=lambda j: j.playlist.entry)


def playlist_link(jobs: list[Job]) -> Job:
    return next(j for j in jobs if j.playlist is not None and j.playlist.is_link)


def manifest_of(folder: str) -> dict:
    return json.loads((Path(folder) / "stemdeck.json").read_text())


@pytest.mark.slow
def test_a_playlist_becomes_one_song_per_entry_in_order(
    make_settings, service_factory, media: PlaylistServer
) -> None:
    settings = make_settings(links={"playlists": True})
    service, jobs = service_factory(settings)
    url = media.xspf(
        "mix.xspf", [("s0.wav", "Alpha", None), ("s1.wav", "Beta", None), ("s2.wav", "Gamma", None)]
    )
    url_file(settings.paths.inbox, "My Mix.url", url)
    # three entries and the link's own job
    done = wait_for(lambda: len(jobs.final()) == 4 and jobs.final(), 120, "the playlist")
    songs = entries(done)
    assert [(j.name, j.state, j.kind) for j in songs] == [
        (n, JobState.DONE, JobKind.LINK) for n in ("Alpha", "Beta", "Gamma")
    ]
    assert [j.finished_at for j in songs] == sorted(j.finished_at for j in songs)  # in order
    group = settings.paths.outbox / "My Mix"
    assert outbox_entries(settings.paths.outbox) == {"My Mix"}
    assert sorted(p.name for p in group.iterdir()) == ["Alpha", "Beta", "Gamma"]
    for number, job in enumerate(songs, 1):
        link = manifest_of(job.output)["link"]
        assert link["playlist"] == {"name": "My Mix", "entry": number, "entries": 3}
        assert link["url"] == media.url(f"s{number - 1}.wav")
    assert all(downloads(media, f"s{i}.wav") == 2 for i in range(3))  # probe + get, once each

    link_job = playlist_link(done)
    assert link_job.state is JobState.DONE and link_job.output == str(group)
    assert link_job.error == "3 of 3 entries published"
    assert (settings.paths.processed / "My Mix.url").is_file()  # the link file, at the end
    assert sorted(p.name for p in (settings.paths.processed / "My Mix").iterdir()) == [
        "01 - Alpha.url",
        "02 - Beta.url",
        "03 - Gamma.url",
    ]
    snapshot = service.scheduler.snapshot()
    shown = {j["name"]: j["playlist"] for j in snapshot["jobs"]}
    assert shown["Beta"] == {
        "id": link_job.id,
        "name": "My Mix",
        "entry": 2,
        "entries": 3,
        "listed": None,
    }
    assert "Beta (2/3 of My Mix)" in status.render(snapshot)
    wait_for(lambda: not any(settings.paths.scratch.rglob("*")), 10, "scratch to be empty")
    assert not (settings.paths.state / "playlists" / link_job.id).exists()
    # removing the playlist's job deletes its entries' folders, then the emptied group
    assert service.scheduler.remove(link_job.id) == []
    assert outbox_entries(settings.paths.outbox) == set()


@pytest.mark.slow
def test_an_entry_over_the_limits_fails_alone(make_settings, service_factory, media) -> None:
    settings = make_settings(links={"playlists": True, "max_duration": 5})
    service, jobs = service_factory(settings)
    # "Long" gives no length in the list (found after its download); "Known" does (refused
    # before any byte is fetched)
    url = media.xspf(
        "mix.xspf",
        [
            ("s0.wav", "Alpha", None),
            ("long.wav", "Long", None),
            ("s2.wav", "Known", 12.0),
            ("s1.wav", "Beta", None),
        ],
    )
    url_file(settings.paths.inbox, "Mix.url", url)
    done = wait_for(lambda: len(jobs.final()) == 5 and jobs.final(), 120, "the playlist")
    songs = {j.name: j for j in entries(done)}
    assert {n: j.state for n, j in songs.items()} == {
        "Alpha": JobState.DONE,
        "Long": JobState.FAILED,
        "Known": JobState.FAILED,
        "Beta": JobState.DONE,
    }
    assert "links.max_duration" in songs["Long"].error
    assert "links.max_duration" in songs["Known"].error
    assert downloads(media, "s2.wav") == 0  # "Known" was never fetched
    failed = settings.paths.failed / "Mix"
    assert (failed / "02 - Long.url").is_file()  # each failed entry alone, with its report
    assert "links.max_duration" in (failed / "02 - Long.url.error.txt").read_text()
    link_job = playlist_link(done)
    assert link_job.state is JobState.DONE and link_job.error.startswith(
        "2 of 4 entries published, 2 failed (2. Long: "
    )
    assert sorted(p.name for p in (settings.paths.outbox / "Mix").iterdir()) == ["Alpha", "Beta"]


def until_slow_runs(make_settings, service_factory, media):
    """A playlist Alpha, Slow (a 12 s song, downloaded slowly), Beta, run until Alpha is
    published and Slow is under way (downloading, or separating if its download was done
    ahead); returns (settings, service, its job log, the link file). Alpha may publish behind
    Slow: until it is done, a cancel or a stop still reaches it."""
    settings = make_settings(links={"playlists": True})
    service, jobs = service_factory(settings)
    url = media.xspf(
        "mix.xspf",
        [("s0.wav", "Alpha", None), ("slow-long.wav", "Slow", None), ("s1.wav", "Beta", None)],
    )
    link = url_file(settings.paths.inbox, "Mix.url", url)

    def slow_runs() -> bool:
        states = {j.name: j.state for j in jobs.jobs()}
        return states.get("Alpha") is JobState.DONE and states.get("Slow") in UNDER_WAY

    wait_for(slow_runs, 60, "Alpha done and Slow to run")
    return settings, service, jobs, link


@pytest.mark.slow
def test_deleting_the_link_cancels_the_entries_not_yet_done(
    make_settings, service_factory, media
) -> None:
    settings, service, jobs, link = until_slow_runs(make_settings, service_factory, media)
    link.unlink()
    done = wait_for(lambda: len(jobs.final()) == 4 and jobs.final(), 30, "every job to end")
    states = {j.name: j.state for j in entries(done)}
    assert states == {
        "Alpha": JobState.DONE,
        "Slow": JobState.CANCELLED,
        "Beta": JobState.CANCELLED,
    }
    assert playlist_link(done).state is JobState.CANCELLED
    # what was published stays; nothing half-written anywhere
    assert sorted(p.name for p in (settings.paths.outbox / "Mix").iterdir()) == ["Alpha"]
    assert outbox_entries(settings.paths.outbox) == {"Mix"}
    wait_for(lambda: not any(settings.paths.scratch.rglob("*")), 10, "scratch to be empty")
    assert not any(p.name.endswith(".part") for p in settings.paths.state.rglob("*"))
    assert not (settings.paths.processed / "Mix.url").exists()  # the user took it away
    assert service.queue.order() == []


@pytest.mark.slow
def test_a_restart_mid_playlist_does_the_remaining_entries_once(
    make_settings, service_factory, media
) -> None:
    settings, service, jobs, _link = until_slow_runs(make_settings, service_factory, media)
    service.shutdown()  # Slow is cut off; Beta and the link's job wait

    service, jobs = service_factory(settings)
    order = [service.registry.get(i) for i in service.queue.order()]
    assert [j.name for j in order] == ["Slow", "Beta", "Mix"]  # resumed in playlist order
    service.scheduler.start()  # restored jobs wait for Start
    done = wait_for(lambda: len(jobs.final()) == 3 and jobs.final(), 120, "the rest")
    assert {j.name: j.state for j in done} == {
        "Slow": JobState.DONE,
        "Beta": JobState.DONE,
        "Mix": JobState.DONE,
    }
    assert sorted(p.name for p in (settings.paths.outbox / "Mix").iterdir()) == [
        "Alpha",
        "Beta",
        "Slow",
    ]  # Alpha once: never separated again
    assert downloads(media, "s0.wav") == 2  # Alpha: fetched once (probe + get), never again
    assert playlist_link(done).error == "3 of 3 entries published"


@pytest.mark.slow
def test_without_playlists_a_playlist_link_gives_its_first_item(
    make_settings, service_factory, media
) -> None:
    settings = make_settings()  # links.playlists = false
    service, jobs = service_factory(settings)
    url = media.xspf("mix.xspf", [("s0.wav", "Alpha", None), ("s1.wav", "Beta", None)])
    url_file(settings.paths.inbox, "Mix.url", url)
    job = jobs.wait_final(1)[0]
    assert job.state is JobState.DONE and job.name == "Alpha" and job.playlist is None
    assert outbox_entries(settings.paths.outbox) == {"Alpha"}
    assert downloads(media, "s1.wav") == 0
    assert (settings.paths.processed / "Mix.url").is_file()


LONG_TITLE = "夜明けのメロディー" * 11  # 99 characters, 297 bytes: more than a file name holds


@pytest.mark.slow
def test_links_with_a_long_japanese_title_are_published(
    make_settings, service_factory, media: PlaylistServer
) -> None:
    settings = make_settings()  # links.playlists = false: the list's first item, by its title
    _service, jobs = service_factory(settings)
    for number in (0, 1):  # two songs of one title: the second folder gets a number
        url = media.xspf(f"jp{number}.xspf", [(f"s{number}.wav", LONG_TITLE, None)])
        url_file(settings.paths.inbox, f"jp{number}.url", url)
        jobs.wait_final(number + 1)
    done = jobs.final()
    assert [j.state for j in done] == [JobState.DONE] * 2, [j.error for j in done]
    name = done[0].name
    assert LONG_TITLE.startswith(name) and len(name) >= 60
    assert outbox_entries(settings.paths.outbox) == {name, f"{name} (2)"}


@pytest.mark.slow
def test_a_playlist_of_long_japanese_titles_publishes_every_entry(
    make_settings, service_factory, media: PlaylistServer
) -> None:
    settings = make_settings(links={"playlists": True})
    _service, jobs = service_factory(settings)
    url = media.xspf(
        "jp.xspf",
        [("s0.wav", f"第一曲 {LONG_TITLE}", None), ("s1.wav", f"第二曲 {LONG_TITLE}", None)],
    )
    url_file(settings.paths.inbox, "夜明け.url", url)
    done = wait_for(lambda: len(jobs.final()) == 3 and jobs.final(), 120, "the playlist")
    assert [j.state for j in done] == [JobState.DONE] * 3, [j.error for j in done]
    published = sorted(p.name for p in (settings.paths.outbox / "夜明け").iterdir())
    assert [name[:4] for name in published] == ["第一曲 ", "第二曲 "]
    assert (settings.paths.processed / "夜明け.url").is_file()


# ------------------------------------------------------------------ the queue side (no worker)


def expand_mix(settings, count: int = 3):
    """A playlist link queued and taken, then expanded into `count` entries, with a file
    queued behind it; returns (scheduler, link job, entry ids, file job id)."""
    scheduler = open_scheduler(settings)
    inbox = settings.paths.inbox
    link = url_file(inbox, "Mix.url", "http://127.0.0.1:9/mix.xspf")
    linked = scheduler.submit_file(link, PurePosixPath("Mix.url"), FileSignature.of(link.stat()))
    later = inbox / "later.wav"
    later.write_bytes(b"RIFF....WAVE")
    behind = scheduler.submit_file(
        later, PurePosixPath("later.wav"), FileSignature.of(later.stat())
    )
    control = scheduler.next_job(0)
    assert control is not None and control.job_id == linked.id
    assert scheduler.queue.set_running(control)
    found = listing.Playlist(
        url="http://127.0.0.1:9/mix.xspf",
        title="Mix",
        extractor="Generic",
        entries=tuple(
            listing.Entry(f"http://127.0.0.1:9/s{i}.wav", f"Song {i}", None) for i in range(count)
        ),
        total=count + 2,
    )
    Playlists(scheduler).expand(linked, found, control)
    scheduler.queue.finish(control)
    ids = scheduler.queue.order()[:count]
    return scheduler, scheduler.registry.get(linked.id), ids, behind.id


def test_entries_are_queued_ahead_of_their_link_and_survive_a_restart(settings) -> None:
    scheduler, link, ids, behind = expand_mix(settings)
    assert scheduler.queue.order() == [*ids, link.id, behind]
    songs = [scheduler.registry.get(i) for i in ids]
    assert [(j.name, j.kind, j.playlist.entry, j.playlist.entries) for j in songs] == [
        (f"Song {i}", JobKind.LINK, i + 1, 3) for i in range(3)
    ]
    assert read_link(Path(songs[1].source)) == "http://127.0.0.1:9/s1.wav"
    assert songs[1].rel_path == "Mix/02 - Song 1.url"
    assert link.playlist == PlaylistRef(link.id, "Mix", 0, 3, listed=5)
    assert link.state is JobState.QUEUED
    assert status.label(link.to_status()) == "Mix (playlist, 3 entries)"
    scheduler.registry.close()

    restored, count = run_restore(settings)  # the order and every entry come back
    assert count == 5 and restored.queue.order() == [*ids, link.id, behind]
    restored.registry.close()


def test_cancelling_the_playlist_cancels_its_entries_and_nothing_else(settings) -> None:
    scheduler, link, ids, behind = expand_mix(settings)
    scheduler.cancel_job(link.id)
    assert [scheduler.registry.get(i).state for i in [*ids, link.id]] == [JobState.CANCELLED] * 4
    assert scheduler.queue.order() == [behind]
    scheduler.registry.close()


def test_the_link_settles_after_its_entries_with_a_summary(settings) -> None:
    scheduler, link, ids, behind = expand_mix(settings)
    playlists = Playlists(scheduler)
    scheduler.queue.move(ids[2], after=link.id)  # an entry moved behind the playlist's end
    for i in [*ids[:2], link.id]:  # the first two were taken, and now the link's job is
        scheduler.queue.discard(i)
    control = JobControl(link.id)
    assert playlists.finish(link, control) is None  # it waits behind the moved entry
    assert scheduler.queue.order() == [ids[2], link.id, behind]

    scheduler.update(ids[0], state=JobState.DONE)
    scheduler.update(ids[1], state=JobState.FAILED, error="boom")
    scheduler.queue.discard(ids[2])
    scheduler.update(ids[2], state=JobState.CANCELLED)
    output, note = playlists.finish(link, control)
    assert output == settings.paths.outbox / "Mix"
    assert note == (
        "1 of 3 entries published, 1 failed (2. Song 1: boom), 1 cancelled, "
        "2 more entries left out (links.max_entries = 50)"
    )
    assert not playlists.folder(link.id).exists()
    scheduler.registry.close()
