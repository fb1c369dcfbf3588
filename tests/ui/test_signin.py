"""Signing in from another device: the password's hash and the command that stores it, the
sessions and the limit on wrong passwords, the names and origins the service answers to, and
every endpoint refused to another device until it signs in.

A real API server on loopback, with every connection taken as one from another device
(`ApiServer.local_peer`): the same checks a device on the network meets, without a packet
leaving loopback. The browser on a real network address is `test_signin_browser.py`.
"""

from __future__ import annotations

import dataclasses
import http.client
import io
import re
import ssl
import stat
from pathlib import Path
from typing import Any, Iterator

import pytest

from stemdeck_watch.cli.main import main
from stemdeck_watch.cli.status import render
from stemdeck_watch.core.config import ApiSettings, load_settings
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.core.events import EventBus
from stemdeck_watch.ui.web import openapi, signin
from stemdeck_watch.ui.web.gate import Gate
from stemdeck_watch.util.passwords import check_stored, hash_password, verify_password

PASSWORD = "correct horse battery"
HASH = hash_password(PASSWORD)  # once: each hash takes a tenth of a second or more
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------ the password


def test_the_password_is_kept_as_a_salted_scrypt_hash_with_its_parameters() -> None:
    assert HASH.startswith("scrypt$n=32768,r=8,p=1$") and PASSWORD not in HASH
    assert verify_password(PASSWORD, HASH)
    assert not verify_password(PASSWORD + "!", HASH) and not verify_password("", HASH)
    assert hash_password(PASSWORD) != HASH  # a new salt each time
    assert check_stored(HASH) == HASH and check_stored("") == ""
    for bad in ("hunter2", "scrypt$n=3,r=8,p=1$AAAAAAAAAAAAAAAAAAAAAA$" + "A" * 43, "md5$x"):
        with pytest.raises(ValueError, match="stemdeck-watch password"):
            check_stored(bad)
    # the parameters travel with the hash: one made with others still checks
    older = HASH.replace("n=32768", "n=1024")
    salt, digest = older.split("$")[2:]
    import base64
    import hashlib

    raw = hashlib.scrypt(
        PASSWORD.encode(), salt=base64.b64decode(salt + "=="), n=1024, r=8, p=1, dklen=32
    )
    remade = older.replace(digest, base64.b64encode(raw).decode().rstrip("="))
    assert verify_password(PASSWORD, remade) and not verify_password("nope nope", remade)


def test_the_password_command_stores_only_the_hash_and_keeps_the_rest_of_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "stemdeck.toml"
    original = (
        "# my own notes\n[api]\nport = 8765 # fixed for the phone\n\n[tray]\nenabled = false\n"
    )
    config.write_text(original)
    config.chmod(0o644)

    def password(*lines: str) -> int:
        monkeypatch.setattr("sys.stdin", io.StringIO("".join(lines)))
        return main(["--config", str(config), "password", "--stdin"])

    assert password(PASSWORD + "\n") == 0
    text = config.read_text()
    assert PASSWORD not in text and PASSWORD not in capsys.readouterr().out
    assert text.startswith("# my own notes\n[api]\nport = 8765 # fixed for the phone\n")
    assert text.endswith("\n[tray]\nenabled = false\n")
    assert stat.S_IMODE(config.stat().st_mode) == 0o600  # a hash is guessed offline otherwise
    stored = load_settings(config).api.password_hash
    assert verify_password(PASSWORD, stored) and stored in text

    assert password("another password\n") == 0  # replaced in place, not added twice
    assert config.read_text().count("password_hash") == 1
    assert verify_password("another password", load_settings(config).api.password_hash)

    before = config.read_text()
    assert password("short\n") == 2  # refused, nothing written
    assert "at least 8 characters" in capsys.readouterr().err
    assert config.read_text() == before
    assert not [p for p in tmp_path.iterdir() if p.name != "stemdeck.toml"]  # no temp left

    dotted = tmp_path / "dotted.toml"
    dotted.write_text("api.port = 8765\n")
    monkeypatch.setattr("sys.stdin", io.StringIO(PASSWORD + "\n"))
    assert main(["--config", str(dotted), "password", "--stdin"]) == 2
    assert "set it by hand" in capsys.readouterr().err
    assert dotted.read_text() == "api.port = 8765\n"

    fresh = tmp_path / "fresh.toml"
    fresh.write_text("")
    monkeypatch.setattr("sys.stdin", io.StringIO(PASSWORD + "\n"))
    assert main(["--config", str(fresh), "password", "--stdin"]) == 0
    assert verify_password(PASSWORD, load_settings(fresh).api.password_hash)


