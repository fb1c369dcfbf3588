"""Links as jobs: link files read, downloaded with yt-dlp from a loopback server, named by
their title, limited, cancelled, and prefetched while the worker separates another song.

Every URL here is on 127.0.0.1; nothing leaves the machine.
"""

from __future__ import annotations

import json
import plistlib
from pathlib import Path
from typing import Iterator

import pytest

from stemdeck_watch.links.linkfile import LinkError, read_link
from stemdeck_watch.core.jobs import JobKind, JobState
from stemdeck_watch.links import fetch
from stemdeck_watch.stages import naming
from stemdeck_watch.util.synth import write_song

from support.helpers import SeparationGate, outbox_entries, wait_for
from support.media import MediaServer, url_file

# ------------------------------------------------------------------ link files


def desktop_file(folder: Path, name: str, url: str, kind: str = "Link") -> Path:
    path = folder / name
    path.write_text(f"[Desktop Entry]\nVersion=1.0\nType={kind}\nName=x\nURL={url}\n")
    return path


def webloc_file(folder: Path, name: str, url: str, binary: bool = False) -> Path:
    path = folder / name
    fmt = plistlib.FMT_BINARY if binary else plistlib.FMT_XML
    path.write_bytes(plistlib.dumps({"URL": url}, fmt=fmt))
    return path


def test_all_three_link_formats_are_read(tmp_path: Path) -> None:
    url = "https://example.org/My%20Song.mp3?x=1&y=%41"
    assert read_link(url_file(tmp_path, "a.url", url)) == url  # %20 survives (no interpolation)
    assert read_link(desktop_file(tmp_path, "b.desktop", url)) == url
    assert read_link(webloc_file(tmp_path, "c.webloc", url)) == url
    assert read_link(webloc_file(tmp_path, "d.webloc", url, binary=True)) == url
    assert (tmp_path / "d.webloc").read_bytes().startswith(b"bplist00")


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda d: url_file(d, "s.url", "file:///etc/passwd"), "not a web address"),
        (lambda d: url_file(d, "s.url", "javascript:alert(1)"), "not a web address"),
        (lambda d: url_file(d, "s.url", "data:audio/wav;base64,AAAA"), "not a web address"),
        (lambda d: url_file(d, "s.url", "ftp://example.org/a.mp3"), "not a web address"),
        (lambda d: url_file(d, "s.url", ""), "holds no URL"),
        (lambda d: url_file(d, "s.url", "https://"), "not a valid URL (it names no host)"),
        (lambda d: url_file(d, "s.url", "http://[::1/x"), "not a valid URL (Invalid IPv6"),
        (lambda d: url_file(d, "s.url", "http://a.org:99999/x"), "not a valid URL (Port"),
        (lambda d: url_file(d, "s.url", "http://[zz]/x"), "not a valid URL ('zz'"),
        (
            lambda d: desktop_file(d, "s.desktop", "https://x.org/a", kind="Application"),
            "not a link (Type=Link)",
        ),
        (lambda d: webloc_file(d, "s.webloc", "file:///tmp/x"), "not a web address"),
    ],
)
def test_refused_links_name_the_file_and_why(tmp_path: Path, make, expected: str) -> None:
    path = make(tmp_path)
    with pytest.raises(LinkError) as error:
        read_link(path)
    assert expected in str(error.value) and path.name in str(error.value)


def test_a_malformed_url_is_a_clear_error_whoever_gives_it() -> None:
    """The one check of a URL from outside answers every malformed address with a reason,
    never an exception of the URL parser: a link file's, the API's, a playlist entry's."""
    from stemdeck_watch.links.linkfile import check_url
    from stemdeck_watch.links.listing import _entry_url

    for url in ("http://[::1/x", "http://a.org:port/x", "http://a.org/\ud800", "http://@/x"):
        with pytest.raises(LinkError) as error:
            check_url(url, "s.url")
        assert "the link in s.url is not a valid URL" in str(error.value)
        assert str(error.value).endswith("fix or delete the file")
        assert (
            _entry_url({"url": url, "webpage_url": "https://a.org/ok"}, "p") == "https://a.org/ok"
        )


