"""The local API as a client meets it: a real service, real worker, real files, real sockets.

Plus the event stream's broadcaster on its own (fake snapshots at a rate no real job reaches),
which is what proves the progress rate limit and the latest-state rule.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from stemdeck_watch.ui.web import discovery
from stemdeck_watch.ui.web.stream import Broadcaster, fingerprints
from stemdeck_watch.core.events import EventBus, JobChanged, QueueChanged
from stemdeck_watch.core.jobs import Job, JobKind, JobState
from stemdeck_watch.cli.status import collect
from stemdeck_watch.util.synth import write_song

from support.helpers import wait_for

NO_TOKEN = object()


class Api:
    """Raw HTTP against the service, with full control over the headers."""

    def __init__(self, service: Any):
        self.port, self.token = service.api.port, service.api.token

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        token: Any = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any, http.client.HTTPMessage]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            sent = {"Host": f"127.0.0.1:{self.port}"}
            if token is not NO_TOKEN:
                sent["Authorization"] = f"Bearer {token or self.token}"
            if body is not None:
                raw = json.dumps(body).encode()
            sent.update(headers or {})
            conn.request(method, path, body=raw, headers=sent)
            response = conn.getresponse()
            data = response.read()
            kind = response.getheader("Content-Type", "")
            return response.status, json.loads(data) if "json" in kind else data, response.msg
        finally:
            conn.close()

    def ok(self, method: str, path: str, body: Any = None) -> Any:
        status, reply, _ = self.call(method, path, body)
        assert status == 200, reply
        return reply

    def queue(self) -> dict[str, Any]:
        return self.ok("GET", "/api/queue")


class Stream:
    """An event-stream reader on a raw socket: frames and comment lines as they arrive."""

    def __init__(self, port: int, token: str, rcvbuf: int | None = None):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(10)
        self.sock.connect(("127.0.0.1", port))
        self.sock.sendall(
            f"GET /api/queue/events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {token}\r\n\r\n".encode()
        )
        self.buffer = b""

    def headers(self) -> str:
        while b"\r\n\r\n" not in self.buffer:
            self._recv(10)
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        return head.decode()

    def next(self, timeout: float) -> tuple[str, Any] | None:
        """("queue", snapshot) or ("comment", text); None if nothing came within `timeout`."""
        deadline = time.monotonic() + timeout
        while b"\n\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not self._recv(left):
                return None
        block, self.buffer = self.buffer.split(b"\n\n", 1)
        text = block.decode()
        if text.startswith(":"):
            return "comment", text[1:].strip()
        fields = dict(line.split(": ", 1) for line in text.split("\n"))
        return fields["event"], json.loads(fields["data"])

    def frames_within(self, seconds: float) -> list[tuple[str, Any]]:
        deadline, items = time.monotonic() + seconds, []
        while (left := deadline - time.monotonic()) > 0:
            item = self.next(left)
            if item is not None:
                items.append(item)
        return items

    def _recv(self, timeout: float) -> bool:
        self.sock.settimeout(timeout)
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            return False
        if not chunk:
            raise EOFError("the server closed the stream")
        self.buffer += chunk
        return True

    def close(self) -> None:
        self.sock.close()


def queue_state(api: Api) -> tuple[Any, ...]:
    q = api.queue()
    return (
        q["paused"],
        q["pause_reason"],
        [j["id"] for j in q["queued"]],
        q["running"] and q["running"]["id"],
        {j["id"]: j["state"] for j in q["jobs"]},
    )


def drop(settings: Any, tmp_path: Path, name: str, seconds: float, seed: int = 0) -> None:
    """A song appears in the inbox at once (written elsewhere, then renamed in)."""
    staged = write_song(tmp_path / "staging" / Path(name).name, seconds, seed=seed)
    target = settings.paths.inbox / name
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staged, target)


def job_named(api: Api, name: str, state: str | None = None) -> dict[str, Any] | None:
    return next(
        (
            j
            for j in api.queue()["jobs"]
            if j["name"] == name and (state is None or j["state"] == state)
        ),
        None,
    )


# ------------------------------------------------------------------ the real service


@pytest.mark.slow
def test_discovery_file_and_token_are_fresh_private_and_withdrawn(make_settings, service_factory):
    settings = make_settings()
    state = settings.paths.state
    service, _ = service_factory(settings)
    info = json.loads((state / discovery.API_FILE).read_text())
    port = service.api.port
    assert info == {
        "host": "127.0.0.1",
        "port": port,
        "pid": os.getpid(),
        "url": f"http://127.0.0.1:{port}/",
        "cert": "",
        "page": {"local": f"http://127.0.0.1:{port}/", "remote": [], "fingerprint": None},
    }
    token_file = state / discovery.TOKEN_FILE
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    first_token = token_file.read_text().strip()
    assert first_token == service.api.token and len(first_token) >= 40
    service.shutdown()
    assert not (state / discovery.API_FILE).exists() and not token_file.exists()

    again, _ = service_factory(settings)
    assert token_file.read_text().strip() not in ("", first_token)
    assert Api(again).call("GET", "/api/queue", token=first_token)[0] == 401


@pytest.mark.slow
def api_url(service: Any) -> str:
    return f"http://127.0.0.1:{service.api.port}/"


def test_get_queue_is_the_status_object_and_the_page_needs_no_token(make_settings, service_factory):
    settings = make_settings()
    service, _ = service_factory(settings)
    api = Api(service)
    live = api.queue()
    on_disk = collect(settings)
    assert set(live) == set(on_disk)
    page = {"local": api_url(service), "remote": [], "fingerprint": None}
    assert live["service"] == {"running": True, "pid": os.getpid(), "page": page}
    assert on_disk["service"] == live["service"]  # `status` says where the page is, too
    assert live["folders"] == on_disk["folders"] and live["jobs"] == [] and live["paused"] is False

    status, page, headers = api.call("GET", "/", token=NO_TOKEN)
    assert status == 200 and b"<html" in page.lower()
    assert headers["Content-Type"].startswith("text/html")
    assert headers["Cache-Control"] == "no-store"
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        status, _, headers = api.call("GET", f"/{name}", token=NO_TOKEN)
        assert status == 200 and headers["Content-Type"].startswith(kind)
    for path in (
        "/../api.py",
        "/%2e%2e/api.py",
        "/..%2fapi.py",
        "/api.py",
        "/.hidden",
        "/nothing.js",
        "/page/index.html",
    ):
        assert api.call("GET", path, token=NO_TOKEN)[0] == 404, path
    assert api.call("POST", "/", token=NO_TOKEN)[0] == 405
    status, reply, headers = api.call(
        "GET", "/api/queue", headers={"Origin": f"http://127.0.0.1:{api.port}"}
    )
    assert status == 200  # the page's own origin
    assert not [h for h in headers if h.lower().startswith("access-control-")]
    assert "Set-Cookie" not in headers


@pytest.mark.slow
def test_every_refused_request_gets_its_status_and_changes_nothing(
    make_settings, service_factory, tmp_path
):
    settings = make_settings()
    service, jobs = service_factory(settings)
    api = Api(service)
    drop(settings, tmp_path, "finished.wav", 1.0)
    wait_for(lambda: job_named(api, "finished", "done"), 120, "a finished job")
    drop(settings, tmp_path, "long.wav", 60.0, seed=1)
    running = wait_for(
        lambda: (r := api.queue()["running"]) and r["state"] == "separating" and r,
        90,
        "the long song to be separating",
    )
    for i, name in enumerate(("one/twin.wav", "two/twin.wav", "last.wav")):
        drop(settings, tmp_path, name, 1.0, seed=2 + i)
    wait_for(lambda: len(api.queue()["queued"]) == 3, 30, "three queued songs")
    before = queue_state(api)
    finished = job_named(api, "finished")["id"]
    last = job_named(api, "last")["id"]
    port = api.port

    refused = [
        (401, "GET", "/api/queue", None, {"token": NO_TOKEN}),
        (401, "POST", "/api/queue/pause", None, {"token": NO_TOKEN}),
        (401, "POST", "/api/queue/pause", None, {"token": "x" * 43}),
        (
            401,
            "POST",
            "/api/queue/pause",
            None,
            {"headers": {"Authorization": f"Basic {api.token}"}},
        ),
        (403, "POST", "/api/queue/pause", None, {"headers": {"Host": f"evil.example:{port}"}}),
        (403, "POST", "/api/queue/pause", None, {"headers": {"Host": f"127.0.0.1:{port + 1}"}}),
        (403, "GET", "/", None, {"headers": {"Host": "attacker.test"}, "token": NO_TOKEN}),
        (403, "POST", "/api/queue/pause", None, {"headers": {"Origin": "http://evil.example"}}),
        (
            403,
            "POST",
            "/api/queue/pause",
            None,
            {"headers": {"Origin": f"http://127.0.0.1:{port + 1}"}},
        ),
        (400, "POST", f"/api/jobs/{last}/move", None, {"raw": b'{"first": tru'}),
        (400, "POST", f"/api/jobs/{last}/move", None, {"raw": b'["first"]'}),
        (400, "POST", f"/api/jobs/{last}/move", {}, {}),
        (400, "POST", f"/api/jobs/{last}/move", {"first": True, "after": finished}, {}),
        (400, "POST", f"/api/jobs/{last}/move", {"first": "yes"}, {}),
        (400, "POST", "/api/queue/pause", {"reason": "disk"}, {}),
        (400, "POST", "/api/queue/reorder", {"first": True}, {}),
        (
            413,
            "POST",
            f"/api/jobs/{last}/move",
            None,
            {"raw": json.dumps({"first": True, "pad": "x" * 70_000}).encode()},
        ),
        (404, "POST", "/api/jobs/nosuchjob/cancel", None, {}),
        (404, "GET", "/api/jobs/nosuchjob", None, {}),
        (404, "POST", "/api/queue/shuffle", None, {}),
        (400, "POST", "/api/jobs/twin/cancel", None, {}),
        (405, "GET", "/api/queue/pause", None, {}),
        (405, "DELETE", f"/api/jobs/{last}", None, {}),
        (409, "POST", f"/api/jobs/{running['id']}/move", {"first": True}, {}),
        (409, "POST", f"/api/jobs/{finished}/cancel", None, {}),
        (409, "POST", f"/api/jobs/{finished}/retry", None, {}),
        (409, "POST", f"/api/jobs/{last}/retry", None, {}),
    ]
    for status, method, path, body, options in refused:
        got, reply, headers = api.call(method, path, body, **options)
        assert got == status, (method, path, body, options, got, reply)
        assert isinstance(reply, dict) and reply["error"], reply
        if status == 401:
            assert headers["WWW-Authenticate"].startswith("Bearer")
    assert queue_state(api) == before
    assert "matches several jobs" in api.call("POST", "/api/jobs/twin/cancel")[1]["error"]
    assert "already done" in api.call("POST", f"/api/jobs/{finished}/cancel")[1]["error"]


@pytest.mark.slow
def test_controls_pause_move_cancel_retry_and_a_vanished_anchor(
    make_settings, service_factory, tmp_path
):
    settings = make_settings()
    service, _ = service_factory(settings)
    api = Api(service)
    paused = api.ok("POST", "/api/queue/pause")
    assert paused["paused"] is True and paused["pause_reason"] == "user"
    for i, name in enumerate(("a.wav", "b.wav", "c.wav")):
        # one at a time: songs that settle in the same moment are queued in either order
        drop(settings, tmp_path, name, 1.0, seed=i)
        wait_for(lambda: len(api.queue()["queued"]) == i + 1, 30, f"{name} queued")
    ids = {j["name"]: j["id"] for j in api.queue()["queued"]}
    names = lambda order: [next(k for k, v in ids.items() if v == i) for i in order]  # noqa: E731

    assert names(api.ok("POST", "/api/jobs/c/move", {"first": True})["order"]) == ["c", "a", "b"]
    reply = api.ok("POST", "/api/queue/reorder", {"job": ids["a"], "after": "b"})
    assert names(reply["order"]) == ["c", "b", "a"] and "note" not in reply
    assert [j["name"] for j in reply["queued"]] == ["c", "b", "a"]
    assert api.ok("GET", f"/api/jobs/{ids['b'][:6]}")["job"]["name"] == "b"

    cancelled = api.ok("POST", f"/api/jobs/{ids['b']}/cancel")["job"]
    assert cancelled["state"] == "cancelled"
    assert (settings.paths.inbox / "b.wav").is_file()  # the file stays where it is
    moved = api.ok("POST", f"/api/jobs/{ids['c']}/move", {"after": "b"})  # b has left
    assert names(moved["order"]) == ["a", "c"] and "not queued any more" in moved["note"]

    retried = api.ok("POST", f"/api/jobs/{ids['b']}/retry")
    assert retried["retried"] == ids["b"] and retried["job"]["state"] == "queued"
    assert [j["id"] for j in api.queue()["queued"]][-1] == retried["job"]["id"]
    started = api.ok("POST", "/api/queue/start")
    assert started["paused"] is False
    wait_for(
        lambda: [j["state"] for j in api.queue()["jobs"]].count("done") == 3,
        120,
        "a, b (retried) and c separated",
    )


@pytest.mark.slow
def test_stream_sends_one_frame_per_change_and_nothing_while_idle(make_settings, service_factory):
    service, _ = service_factory(make_settings())
    api = Api(service)
    api.ok("POST", "/api/queue/pause")
    stream = Stream(api.port, api.token)
    try:
        assert "text/event-stream" in stream.headers()
        first = stream.next(2.0)
        assert first is not None and first[0] == "queue"
        assert first[1]["paused"] is True and set(first[1]) == set(api.queue())
        assert stream.frames_within(4.0) == []  # idle: no frame, no keep-alive either

        frames = []
        for action in ("start", "pause"):  # two real changes: two frames
            api.ok("POST", f"/api/queue/{action}")
            frames += stream.frames_within(1.0)
        assert [(kind, f["paused"]) for kind, f in frames] == [("queue", False), ("queue", True)]
        api.ok("POST", "/api/queue/pause")  # already paused: no change, no frame
        api.queue()
        assert stream.frames_within(1.0) == []
    finally:
        stream.close()

    service.api.keepalive = 0.5
    stream = Stream(api.port, api.token)
    try:
        stream.headers()
        assert stream.next(2.0)[0] == "queue"
        assert stream.next(2.0) == ("comment", "keep-alive")
    finally:
        stream.close()


@pytest.mark.slow
def test_stream_serves_two_clients_while_one_stalls_and_limits_progress(
    make_settings, service_factory, tmp_path
):
    settings = make_settings()
    service, jobs = service_factory(settings)
    api = Api(service)
    reader = Stream(api.port, api.token)
    other = Stream(api.port, api.token)
    stalled = Stream(api.port, api.token, rcvbuf=1024)  # connects, then never reads
    try:
        reader.headers()
        other.headers()
        assert reader.next(2.0)[0] == other.next(2.0)[0] == "queue"
        drop(settings, tmp_path, "song.wav", 20.0)
        seen: list[tuple[float, dict[str, Any]]] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            item = reader.next(deadline - time.monotonic())
            if item and item[0] == "queue":
                seen.append((time.monotonic(), item[1]))
                if any(j["state"] == "done" for j in item[1]["jobs"]):
                    break
        assert any(j["state"] == "done" for j in seen[-1][1]["jobs"])
        progress = {f["running"]["progress"] for _, f in seen if f["running"]}
        assert len(progress) >= 3, progress  # the bar moved
        # a frame whose only news is progress comes at least ~0.25 s after the one before
        gaps = [
            b[0] - a[0]
            for a, b in zip(seen, seen[1:])
            if fingerprints(a[1])[1] == fingerprints(b[1])[1]
        ]
        assert gaps and min(gaps) > 0.15, gaps
        others = other.frames_within(1.0)
        assert others and any(j["state"] == "done" for j in others[-1][1]["jobs"])
        t0 = time.monotonic()
        assert api.queue()["running"] is None and time.monotonic() - t0 < 2
    finally:
        for stream in (reader, other, stalled):
            stream.close()


# ------------------------------------------------------------------ the broadcaster alone


def fake_job(progress: float, state: str = "separating") -> dict[str, Any]:
    return {"id": "j1", "name": "song", "state": state, "progress": progress}


class FakeQueue:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[str, Any] | None = fake_job(0.0)
        self.paused = False

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "paused": self.paused,
                "pause_reason": None,
                "running": self.running,
                "queued": [],
                "waiting": [],
                "jobs": [self.running] if self.running else [],
            }


class Collector:
    def __init__(self, broadcaster: Broadcaster):
        self.client = broadcaster.attach()
        self.frames: list[tuple[float, dict[str, Any]]] = []
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        while not self.client.closed:
            frame = self.client.next(1.0)
            if frame:
                data = frame.decode().split("data: ", 1)[1]
                self.frames.append((time.monotonic(), json.loads(data)))


def test_progress_frames_are_rate_limited_and_carry_the_latest_state():
    bus, queue = EventBus(), FakeQueue()
    broadcaster = Broadcaster(queue.snapshot, bus, progress_interval=0.25)
    broadcaster.start()
    collector = Collector(broadcaster)
    job = Job(
        id="j1", name="song", kind=JobKind.FILE, state=JobState.SEPARATING, source="x", rel_path="x"
    )
    try:
        wait_for(lambda: collector.frames, 2, "the first frame")
        start = time.monotonic()
        for i in range(1, 201):  # 100 progress updates a second for 2 s
            with queue.lock:
                queue.running = fake_job(i / 200)
            bus.publish(JobChanged(job))
            threading.Event().wait(0.01)
        wait_for(
            lambda: collector.frames[-1][1]["running"]["progress"] == 1.0, 2, "the latest progress"
        )
        progress_frames = [t for t, _ in collector.frames[1:]]
        assert len(progress_frames) <= 4 * (time.monotonic() - start) + 1, len(progress_frames)
        assert all(b - a >= 0.2 for a, b in zip(progress_frames, progress_frames[1:]))

        sent = len(collector.frames)
        with queue.lock:
            queue.running = fake_job(1.0)  # the same state again: no frame
        bus.publish(JobChanged(job))
        with queue.lock:
            queue.running = fake_job(0.5)  # a progress step right after a frame ...
        bus.publish(JobChanged(job))
        changed_at = time.monotonic()
        with queue.lock:
            queue.paused = True  # ... and a state change together: out at once
        bus.publish(QueueChanged(True, "user", (), 0))
        wait_for(lambda: len(collector.frames) > sent, 2, "the pause frame")
        assert collector.frames[sent][0] - changed_at < 0.15
        assert collector.frames[sent][1]["paused"] is True
        assert len(collector.frames) == sent + 1
    finally:
        broadcaster.stop()
        collector.thread.join()
    assert collector.client.closed


def test_with_no_page_open_events_take_no_snapshots_and_the_next_page_sees_the_latest():
    bus, queue = EventBus(), FakeQueue()
    snapshots = []
    broadcaster = Broadcaster(
        lambda: snapshots.append(1) or queue.snapshot(), bus, progress_interval=0.25, settle=0.0
    )
    broadcaster.start()
    job = Job(
        id="j1", name="song", kind=JobKind.FILE, state=JobState.SEPARATING, source="x", rel_path="x"
    )
    try:
        taken = len(snapshots)
        for i in range(1, 51):
            with queue.lock:
                queue.running = fake_job(i / 50)
            bus.publish(JobChanged(job))
        with queue.lock:
            queue.paused = True
        bus.publish(QueueChanged(True, "user", (), 0))
        for _ in range(2):  # the broadcaster took the events, and went round once more
            wait_for(lambda: not broadcaster._wake.is_set(), 2, "the events taken")
            bus.publish(QueueChanged(True, "user", (), 0))
        assert len(snapshots) == taken
        collector = Collector(broadcaster)
        try:
            wait_for(lambda: collector.frames, 2, "the first frame")
            first = collector.frames[0][1]
            assert first["paused"] is True and first["running"]["progress"] == 1.0
        finally:
            collector.client.close()
            collector.thread.join()
    finally:
        broadcaster.stop()


def test_fingerprint_tells_progress_from_state():
    base = FakeQueue().snapshot()
    moved = {**base, "running": fake_job(0.5)}
    full, shape = fingerprints(base)
    assert fingerprints(moved)[0] != full and fingerprints(moved)[1] == shape
    assert fingerprints({**base, "running": fake_job(0.0, "publishing")})[1] != shape
    assert fingerprints({**base, "paused": True})[1] != shape
    assert fingerprints(dict(base))[0] == full


def test_a_finished_song_removed_behind_a_long_queue_changes_the_fingerprint():
    """The page lists the most recently finished songs whatever the queue's length: one that
    is removed must change what is sent, even with more songs queued than RECENT."""
    queued = [
        {"id": f"q{i}", "name": f"q{i}", "state": "queued", "created_at": 100.0 + i}
        for i in range(30)
    ]
    old = {"id": "old", "name": "Old Song", "state": "done", "created_at": 1.0, "finished_at": 50.0}
    base = {**FakeQueue().snapshot(), "queued": queued}
    before = {**base, "jobs": sorted(queued, key=lambda j: -j["created_at"]) + [old]}
    after = {**base, "jobs": sorted(queued, key=lambda j: -j["created_at"])}
    assert fingerprints(before)[1] != fingerprints(after)[1]


# ------------------------------------------------------------------ binding


class IdleScheduler:
    def snapshot(self) -> dict[str, Any]:
        return {
            "paused": False,
            "pause_reason": None,
            "running": None,
            "queued": [],
            "waiting": [],
            "jobs": [],
        }


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize(
    "host, bound, url_host",
    [
        ("127.0.0.1", "127.0.0.1", "127.0.0.1"),
        ("localhost", "127.0.0.1", "127.0.0.1"),  # never whatever a resolver says localhost is
        pytest.param(
            "::1",
            "::1",
            "[::1]",
            marks=pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback"),
        ),
    ],
)
def test_the_server_binds_loopback_only(tmp_path, host, bound, url_host):
    from stemdeck_watch.core.config import ApiSettings
    from stemdeck_watch.ui.web.api import ApiServer

    server = ApiServer(IdleScheduler(), EventBus(), ApiSettings(host=host, port=0), tmp_path)
    server.start()
    try:
        assert server.url == f"http://{url_host}:{server.port}/"
        family = socket.AF_INET6 if ":" in bound else socket.AF_INET
        with socket.create_connection((bound, server.port), timeout=5) as conn:
            conn.sendall(
                f"GET /api/queue HTTP/1.1\r\nHost: {url_host}:{server.port}\r\n"
                f"Authorization: Bearer {server.token}\r\n\r\n".encode()
            )
            assert conn.family == family
            assert conn.recv(100).startswith(b"HTTP/1.0 200")
        assert discovery.read(tmp_path).url == server.url
    finally:
        server.stop()
    assert discovery.read(tmp_path) is None


def test_a_non_loopback_host_is_refused(tmp_path):
    from stemdeck_watch.core.config import ApiSettings
    from stemdeck_watch.ui.web.api import ApiServer
    from stemdeck_watch.core.errors import ConfigError

    for host in ("0.0.0.0", "192.168.1.2", "example.com", "::"):
        with pytest.raises(ConfigError, match="not a loopback address"):
            ApiServer(IdleScheduler(), EventBus(), ApiSettings(host=host, port=0), tmp_path)


def test_a_taken_port_fails_to_start_and_leaves_nothing_behind(tmp_path):
    from stemdeck_watch.core.config import ApiSettings
    from stemdeck_watch.ui.web.api import ApiServer

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ApiServer(IdleScheduler(), EventBus(), ApiSettings(port=port), tmp_path)
        with pytest.raises(OSError):
            server.start()
        server.stop()
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ the real API and scheduler, no worker


@pytest.fixture
def api_on_registry(settings: Any) -> Any:
    """The real API over the real scheduler and registry (no watcher, no worker): what the
    queue shows and pages through depends on the registry alone."""
    from types import SimpleNamespace

    from stemdeck_watch.core.config import ApiSettings
    from stemdeck_watch.ui.web.api import ApiServer

    from support.helpers import open_scheduler

    scheduler = open_scheduler(settings)
    server = ApiServer(scheduler, scheduler.bus, ApiSettings(port=0), settings.paths.state)
    server.start()
    try:
        yield SimpleNamespace(api=server, scheduler=scheduler, settings=settings)
    finally:
        server.stop()
        scheduler.registry.close()


def history(count: int, start: float = 1.7e9) -> list[Job]:
    """`count` songs separated one after the other, the last one newest."""
    return [
        Job(
            id=f"old{i:06d}",
            name=f"Song {i}",
            kind=JobKind.FILE,
            state=JobState.DONE,
            source=f"/music/processed/Song {i}.flac",
            rel_path=f"Song {i}.flac",
            output=f"/music/outbox/Song {i}",
            created_at=start + i,
            finished_at=start + i + 0.5,
        )
        for i in range(count)
    ]


def test_a_long_history_keeps_the_queue_small_and_every_job_can_be_paged(api_on_registry):
    scheduler = api_on_registry.scheduler
    scheduler.registry.add_all(history(20_000))
    failed = scheduler.registry.add(
        Job(
            id="failedlong",
            name="Broken",
            kind=JobKind.FILE,
            state=JobState.FAILED,
            source="/music/failed/Broken.wav",
            rel_path="Broken.wav",
            error="not audio",
            created_at=1.0,
            finished_at=2.0e9,
        )
    )  # created long ago, failed just now
    queued = [
        scheduler.registry.add(
            Job(
                id=f"queued{i}",
                name=f"Next {i}",
                kind=JobKind.FILE,
                state=JobState.QUEUED,
                source=f"/music/inbox/Next {i}.wav",
                rel_path=f"Next {i}.wav",
            )
        )
        for i in range(3)
    ]
    scheduler.enqueue_restored([job.id for job in queued])
    api = Api(api_on_registry)

    status, raw, headers = api.call("GET", "/api/queue")
    size = int(headers["Content-Length"])
    assert status == 200 and size < 64 * 1024, size  # not 8 MB
    shown = [job["id"] for job in raw["jobs"]]
    assert [job["id"] for job in raw["queued"]] == [job.id for job in queued]
    assert {job.id for job in queued} | {failed.id} <= set(shown)
    assert shown[len(queued) : len(queued) + 3] == ["old019999", "old019998", "old019997"]
    finished = [job for job in raw["jobs"] if job["state"] in ("done", "failed")]
    assert raw["older_jobs"] == 20_001 - len(finished) > 19_000

    stream = Stream(api.port, api.token)  # an open page's first frame is as small
    try:
        stream.headers()
        kind, frame = stream.next(5.0)
        assert kind == "queue" and len(json.dumps(frame)) < 64 * 1024
        assert [job["id"] for job in frame["jobs"]] == shown
    finally:
        stream.close()

    seen: list[str] = []
    cursor = None
    while True:
        query = "?limit=1000" + (f"&before={cursor}" if cursor else "")
        page = api.ok("GET", "/api/jobs" + query)
        assert len(page["jobs"]) <= 1000
        seen += [job["id"] for job in page["jobs"]]
        cursor = page["next"]
        if cursor is None:
            break
    everyone = [job.id for job in scheduler.registry.jobs()]
    assert seen == everyone and len(seen) == 20_004  # every job once, newest first
    assert len(api.ok("GET", "/api/jobs")["jobs"]) == 100  # the default page
    for bad in (
        "?limit=0",
        "?limit=1001",
        "?limit=x",
        "?before=yesterday",
        "?limit=5&limit=6",
        "?page=2",
    ):
        status, reply, _ = api.call("GET", "/api/jobs" + bad)
        assert status == 400 and reply["error"], bad


def test_the_status_command_lists_recent_jobs_and_says_how_many_are_older(settings, capsys):
    from stemdeck_watch.cli.main import main

    from support.helpers import open_scheduler

    scheduler = open_scheduler(settings)
    scheduler.registry.add_all(history(500))
    scheduler.registry.close()
    config = settings.paths.state.parent / "stemdeck.toml"
    config.write_text(
        "[folders]\n"
        + "".join(
            f'{name} = "{getattr(settings.paths, name)}"\n'
            for name in ("inbox", "outbox", "processed", "failed", "state")
        )
    )
    assert main(["status", "--config", str(config)]) == 0
    text = capsys.readouterr().out
    assert "Song 499" in text and "Song 489" not in text
    assert "and 490 older job(s): `stemdeck-watch status --all`" in text
    assert main(["status", "--json", "--config", str(config)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert len(shown["jobs"]) + shown["older_jobs"] == 500 and len(shown["jobs"]) < 100
    assert main(["status", "--json", "--all", "--config", str(config)]) == 0
    assert len(json.loads(capsys.readouterr().out)["jobs"]) == 500


def test_deeply_nested_json_is_refused_with_400_not_a_500(api_on_registry):
    api = Api(api_on_registry)
    for raw in (b"[" * 30_000 + b"]" * 30_000, b'{"a":' * 10_000 + b"1" + b"}" * 10_000):
        assert len(raw) <= 64 * 1024
        status, reply, _ = api.call("POST", "/api/queue/pause", raw=raw)
        assert status == 400 and "nested too deeply" in reply["error"], (status, reply)
    assert api.ok("GET", "/api/queue")["paused"] is False  # refused, nothing changed


def test_a_one_time_page_code_works_once_and_only_for_a_minute():
    from stemdeck_watch.ui.web.pagecode import CODE_TTL, MAX_CODES, OneTimeCodes

    now = [1000.0]
    codes = OneTimeCodes(clock=lambda: now[0])
    first, late = codes.issue(), codes.issue()
    assert len(first) >= 32 and first != late
    assert codes.redeem(first) and not codes.redeem(first)  # once
    now[0] += CODE_TTL + 0.1
    assert not codes.redeem(late)  # expired, and gone
    assert not codes.redeem("") and not codes.redeem("made-up")
    issued = [codes.issue() for _ in range(MAX_CODES + 5)]  # a flood keeps only the newest
    assert not codes.redeem(issued[0]) and codes.redeem(issued[-1])