# ------------------------------------------------------------------ sessions and the limit


def test_sessions_end_when_they_expire_and_wrong_passwords_are_limited_per_address() -> None:
    clock = Clock()
    sessions = signin.Sessions(ttl=60, clock=clock)
    token = sessions.begin()
    assert len(token) >= 43 and sessions.valid(token) and not sessions.valid(token + "x")
    clock.now += 61
    assert not sessions.valid(token)

    limit = signin.FailureLimit(limit=5, window=900, clock=clock)
    for _ in range(5):
        assert limit.retry_after("10.0.0.9") == 0
        limit.failed("10.0.0.9")
        clock.now += 10
    assert limit.retry_after("10.0.0.9") == 900 - 50
    assert limit.retry_after("10.0.0.8") == 0  # another address is not held up
    clock.now += 900 - 50
    assert limit.retry_after("10.0.0.9") == 0  # the oldest failure left the window


def test_the_cookie_is_http_only_strict_and_secure_under_https() -> None:
    plain = signin.session_cookie("abc", secure=False)
    assert plain.startswith("stemdeck-session=abc; ") and "Secure" not in plain
    secure = signin.session_cookie("abc", secure=True)
    assert secure.startswith("__Host-stemdeck-session=abc; ")
    for cookie in (plain, secure):
        assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= set(cookie.split("; "))
    assert "Secure" in secure.split("; ")
    assert signin.session_of("a=b; stemdeck-session=abc", secure=False) == "abc"
    assert signin.session_of("stemdeck-session=abc", secure=True) is None


# ------------------------------------------------------------------ names and origins


def test_the_host_and_origin_must_name_this_service_or_a_name_in_api_hosts() -> None:
    local = Gate("127.0.0.1", 8765, (), https=False)
    assert local.host_allowed("127.0.0.1:8765") and local.host_allowed("LOCALHOST:8765")
    assert local.host_allowed("[::1]:8765")
    for host in ("10.0.0.2:8765", "nas.local:8765", "127.0.0.1:8766", "evil.example:8765"):
        assert not local.host_allowed(host), host

    lan = Gate("10.0.0.2", 8765, ("nas.local",), https=True)
    for host in ("10.0.0.2:8765", "nas.local:8765", "NAS.local:8765", "127.0.0.1:8765"):
        assert lan.host_allowed(host), host
    for host in (
        "10.0.0.3:8765",
        "nas.local:80",
        "evil.example:8765",
        "nas.local",
        "u@nas.local:8765",
    ):
        assert not lan.host_allowed(host), host
    assert lan.origin_allowed("https://nas.local:8765")
    assert not lan.origin_allowed("http://nas.local:8765")  # not our scheme
    assert not lan.origin_allowed("https://evil.example:8765")
    assert not lan.origin_allowed("null")
    assert lan.remote_urls() == ["https://10.0.0.2:8765/", "https://nas.local:8765/"]
    assert lan.local_url() == "https://10.0.0.2:8765/"

    every = Gate("0.0.0.0", 443, ("music.example.org",), https=True)
    assert every.host_allowed("192.168.1.20") and every.host_allowed("music.example.org")
    assert not every.host_allowed("other.example.org")
    assert every.local_url() == "https://127.0.0.1:443/"


def test_an_address_other_than_loopback_needs_a_password(tmp_path: Path) -> None:
    from stemdeck_watch.ui.web.api import ApiServer

    with pytest.raises(ConfigError, match="stemdeck-watch password"):
        ApiServer(Idle(), EventBus(), ApiSettings(host="192.168.1.2"), tmp_path)
    ApiServer(Idle(), EventBus(), ApiSettings(host="192.168.1.2", password_hash=HASH), tmp_path)


