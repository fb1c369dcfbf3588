"""The queue page from another device, end to end: a real service listening on a network
address, not loopback, and a real Chromium on another address signing in over HTTPS.

The network is one the test makes and removes: a network namespace and a veth pair with
addresses in 10.247.X.0/30 that exist only at the pair's two ends, on this machine. The
service listens inside the namespace (its API socket is made by a thread that entered it);
Chromium connects from the other end, so the service sees another device. Nothing is routed
anywhere else, and Chromium resolves no name at all. Making a namespace needs root and `ip`:
elsewhere the test skips with the reason, under CI=true it fails.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from support import browser as chrome
from support.netns import inside, private_link
from support.helpers import wait_for
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.util.passwords import hash_password
from stemdeck_watch.util.synth import write_song

PASSWORD = "couch potato 42"

pytestmark = pytest.mark.slow


def missing() -> str | None:
    if os.geteuid() != 0:
        return "a network namespace of its own needs root"
    if shutil.which("ip") is None:
        return "no `ip` command (apt-get install iproute2)"
    return chrome.missing()


def require() -> None:
    reason = missing()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run the sign-in test")
    pytest.skip(reason)


@contextlib.contextmanager
def foreign_page(address: str, target: str) -> Iterator[str]:
    """A page at `address` (another origin) that posts to the service as soon as it loads."""
    body = (
        "<!doctype html><title>elsewhere</title><script>"
        f"fetch('{target}/api/queue/pause', {{method: 'POST', mode: 'no-cors', "
        "credentials: 'include'});</script>"
    ).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer((address, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.1,), name="foreign-page")
    thread.start()
    try:
        yield f"http://{address}:{server.server_address[1]}/"
    finally:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()


def page_shows(driver: Any, selector: str) -> str:
    """The text of `selector`, or "" while it is not there, or was replaced as it was read
    (the page redraws it: the caller looks again)."""
    from selenium.common.exceptions import StaleElementReferenceException

    found = driver.find_elements("css selector", selector)
    try:
        return found[0].text if found else ""
    except StaleElementReferenceException:
        return ""


def sign_in(driver: Any, password: str) -> None:
    field = wait_for(lambda: driver.find_elements("id", "password"), 10, "the password field")[0]
    field.send_keys(password)
    field.submit()


def test_another_device_signs_in_over_https_plays_stems_and_nothing_else_gets_in(
    make_settings: Any, service_factory: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    require()
    caplog.set_level(logging.INFO, "stemdeck_watch.ui.web")
    with private_link() as (namespace, device_address, service_address):
        settings = make_settings(
            api={"host": service_address, "password_hash": hash_password(PASSWORD), "https": True}
        )
        service, _ = inside(namespace, lambda: service_factory(settings))
        api = service.api
        assert api is not None, "the API did not start on the namespace's address"
        base = f"https://{service_address}:{api.port}"
        assert api.reach()["remote"] == [f"{base}/"] and api.reach()["fingerprint"]

        staging = tmp_path / "staging"
        staging.mkdir()
        song = write_song(staging / "couch song.wav", 6.0, seed=7)
        os.replace(song, settings.paths.inbox / song.name)
        wait_for(lambda: service.registry.jobs([JobState.DONE]), 120, "the song to be separated")

        with chrome.chromium(
            tmp_path / "chromium",
            arguments=("--ignore-certificate-errors",),
            reachable=(service_address, device_address),
        ) as driver:
            driver.get(f"{base}/")  # not signed in: the page sends it to the sign-in page
            assert driver.current_url == f"{base}/signin"

            sign_in(driver, "not the password")
            wait_for(
                lambda: page_shows(driver, "#signin-message") == "Wrong password.",
                10,
                "the wrong password refused",
            )
            assert not driver.get_cookies()

            sign_in(driver, PASSWORD)
            wait_for(lambda: driver.current_url == f"{base}/", 10, "the page after signing in")
            (cookie,) = driver.get_cookies()
            assert cookie["name"] == "__Host-stemdeck-session"
            assert (cookie["httpOnly"], cookie["secure"], cookie["sameSite"]) == (
                True,
                True,
                "Strict",
            )
            assert driver.execute_script("return document.cookie") == ""  # the page cannot read it
            wait_for(
                lambda: (
                    driver.execute_script(
                        "return document.getElementById('connection').dataset.state"
                    )
                    == "live"
                ),
                20,
                "the page to go live",
            )
            assert f"{base}/" in page_shows(driver, "#reach-urls")

            # the player: every stem by Range request, the cookie the only credential
            wait_for(
                lambda: driver.find_elements("css selector", '[data-action="listen"]'),
                30,
                "the Listen button",
            )[0].click()
            wait_for(
                lambda: driver.execute_script("return window.StemdeckPlayer.state().ready"),
                30,
                "the player to be ready",
            )
            driver.find_element("id", "player-play").click()
            state = wait_for(
                lambda: (
                    (s := driver.execute_script("return window.StemdeckPlayer.state()"))["playing"]
                    and s
                ),
                30,
                "the player to play",
            )
            assert state["requests"] and all(r["status"] == 206 for r in state["requests"]), state[
                "requests"
            ]

            # a page of another origin (another address on the same network): its request
            # carries no cookie (SameSite=Strict), and the service refuses its Origin
            with foreign_page(device_address, base) as foreign:
                driver.get(foreign)
                wait_for(
                    lambda: "refused POST /api/queue/pause: 403" in caplog.text,
                    10,
                    "the cross-origin request refused",
                )
            assert service.scheduler.snapshot()["paused"] is False

            # signed out, then five wrong passwords: the sixth try waits, even the right one
            driver.get(f"{base}/")
            wait_for(lambda: page_shows(driver, "#signout button"), 20, "the Sign out button")
            driver.find_element("css selector", "#signout button").click()
            wait_for(lambda: driver.current_url == f"{base}/signin", 10, "the sign-in page")
            assert not driver.get_cookies()
            assert not api.sessions.valid(cookie["value"])  # ended on the service, too
            for _ in range(5):
                driver.get(f"{base}/signin")
                sign_in(driver, "guess guess")
                wait_for(
                    lambda: page_shows(driver, "#signin-message") == "Wrong password.",
                    10,
                    "a wrong password refused",
                )
            driver.get(f"{base}/signin")
            sign_in(driver, PASSWORD)
            wait_for(
                lambda: "Too many wrong passwords" in page_shows(driver, "#signin-message"),
                10,
                "the limit on wrong passwords",
            )
            assert not driver.get_cookies()
        # the log names the address of every wrong password and of the refused sign-in
        assert f"refused a sign-in from {device_address}: too many wrong passwords" in caplog.text
        assert caplog.text.count(f"a wrong password for the queue page from {device_address}") == 6
