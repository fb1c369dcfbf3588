"""What a link may cost and where it may lead: a page that trickles or never ends, a cancel
while the page loads, and links to this machine or the local network (also after a redirect).

Every connection here goes to 127.0.0.1. Refusals of other addresses are driven through the
resolver seam (host names that only the test resolves) and happen before any connection: the
one place connections are made is wrapped to fail the test on anything but loopback.
"""

from __future__ import annotations

import dataclasses
import gzip
import ipaddress
import threading
from pathlib import Path
from typing import Iterator
from urllib.parse import parse_qs, urlsplit

import pytest

from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.core.errors import DownloadError
from stemdeck_watch.links import fetch, netguard
from stemdeck_watch.util.synth import write_song

from support.helpers import wait_for

from support.media import MediaServer, url_file

ENDLESS_LIMIT = 64 << 20  # the "endless" page ends here, so that a broken guard cannot fill memory


class HostileServer(MediaServer):
    """The media server, plus pages that trickle, never end, expand, or redirect."""

    def __init__(self, folder: Path):
        self.gone = threading.Event()  # set when the client closed a trickling connection
        self.sent = 0  # bytes of the endless page written
        super().__init__(folder)

    def handle(self, h) -> None:
        name = h.path.lstrip("/").split("?")[0]
        try:
            if name == "trickle.html":  # a page sent one byte at a time, for good
                self._open(h, "text/html")
                h.wfile.write(b"<html><head><title>")
                self._trickle(h)
            elif name.startswith("trickle-"):  # a song: a third, then a byte at a time
                data = (self.folder / name.removeprefix("trickle-")).read_bytes()
                self._head(h, "audio/wav", len(data))
                h.wfile.write(data[: len(data) // 3])
                self._trickle(h)
            elif name == "endless.html":
                self._open(h, "text/html")
                block = b"<p>" + b"x" * 65532
                while self.sent < ENDLESS_LIMIT and not self.release.is_set():
                    h.wfile.write(block)
                    self.sent += len(block)
            elif name == "bomb.html":  # 64 KB on the wire, 64 MB once decoded
                body = gzip.compress(b"\0" * (64 << 20), compresslevel=9)
                h.send_response(200)
                h.send_header("Content-Type", "text/html")
                h.send_header("Content-Encoding", "gzip")
                h.send_header("Content-Length", str(len(body)))
                h.end_headers()
                h.wfile.write(body)
            elif name == "hop":
                h.send_response(302)
                h.send_header("Location", parse_qs(urlsplit(h.path).query)["to"][0])
                h.end_headers()
            else:
                super().handle(h)
        except OSError:
            self.gone.set()

    def _open(self, h, content_type: str) -> None:
        h.send_response(200)
        h.send_header("Content-Type", content_type)
        h.end_headers()  # no length: the body ends when the connection does

    def _trickle(self, h) -> None:
        while not self.release.wait(0.2):
            h.wfile.write(b"a")
            h.wfile.flush()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[HostileServer]:
    folder = tmp_path / "served"
    write_song(folder / "song.wav", 2.0, seed=1)
    hostile = HostileServer(folder)
    yield hostile
    hostile.close()


class Seam(netguard.Resolver):
    """Names only this test resolves; addresses in `public` count as public (a loopback
    server standing in for a site on the internet)."""

    def __init__(self, names: dict[str, list[str]], public: set[str]):
        self.names, self.public, self.asked = names, public, []

    def addresses(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        return list(self.names[host])  # KeyError for any name the test did not give

    def is_public(self, address: str) -> bool:
        return address in self.public or super().is_public(address)


@pytest.fixture
def connections(monkeypatch) -> list[tuple]:
    """Every address a link connects to; anything but loopback fails the test unconnected."""
    made: list[tuple] = []
    real = netguard.connect_socket

    def loopback_only(sock, address) -> None:
        assert ipaddress.ip_address(address[0]).is_loopback, f"would connect to {address}"
        made.append(address)
        real(sock, address)

    monkeypatch.setattr(netguard, "connect_socket", loopback_only)
    return made


def fetch_link(url: str, links, tmp_path: Path, **kwargs):
    return fetch.download(
        url,
        tmp_path / "dl",
        links,
        control=JobControl("t"),
        on_progress=lambda _v: None,
        link_name="x.url",
        **kwargs,
    )


# ------------------------------------------------------------------ addresses


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.8.9.10",
        "10.0.0.5",
        "172.16.3.4",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "224.0.0.251",
        "239.255.255.250",
        "240.0.0.1",
        "255.255.255.255",
        "::1",
        "::",
        "fe80::1",
        "fe80::1%2",
        "fc00::5",
        "fd12:3456::1",
        "ff02::1",
        "ff0e::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.5",
        "2002:a00:5::1",
        "64:ff9b::a00:5",
        "not an address",
    ],
)
def test_this_machine_and_the_local_network_are_not_public(address: str) -> None:
    assert not netguard.is_public_address(address)


@pytest.mark.parametrize(
    "address", ["93.184.216.34", "8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"]
)
def test_addresses_on_the_internet_are_public(address: str) -> None:
    assert netguard.is_public_address(address)


def test_a_redirect_from_a_public_site_to_the_local_network_is_refused_before_connecting(
    settings, server: HostileServer, connections, tmp_path: Path
) -> None:
    port = server.httpd.server_address[1]
    seam = Seam({"music.example": ["127.0.0.1"], "nas.example": ["10.0.0.5"]}, public={"127.0.0.1"})
    links = dataclasses.replace(settings.links, allow_private=False)
    url = f"http://music.example:{port}/hop?to=http://nas.example:{port}/song.wav"
    with pytest.raises(DownloadError) as error:
        fetch_link(url, links, tmp_path, resolver=seam)
    message = str(error.value)
    assert "nas.example (10.0.0.5) is a private address" in message, message
    assert "links.allow_private" in message
    assert seam.asked == ["music.example", "nas.example"]
    assert connections == [("127.0.0.1", port)]  # the redirect was never followed
    assert server.requests == [f"/hop?to=http://nas.example:{port}/song.wav"]
    assert not (tmp_path / "dl").exists()


def test_a_host_is_refused_if_any_of_its_addresses_is_private(
    settings, server, connections, tmp_path: Path
) -> None:
    port = server.httpd.server_address[1]
    seam = Seam({"mixed.example": ["127.0.0.1", "192.168.1.20"]}, public={"127.0.0.1"})
    links = dataclasses.replace(settings.links, allow_private=False)
    with pytest.raises(DownloadError, match=r"192\.168\.1\.20\) is a private address"):
        fetch_link(f"http://mixed.example:{port}/song.wav", links, tmp_path, resolver=seam)
    assert connections == [] and server.requests == []


def test_a_link_to_a_public_host_connects_to_the_address_that_was_checked(
    settings, server, connections, tmp_path: Path
) -> None:
    port = server.httpd.server_address[1]
    seam = Seam({"music.example": ["127.0.0.1"]}, public={"127.0.0.1"})
    links = dataclasses.replace(settings.links, allow_private=False)
    got = fetch_link(f"http://music.example:{port}/song.wav", links, tmp_path, resolver=seam)
    assert isinstance(got, fetch.Downloaded) and got.path.is_file()
    assert set(connections) == {("127.0.0.1", port)}
    assert len(seam.asked) == len(connections)  # each connection resolved once, then checked


@pytest.mark.slow
def test_a_link_to_this_machine_is_refused_without_a_request(
    make_settings, service_factory, server: HostileServer
) -> None:
    settings = make_settings(links={"allow_private": False})  # the default
    _service, jobs = service_factory(settings)
    url_file(settings.paths.inbox, "local.url", server.url("song.wav"))
    job = jobs.wait_final(1)[0]
    assert job.state is JobState.FAILED, job.error
    assert "127.0.0.1 is this machine (loopback)" in job.error, job.error
    assert "links.allow_private = true" in job.error
    assert server.requests == []
    assert (settings.paths.failed / "local.url").is_file()


# ------------------------------------------------------------------ pages and deadlines


def test_an_endless_page_fails_at_links_max_page_bytes_instead_of_filling_memory(
    settings, server: HostileServer, tmp_path: Path
) -> None:
    links = dataclasses.replace(settings.links, max_page_bytes=1 << 20)
    with pytest.raises(DownloadError, match=r"larger than links.max_page_bytes \(1 MB\)"):
        fetch_link(server.url("endless.html"), links, tmp_path)
    assert server.sent < 16 << 20  # stopped near the cap: only the sockets' buffers beyond


def test_a_page_that_expands_when_decoded_fails_at_links_max_page_bytes(
    settings, server, tmp_path: Path
) -> None:
    links = dataclasses.replace(settings.links, max_page_bytes=1 << 20)
    with pytest.raises(DownloadError, match="larger than links.max_page_bytes"):
        fetch_link(server.url("bomb.html"), links, tmp_path)


def test_a_download_that_trickles_fails_at_links_timeout(
    settings, server: HostileServer, tmp_path: Path
) -> None:
    links = dataclasses.replace(settings.links, timeout=3.0)
    with pytest.raises(DownloadError, match=r"did not finish within links.timeout"):
        fetch_link(server.url("trickle-song.wav"), links, tmp_path)
    assert not (tmp_path / "dl").exists()  # the partial download is removed
    assert server.gone.wait(5), "the connection was left open"


@pytest.mark.slow
def test_a_page_that_trickles_fails_at_links_page_timeout_and_the_queue_goes_on(
    make_settings, service_factory, server: HostileServer
) -> None:
    settings = make_settings(links={"page_timeout": 2})
    _service, jobs = service_factory(settings)
    url_file(settings.paths.inbox, "slow page.url", server.url("trickle.html"))
    job = jobs.wait_final(1, timeout=60)[0]
    assert job.state is JobState.FAILED, job.error
    assert "its page did not load within links.page_timeout (2 s)" in job.error, job.error
    assert server.gone.wait(5), "the connection was left open"
    write_song(settings.paths.inbox / "next.wav", 1.5)
    assert wait_for(lambda: [j for j in jobs.final() if j.state is JobState.DONE], 60, "next")


@pytest.mark.slow
def test_cancel_stops_a_link_whose_page_is_still_loading(
    make_settings, service_factory, server: HostileServer
) -> None:
    settings = make_settings()  # links.page_timeout: a minute
    service, jobs = service_factory(settings)
    inbox = settings.paths.inbox
    url_file(inbox, "slow page.url", server.url("trickle.html"))
    link = wait_for(
        lambda: next(
            (j for j in jobs.jobs() if j.state is JobState.DOWNLOADING and server.requests), None
        ),
        30,
        "the page to load",
    )
    write_song(inbox / "next.wav", 1.5)
    wait_for(lambda: len(service.queue.order()) == 1, 30, "next.wav queued behind the link")
    assert service.scheduler.cancel_job(link.id)
    done = wait_for(lambda: len(jobs.final()) == 2 and jobs.final(), 30, "both jobs to end")
    assert {j.name: j.state for j in done} == {
        "slow page": JobState.CANCELLED,
        "next": JobState.DONE,
    }
    assert server.gone.wait(5), "the connection was left open"
    assert not any(settings.paths.scratch.rglob("*.part"))