def test_status_says_where_the_page_is_reached() -> None:
    page = {
        "local": "https://127.0.0.1:8765/",
        "remote": ["https://10.0.0.2:8765/", "https://nas.local:8765/"],
        "fingerprint": "AB:CD",
    }
    shown = render(
        {
            "service": {"running": True, "pid": 1, "page": page},
            "paused": False,
            "pause_reason": None,
            "folders": {"inbox": "/i", "outbox": "/o"},
            "running": None,
            "queued": [],
            "waiting": [],
            "jobs": [],
        }
    )
    assert "https://127.0.0.1:8765/ (this computer)" in shown
    assert "https://nas.local:8765/ (other devices, signed in)" in shown
    assert "certificate SHA-256 AB:CD" in shown


# ------------------------------------------------------------------ the server, from another device


class Idle:
    settings = None
    paused = False

    def pause(self) -> None:
        self.paused = True

    def snapshot(self) -> dict[str, Any]:
        return {
            "paused": self.paused,
            "pause_reason": None,
            "running": None,
            "queued": [],
            "jobs": [],
        }


class Device:
    """Requests as another device on the network sends them."""

    def __init__(self, server: Any, https: bool):
        self.server, self.https = server, https
        self.host = f"127.0.0.1:{server.port}"
        self.cookie: str | None = None

    def call(
        self, method: str, path: str, body: bytes | str | None = None, **headers: str
    ) -> tuple[int, http.client.HTTPMessage, bytes]:
        if self.https:
            context = ssl.create_default_context(cafile=str(self.server.cert))
            context.check_hostname = False
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                "127.0.0.1", self.server.port, timeout=10, context=context
            )
        else:
            conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=10)
        sent = {"Host": self.host, **{k.replace("_", "-"): v for k, v in headers.items()}}
        if self.cookie:
            sent["Cookie"] = self.cookie
        try:
            conn.request(method, path, body=body, headers=sent)
            response = conn.getresponse()
            return response.status, response.msg, response.read()
        finally:
            conn.close()

    def sign_in(self, password: str) -> tuple[int, http.client.HTTPMessage, bytes]:
        answer = self.call("POST", "/signin", f"password={password}", **FORM)
        if answer[0] == 303:
            self.cookie = answer[1]["Set-Cookie"].split(";")[0]
        return answer


@pytest.fixture(params=[False, True], ids=["http", "https"])
def device(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Device]:
    from stemdeck_watch.ui.web.api import ApiServer

    settings = ApiSettings(port=0, password_hash=HASH, https=request.param)
    server = ApiServer(Idle(), EventBus(), settings, tmp_path)
    server.local_peer = lambda peer, own: False  # every connection: another device
    server.start()
    try:
        yield Device(server, request.param)
    finally:
        server.stop()


def test_another_device_gets_nothing_but_the_sign_in_page_until_it_signs_in(device: Device) -> None:
    document = openapi.document("http://127.0.0.1:1", ("wav",), [])
    routes = [
        (method.upper(), path.replace("{ref}", "job1").replace("{stem}", "vocals"))
        for path, operations in document["paths"].items()
        for method in operations
        if method in ("get", "post", "put", "delete", "patch")
    ]
    assert len(routes) >= 20
    token = {"Authorization": f"Bearer {device.server.token}"}
    for method, path in routes:
        for headers in ({}, token):  # the token counts only on this machine
            status, _, body = device.call(method, path, b"{}", **headers)
            assert status == 401 and b"sign in first" in body, (method, path, headers, body)
    ranged = device.call("GET", "/api/jobs/job1/stems/vocals", Range="bytes=0-99")
    assert ranged[0] == 401
    upload = device.call(
        "POST", "/api/uploads?name=a.wav", b"RIFF", Content_Type="application/octet-stream"
    )
    assert upload[0] == 401
    for path in ("/", "/app.js", "/index.html", "/nothing-here"):
        status, headers, _ = device.call("GET", path)
        assert (status, headers["Location"]) == (303, "/signin"), path
    status, headers, body = device.call("GET", "/signin")
    assert status == 200 and b'name="password"' in body
    assert headers["Content-Security-Policy"].startswith("default-src 'self'")
    assert device.call("GET", "/style.css")[0] == 200