def test_garbage_named_like_a_link_file_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    big = tmp_path / "huge.url"
    big.write_bytes(b"\x00garbage" * (10 * 1024 * 1024 // 8))
    with pytest.raises(LinkError, match="huge.url is not a link file"):
        read_link(big)
    broken = tmp_path / "broken.webloc"
    broken.write_bytes(b"<plist>not closed")
    with pytest.raises(LinkError, match="broken.webloc is not a readable .webloc"):
        read_link(broken)


def test_titles_become_safe_folder_names() -> None:
    assert naming.song_name({"title": "../../etc/passwd"}, "x") == "_.._etc_passwd"
    assert naming.song_name({"title": ".hidden"}, "x") == "hidden"
    assert naming.song_name({"title": "Song", "artist": "Band"}, "x") == "Band - Song"
    assert naming.song_name({"title": "CON"}, "x") == "_CON"
    assert naming.song_name({"title": "a\x00b\nc" + "z" * 300}, "x").startswith("a b c")
    assert len(naming.song_name({"title": "z" * 300}, "x")) == naming.MAX_NAME_BYTES
    assert naming.song_name({"title": "..."}, "fallback") == "fallback"


def test_a_long_japanese_title_fits_a_file_name_with_room_for_a_number(tmp_path: Path) -> None:
    title = "夜明けのメロディー" * 11  # 99 characters, 297 bytes: more than a name may hold
    name = naming.song_name({"title": title}, "x")
    assert title.startswith(name) and len(name) >= 60
    assert len(name.encode()) <= naming.MAX_NAME_BYTES
    (tmp_path / f"{name} (12)").mkdir()  # what publish makes of a taken name
    (tmp_path / f"001 - {name}.url.error.txt").write_text("")  # a failed playlist entry
    accented = naming.song_name({"title": "q\u0301" * 150}, "x")  # q́ has no composed form
    assert accented.endswith("q\u0301") and len(accented.encode()) <= naming.MAX_NAME_BYTES


# ------------------------------------------------------------------ a loopback media server


@pytest.fixture
def media(tmp_path: Path) -> Iterator[MediaServer]:
    folder = tmp_path / "served"
    write_song(folder / "song.wav", 2.0, seed=1)
    write_song(folder / "song.mp3", 2.0, seed=2)
    write_song(folder / "song.m4a", 2.0, seed=3)
    write_song(folder / "long.wav", 12.0, seed=4)
    server = MediaServer(folder)
    yield server
    server.close()


# ------------------------------------------------------------------ through the service


def manifest_of(folder: str) -> dict:
    return json.loads((Path(folder) / "stemdeck.json").read_text())


@pytest.mark.slow
def test_links_in_every_format_become_stems_named_by_their_title(
    make_settings, service_factory, media: MediaServer
) -> None:
    settings = make_settings()
    service, jobs = service_factory(settings)
    inbox = settings.paths.inbox
    url_file(inbox, "one.url", media.url("song.wav"))
    webloc_file(inbox, "two.webloc", media.url("song.mp3"), binary=True)
    desktop_file(inbox, "three.desktop", media.url("song.m4a"))
    done = jobs.wait_final(3)
    assert sorted(j.state for j in done) == [JobState.DONE] * 3, [j.error for j in done]
    assert all(j.kind is JobKind.LINK for j in done)
    for job in done:
        manifest = manifest_of(job.output)
        assert manifest["link"]["url"].startswith("http://127.0.0.1:")
        assert manifest["link"]["extractor"].lower() == "generic"
        assert abs(manifest["input"]["duration"] - 2.0) < 0.1
    names = sorted(outbox_entries(settings.paths.outbox))
    assert names == ["song", "song (2)", "song (3)"]  # one title thrice: numbered, never lost
    assert sorted(p.name for p in settings.paths.processed.iterdir()) == [
        "one.url",
        "three.desktop",
        "two.webloc",
    ]
    assert not any(settings.paths.scratch.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize(
    "target, reason",
    [
        ("missing.wav", "the page no longer exists (HTTP 404)"),
        ("page.html", "no audio or video"),
        ("to-file", "local file (file: URL), which is never fetched"),
    ],
)
def test_a_link_that_cannot_be_downloaded_fails_with_a_reason(
    make_settings, service_factory, media: MediaServer, target: str, reason: str
) -> None:
    settings = make_settings()
    service, jobs = service_factory(settings)
    url_file(settings.paths.inbox, "bad.url", media.url(target))
    job = jobs.wait_final(1)[0]
    assert job.state is JobState.FAILED and reason in job.error, job.error
    report = (settings.paths.failed / "bad.url.error.txt").read_text()
    assert "bad.url" in report.splitlines()[2]
    assert (settings.paths.failed / "bad.url").is_file()
    assert not any(settings.paths.scratch.iterdir())


@pytest.mark.slow
def test_limits_fail_the_job_with_a_reason(make_settings, service_factory, media, monkeypatch):
    settings = make_settings(links={"max_filesize": 100_000, "max_duration": 5})
    service, jobs = service_factory(settings)
    url_file(settings.paths.inbox, "big.url", media.url("long.wav"))  # 12 s, ~2 MB
    job = jobs.wait_final(1)[0]
    assert job.state is JobState.FAILED and "links.max_filesize" in job.error, job.error
    service.shutdown()

    settings = make_settings(links={"max_duration": 5})
    service, jobs = service_factory(settings)
    url_file(settings.paths.inbox, "long.url", media.url("octet-long.wav"))  # no length known
    job = wait_for(lambda: [j for j in jobs.final() if j.name != "big"], 60, "the long link")[0]
    assert job.state is JobState.FAILED and "links.max_duration" in job.error, job.error


@pytest.mark.slow
def test_a_stalled_download_fails_instead_of_hanging_the_queue(
    make_settings, service_factory, media, monkeypatch
) -> None:
    monkeypatch.setattr(fetch, "STALL_TIMEOUT", 1.0)
    settings = make_settings()
    service, jobs = service_factory(settings)
    url_file(settings.paths.inbox, "stuck.url", media.url("stall-long.wav"))
    job = jobs.wait_final(1, timeout=60)[0]
    assert job.state is JobState.FAILED and "stalled" in job.error, job.error
    write_song(settings.paths.inbox / "next.wav", 1.5)  # the queue goes on
    assert wait_for(lambda: [j for j in jobs.final() if j.state is JobState.DONE], 60, "next")


@pytest.mark.slow
def test_deleting_the_link_file_stops_its_download_within_a_second(
    make_settings, service_factory, media
):
    settings = make_settings()
    service, jobs = service_factory(settings)
    link = url_file(settings.paths.inbox, "slow.url", media.url("slow-long.wav"))
    wait_for(
        lambda: any(j.state is JobState.DOWNLOADING and j.progress > 0.01 for j in jobs.jobs()),
        30,
        "the download to be under way",
    )
    link.unlink()
    job = jobs.wait_final(1, timeout=10)[0]
    assert job.state is JobState.CANCELLED
    wait_for(lambda: not any(settings.paths.scratch.rglob("*")), 5, "scratch to be empty")
    assert not outbox_entries(settings.paths.outbox)


@pytest.mark.slow
def test_the_next_link_downloads_while_the_worker_separates(
    make_settings, service_factory, media
) -> None:
    settings = make_settings(separation={"shifts": 4})
    service, jobs = service_factory(settings)
    inbox = settings.paths.inbox
    service.scheduler.pause("user")
    write_song(inbox / "first.wav", 4.0)
    wait_for(lambda: len(service.queue.order()) == 1, 30, "the file queued")
    url_file(inbox, "a.url", media.url("song.wav"))
    wait_for(lambda: len(service.queue.order()) == 2, 30, "link a queued")
    url_file(inbox, "b.url", media.url("slow-long.wav"))
    wait_for(lambda: len(service.queue.order()) == 3, 30, "link b queued")
    first_id, a_id, b_id = service.queue.order()
    gate = SeparationGate(service.client, first_id)  # "first" separates until a is checked
    service.scheduler.start()

    # a downloads while "first" separates: its file is in scratch before a starts
    downloaded = settings.paths.scratch / a_id / "download"
    wait_for(
        lambda: any(downloaded.glob("media.*")) and not any(downloaded.glob("*.part")),
        60,
        "link a downloaded ahead",
    )
    assert jobs.latest[first_id].state is JobState.SEPARATING
    assert jobs.latest[a_id].state is JobState.QUEUED
    gate.open()

    # b is prepared while a separates; deleting b's link file cleans everything up
    wait_for(lambda: (settings.paths.scratch / b_id / "download").exists(), 60, "b prefetching")
    (inbox / "b.url").unlink()
    finished = jobs.wait_final(3)
    states = {j.id: j.state for j in finished}
    assert states[first_id] is JobState.DONE and states[a_id] is JobState.DONE
    assert states[b_id] is JobState.CANCELLED
    # a's prefetched download was used, not fetched again: yt-dlp's probe + one download
    assert media.requests.count("/song.wav") == 2, media.requests
    wait_for(lambda: not any(settings.paths.scratch.rglob("*")), 10, "scratch to be empty")
    assert outbox_entries(settings.paths.outbox) == {"first", "song"}


def test_a_password_in_an_address_yt_dlp_quotes_is_hidden_from_the_reason():
    """The reason is the job's error: it reaches notifications, the page and STATUS.txt."""
    said = fetch.explain(
        "ERROR: [generic] Unable to download https://me:s3cretpass@example.org/x?token=abc: boom",
        "song.url",
    )
    assert said.startswith("could not download song.url: [generic] Unable to download https://")
    assert "s3cretpass" not in said and "token=abc" not in said, said