def test_signing_in_gives_a_strict_http_only_cookie_that_opens_everything(device: Device) -> None:
    status, _, body = device.sign_in("wrong password")
    assert status == 401 and b"Wrong password." in body and device.cookie is None
    status, headers, _ = device.sign_in(PASSWORD.replace(" ", "+"))
    assert (status, headers["Location"]) == (303, "/")
    cookie = headers["Set-Cookie"]
    flags = cookie.split("; ")
    assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= set(flags)
    assert ("Secure" in flags) is device.https
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}", device.cookie.split("=", 1)[1])
    assert device.call("GET", "/")[0] == 200
    assert device.call("GET", "/api/queue")[0] == 200
    origin = f"{'https' if device.https else 'http'}://{device.host}"
    assert device.call("POST", "/api/queue/pause", Origin=origin)[0] == 200
    # a request that changes something must come from the page: with its Origin, never another
    assert device.call("POST", "/api/queue/pause")[0] == 403
    assert device.call("POST", "/api/queue/pause", Origin="https://evil.example")[0] == 403
    assert device.call("GET", "/api/queue", Host="evil.example")[0] == 403

    assert device.call("POST", "/signout", Origin=origin)[0] == 303
    assert device.call("GET", "/api/queue")[0] == 401  # the session ended on the server


def test_five_wrong_passwords_hold_the_address_off_even_with_the_right_one(device: Device) -> None:
    for _ in range(signin.MAX_FAILURES):
        assert device.sign_in("wrong password")[0] == 401
    status, headers, body = device.sign_in(PASSWORD.replace(" ", "+"))
    assert status == 429 and device.cookie is None and b"Too many wrong passwords" in body
    assert 0 < int(headers["Retry-After"]) <= signin.FAILURE_WINDOW


def test_the_cli_on_this_machine_uses_the_token_over_https_trusting_only_that_certificate(
    tmp_path: Path,
) -> None:
    from stemdeck_watch.ui.web import discovery
    from stemdeck_watch.ui.web.api import ApiServer
    from stemdeck_watch.ui.web.client import ApiError, Client

    settings = ApiSettings(port=0, password_hash=HASH, https=True)
    server = ApiServer(Idle(), EventBus(), settings, tmp_path / "a")
    other = ApiServer(Idle(), EventBus(), settings, tmp_path / "b")  # another certificate
    server.start()
    try:
        found = discovery.read(tmp_path / "a")
        assert found is not None and found.url == f"https://127.0.0.1:{server.port}/"
        assert Client(found, tmp_path / "a").get("/api/queue")["paused"] is False
        forged = dataclasses.replace(found, cert=str(other.cert))
        with pytest.raises(ApiError, match="CERTIFICATE_VERIFY_FAILED"):
            Client(forged, tmp_path / "a").get("/api/queue")
    finally:
        server.stop()


def test_a_self_signed_certificate_names_the_hosts_and_is_kept_from_start_to_start(
    tmp_path: Path,
) -> None:
    import subprocess

    from stemdeck_watch.ui.web import tls

    cert, key = tls.self_signed(tmp_path, ["0.0.0.0", "", "nas.local", "10.0.0.2"])
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(cert.parent.stat().st_mode) == 0o700
    names = subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    for name in ("DNS:localhost", "IP Address:127.0.0.1", "DNS:nas.local", "IP Address:10.0.0.2"):
        assert name in names, names
    assert "0.0.0.0" not in names
    first = tls.fingerprint(cert)
    assert re.fullmatch(r"([0-9A-F]{2}:){31}[0-9A-F]{2}", first)
    assert tls.fingerprint(tls.self_signed(tmp_path, ["other.example"])[0]) == first
    assert {p.name for p in cert.parent.iterdir()} == {"cert.pem", "key.pem"}  # nothing left
