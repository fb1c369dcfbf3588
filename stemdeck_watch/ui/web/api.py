"""The HTTP API and its one event stream: loopback only, or for other devices signed in.

Threads, like the rest of the service: the standard library's ThreadingHTTPServer, one thread
per connection, one connection per request (HTTP/1.0 semantics, so no idle keep-alive
connection holds a thread). Every action goes through the scheduler, the one door into the
queue; this module only translates HTTP to those calls and ControlErrors back to statuses.

Security, because any web page the user visits can make the browser send requests to
127.0.0.1: every `/api/` request needs the bearer token from `<state>/api.token` (compared in
constant time); a Host that is not a loopback name with our port is refused (DNS rebinding: a
foreign name that resolves to 127.0.0.1); an Origin other than our own is refused; no CORS
headers, so a foreign page cannot read a reply; no cookies, so nothing is sent on its own;
bodies are capped. The static page needs no token: it holds nothing secret, and it gets the
token by trading a one-time code from its URL fragment (`pagecode.py`; the fragment never
reaches a server, and the code is useless once traded or after a minute). The only other
`/api/` requests without a token are that trade and the API's own description
(`openapi.py`).

With `api.host` other than loopback (a password set), other devices reach the same page and
API once signed in (`signin.py`: a session cookie, HttpOnly and SameSite=Strict, Secure under
HTTPS; wrong passwords limited per address), optionally over HTTPS (`tls.py`). Which names and
origins are ours and which requests come from this machine is `gate.py`'s; a request from
another device is refused everything but the sign-in page until it has signed in, and the
token is not taken from it. The stream itself is `stream.py`.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import unquote, urlsplit

from stemdeck_watch.core.config import ApiSettings, resolve_path
from stemdeck_watch.ui.web import discovery, media, openapi, signin, tls, upload
from stemdeck_watch.ui.web.gate import Gate, is_local, is_loopback, primary_address
from stemdeck_watch.ui.web.httpbase import CountedBody, HttpError, JsonHandler, LoopbackServer
from stemdeck_watch.ui.web.signin import SignInRoutes
from stemdeck_watch.ui.web.pagecode import OneTimeCodes
from stemdeck_watch.ui.web.stream import KEEPALIVE, PROGRESS_INTERVAL, Broadcaster
from stemdeck_watch.core.errors import ConfigError, ControlError, JobNotFound
from stemdeck_watch.core.events import EventBus
from stemdeck_watch.util.passwords import verify_password

log = logging.getLogger(__name__)

PAGE_DIR = Path(__file__).resolve().parent / "page"
JOB = r"/api/jobs/(?P<ref>[^/]+)"
ROUTES: list[tuple[re.Pattern[str], dict[str, str]]] = [
    (re.compile(pattern), methods)
    for pattern, methods in (
        (r"/api/queue", {"GET": "queue"}),
        (r"/api/jobs", {"GET": "jobs"}),
        (r"/api/openapi\.json", {"GET": "openapi"}),
        (r"/api/page-code", {"POST": "page_code"}),
        (r"/api/token", {"POST": "token"}),
        (r"/api/queue/events", {"GET": "events"}),
        (r"/api/queue/pause", {"POST": "pause"}),
        (r"/api/queue/start", {"POST": "start"}),
        (r"/api/queue/reorder", {"POST": "reorder"}),
        (JOB, {"GET": "job"}),
        (JOB + r"/cancel", {"POST": "cancel"}),
        (JOB + r"/retry", {"POST": "retry"}),
        (JOB + r"/remove", {"POST": "remove"}),
        (JOB + r"/move", {"POST": "move"}),
        (JOB + r"/player", {"GET": "player"}),
        (JOB + r"/stems/(?P<stem>[^/]+)", {"GET": "stem"}),
        (JOB + r"/preview", {"GET": "preview"}),
        (JOB + r"/beats", {"GET": "beats"}),
        (r"/api/intake", {"GET": "intake"}),
        (r"/api/uploads", {"POST": "upload"}),
        (r"/api/links", {"POST": "link"}),
    )
]
FILES = ("stem", "preview")  # answered with a file (HTTP Range), not JSON
QUERIED = ("jobs", "upload")  # the only routes that take query parameters
PUBLIC = ("/api/openapi.json", "/api/token")  # the only /api/ paths served without the token
SIGNIN_PUBLIC = ("/signin", "/style.css")  # what another device gets before it signs in
CHECK_WAIT = 5.0  # seconds a sign-in waits for the checks ahead of it before a 503
PAGE_LIMIT, MAX_PAGE_LIMIT = 100, 1000  # GET /api/jobs: jobs per page, by default and at most
CURSOR = re.compile(openapi.CURSOR)  # its `before`: a job's created_at and rowid


class ApiServer:
    """The server, its broadcaster and the discovery file, started and stopped together."""

    def __init__(
        self,
        scheduler: Any,
        bus: EventBus,
        settings: ApiSettings,
        state_dir: Path,
        *,
        base: Path | None = None,
        keepalive: float = KEEPALIVE,
        progress_interval: float = PROGRESS_INTERVAL,
    ):
        host = "127.0.0.1" if settings.host == "localhost" else settings.host
        if not is_loopback(host) and not settings.password_hash:
            raise ConfigError(
                f"api.host = {settings.host!r} is not a loopback address: other devices could "
                f"reach the page, so it needs a password first: run `stemdeck-watch password` "
                f'(or set api.host = "127.0.0.1" for this computer only)'
            )
        self.password_hash = settings.password_hash
        self.https = settings.https
        self.names = tuple(settings.hosts)
        self.cert: Path | None = None
        self._tls: Any = None
        if (settings.tls_cert or settings.tls_key) and not settings.https:
            raise ConfigError("api.tls_cert and api.tls_key are used only with api.https = true")
        if settings.https:
            self.cert, key = self._certificate(settings, base or state_dir, state_dir, host)
            self._tls = tls.server_context(self.cert, key)
        self.sessions = signin.Sessions()
        self.failures = signin.FailureLimit()
        # one password check at a time: each takes 32 MiB and a tenth of a second or more, so
        # a crowd of sign-ins at once would otherwise take the machine's memory
        self._checking = threading.Semaphore(1)
        self.gate = Gate(host, 0, self.names, self.https)
        self._reach: dict[str, Any] = {}
        # whether a connection comes from this machine (tests make every peer another device)
        self.local_peer: Callable[[str, str], bool] = is_local
        self.scheduler, self.host, self.state_dir = scheduler, host, state_dir
        self.keepalive = keepalive
        self._wanted_port = settings.port
        self.port = 0
        self.token = ""
        self.codes = OneTimeCodes()
        self.broadcaster = Broadcaster(self.snapshot, bus, progress_interval)
        self._httpd: LoopbackServer | None = None
        self._thread: threading.Thread | None = None
        self._published: discovery.Discovery | None = None

    @property
    def url(self) -> str:
        return self.gate.local_url()

    @staticmethod
    def _certificate(
        settings: ApiSettings, base: Path, state_dir: Path, host: str
    ) -> tuple[Path, Path]:
        if bool(settings.tls_cert) != bool(settings.tls_key):
            raise ConfigError("set both api.tls_cert and api.tls_key, or neither (self-signed)")
        if settings.tls_cert:
            return resolve_path(settings.tls_cert, base), resolve_path(settings.tls_key, base)
        names = [host, *settings.hosts]
        if host in ("0.0.0.0", "::"):
            names.append(primary_address(host) or "")
        return tls.self_signed(state_dir, names)

    def start(self) -> None:
        """Bind (OSError if the port is taken), serve, then write the discovery file."""
        self.token = discovery.new_token()
        self._httpd = LoopbackServer((self.host, self._wanted_port), self, _Handler, self._tls)
        self.port = self._httpd.server_address[1]
        self.gate = Gate(self.host, self.port, self.names, self.https)
        self._reach = self.reach()
        self.broadcaster.start()
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.2,), name="stemdeck-api", daemon=True
        )
        self._thread.start()
        self._published = discovery.publish(
            self.state_dir,
            self.gate.cli_host(),
            self.port,
            os.getpid(),
            self.token,
            scheme=self.gate.scheme,
            cert=str(self.cert or ""),
            page=self._reach,
        )
        log.info(
            "local API and queue page on %s (token in %s)",
            self.url,
            self.state_dir / discovery.TOKEN_FILE,
        )
        reach = self._reach
        if reach["remote"] and not self.https:
            log.warning(
                "other devices reach the page over plain HTTP: their password and session "
                "cross the network readable by anyone on it; set api.https = true"
            )
        if reach["remote"]:
            log.info(
                "other devices sign in to the queue page at %s%s",
                ", ".join(reach["remote"]),
                f" (certificate SHA-256 {reach['fingerprint']})" if reach["fingerprint"] else "",
            )

    def reach(self) -> dict[str, Any]:
        """Where the page can be opened from: this machine, other devices, the certificate's
        fingerprint under HTTPS (what a browser shows for a self-signed one)."""
        return {
            "local": self.url,
            "remote": self.gate.remote_urls(),
            "fingerprint": tls.fingerprint(self.cert) if self.cert else None,
        }

    def stop(self) -> None:
        """Withdraw the discovery file, stop accepting, end every stream and connection, and
        wait for their threads."""
        if self._published is not None:
            discovery.withdraw(self.state_dir, self._published)
            self._published = None
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        if self._thread is not None:
            httpd.shutdown()
            self._thread.join()
        self.broadcaster.stop()
        httpd.disconnect_all()
        httpd.server_close()  # joins the connection threads

    def page_url(self) -> str:
        """The queue page's address with a fresh one-time code (never the token): what a
        browser is started with, where every local user can read its command line."""
        return f"{self.url}#code={self.codes.issue()}"

    def snapshot(self) -> dict[str, Any]:
        snap = dict(self.scheduler.snapshot())
        service = dict(snap.get("service") or {"running": True, "pid": os.getpid()})
        service["page"] = self._reach
        snap["service"] = service
        return snap

    def host_allowed(self, host: str) -> bool:
        return self.gate.host_allowed(host)

    def origin_allowed(self, origin: str) -> bool:
        return self.gate.origin_allowed(origin)

    def password_ok(self, presented: str) -> bool | None:
        """Whether `presented` is the password; None when other checks kept this one waiting
        past `CHECK_WAIT`."""
        if not self._checking.acquire(timeout=CHECK_WAIT):
            return None
        try:
            return bool(self.password_hash) and verify_password(presented, self.password_hash)
        finally:
            self._checking.release()

    def token_ok(self, presented: str) -> bool:
        return bool(self.token) and hmac.compare_digest(presented.encode(), self.token.encode())


class _Handler(SignInRoutes, JsonHandler):
    """One connection, one request: check, route, call the scheduler, answer JSON."""

    static_dir = PAGE_DIR

    # ------------------------------------------------------------ the one path

    def _handle(self, method: str) -> None:
        api = self.server.api
        self.close_connection = True
        try:
            self._unread = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self._unread = -1
        try:
            self._check_host_and_origin(api)
            path = urlsplit(self.path).path
            local = api.local_peer(self.client_address[0], self.connection.getsockname()[0])
            if path in ("/signin", "/signout"):
                return self._signin(api, method, path)
            signed_in = self._signed_in(api)
            if not local and not signed_in and path not in SIGNIN_PUBLIC:
                return self._refuse_unsigned(api, method, path)
            if signed_in and method not in ("GET", "HEAD") and not self.headers.get("Origin"):
                raise HttpError(
                    403,
                    "refused: a signed-in request that changes something must "
                    "come from the queue page (it sends an Origin header)",
                )
            if path != "/api" and not path.startswith("/api/"):
                return self._static(method, path)
            if path not in PUBLIC and not signed_in:
                self._authorize(api)
            name, params = _route(method, path)
            if name not in QUERIED and urlsplit(self.path).query:
                raise HttpError(400, f"unexpected query string: {path[:200]} takes no parameters")
            if name == "events":
                return self._stream(api)
            if name in FILES:
                return getattr(self, f"_file_{name}")(api, **params)
            if name == "upload":  # a file's bytes, streamed to disk: not a JSON body
                return self._send_json(200, self._upload(api))
            body = self._read_json() if method == "POST" else {}
            reply = getattr(self, f"_api_{name}")(api.scheduler, body, **params)
            self._send_json(200, reply)
        except HttpError as exc:
            self._refuse(exc.status, exc.message, exc.headers)
        except ControlError as exc:
            self._refuse(exc.status, str(exc))
        except Exception:
            log.exception("the local API failed on %s %s", method, urlsplit(self.path).path)
            self._refuse(500, "internal error in the service; its log has the details")

    def _check_host_and_origin(self, api: ApiServer) -> None:
        hosts = self.headers.get_all("Host") or []
        if len(hosts) != 1 or not api.host_allowed(hosts[0]):
            shown = hosts[0][:100] if hosts else "(none)"
            names = ", ".join(["127.0.0.1", "localhost", *api.names])
            also = ", or an address of this machine" if api.gate.remote else ""
            raise HttpError(
                403,
                f"refused: Host {shown!r} is not a name of this service (port {api.port} "
                f"with {names}{also}); list other names in api.hosts",
            )
        origins = self.headers.get_all("Origin") or []
        if len(origins) > 1 or (origins and not api.origin_allowed(origins[0])):
            raise HttpError(
                403,
                f"refused: requests from {origins[0][:100]!r} are not allowed; "
                f"only the queue page served here may call the API",
            )

    # ------------------------------------------------------------ actions

    def _api_queue(self, scheduler: Any, body: dict[str, Any]) -> dict[str, Any]:
        return self.server.api.snapshot()

    def _api_jobs(self, scheduler: Any, body: dict[str, Any]) -> dict[str, Any]:
        query = self._query("before", "limit")
        limit = _integer(query.get("limit", str(PAGE_LIMIT)), "limit", 1, MAX_PAGE_LIMIT)
        before = _cursor(query["before"]) if "before" in query else None
        jobs, after = scheduler.jobs_page(before, limit)
        return {
            "jobs": [job.to_status() for job in jobs],
            "next": f"{after[0]!r}_{after[1]}" if after else None,
        }

    def _api_openapi(self, scheduler: Any, body: dict[str, Any]) -> dict[str, Any]:
        settings = scheduler.settings
        return openapi.document(
            self.server.api.url, settings.watch.extensions, sorted(settings.presets)
        )

    def _api_page_code(self, scheduler: Any, body: dict[str, Any]) -> dict[str, Any]:
        _only(body)
        api = self.server.api
        return {"url": api.page_url(), "expires_in": api.codes.ttl}

    def _api_token(self, scheduler: Any, body: dict[str, Any]) -> dict[str, Any]:
        _only(body, "code")
        code = body.get("code")
        if not isinstance(code, str) or not code:
            raise HttpError(400, 'send the one-time code from the page\'s address: {"code": CODE}')
        api = self.server.api
        if not api.codes.redeem(code):
            raise HttpError(
                403,
                "this page link was already used or has expired; open the "
                "page again with `stemdeck-watch open` or the tray",
            )
        log.info("the queue page traded a one-time code for the token")
        return {"token": api.token}

    def _api_job(self, scheduler: Any, body: dict[str, Any], ref: str) -> dict[str, Any]:
        return {"job": scheduler.find(ref).to_status()}

    def _api_pause(self, scheduler: Any, body: dict[str, Any]) -> dict[str, Any]:
        _only(body)
        scheduler.pause()
        return self.server.api.snapshot()

    def _api_start(self, scheduler: Any, body: dict[str, Any]) -> dict[str, Any]:
        _only(body)
        scheduler.start()
        return self.server.api.snapshot()

    def _api_cancel(self, scheduler: Any, body: dict[str, Any], ref: str) -> dict[str, Any]:
        _only(body)
        return {"job": scheduler.cancel_job(scheduler.find(ref).id).to_status()}

    def _api_retry(self, scheduler: Any, body: dict[str, Any], ref: str) -> dict[str, Any]:
        _only(body)
        old = scheduler.find(ref)
        new = scheduler.retry(old.id)
        reply: dict[str, Any] = {"job": new.to_status() if new else None, "retried": old.id}
        if new is None:
            reply["note"] = f"the queue is full: {old.name} waits in the inbox until there is room"
        return reply

    def _api_remove(self, scheduler: Any, body: dict[str, Any], ref: str) -> dict[str, Any]:
        _only(body)
        job = scheduler.find(ref)
        return {"removed": job.to_status(), "not_deleted": scheduler.remove(job.id)}

    def _api_move(self, scheduler: Any, body: dict[str, Any], ref: str) -> dict[str, Any]:
        return self._move(scheduler, ref, *_move_target(body))

    def _api_reorder(self, scheduler: Any, body: dict[str, Any]) -> dict[str, Any]:
        ref = body.get("job")
        if not isinstance(ref, str) or not ref:
            raise HttpError(
                400, 'say which job to move: {"job": ID, "after": ID} or {"job": ID, "first": true}'
            )
        return self._move(scheduler, ref, *_move_target(body, "job"))

    def _move(self, scheduler: Any, ref: str, after: str | None, first: bool) -> dict[str, Any]:
        job = scheduler.find(ref)
        anchor = None
        if after is not None:
            try:
                anchor = scheduler.find(after).id
            except JobNotFound:
                anchor = after  # it left (or never was): the job goes to the end
        order = scheduler.move(job.id, after=anchor, first=first)
        names = {j["id"]: j["name"] for j in self.server.api.snapshot().get("jobs", [])}
        reply: dict[str, Any] = {
            "job": job.id,
            "order": order,
            "queued": [{"id": i, "name": names.get(i, i)} for i in order],
        }
        if anchor is not None and anchor not in order:
            reply["note"] = f"{after} is not queued any more, so {job.name} went to the end"
        return reply

    # ------------------------------------------------------------ the player

    def _song(self, ref: str) -> media.Song:
        scheduler = self.server.api.scheduler
        return media.published_song(scheduler.find(ref), scheduler.settings.paths.outbox)

    def _api_player(self, scheduler: Any, body: dict[str, Any], ref: str) -> dict[str, Any]:
        return media.player(self._song(ref))

    def _api_beats(self, scheduler: Any, body: dict[str, Any], ref: str) -> dict[str, Any]:
        return media.beats(self._song(ref))

    def _file_stem(self, api: ApiServer, ref: str, stem: str) -> None:
        song = self._song(ref)
        name = song.stem(stem)["file"]
        handle, size = media.open_file(song, name)
        with handle:
            self._send_file(
                handle,
                size,
                media.AUDIO_TYPES.get(Path(name).suffix.lower(), "application/octet-stream"),
            )

    def _file_preview(self, api: ApiServer, ref: str) -> None:
        song = self._song(ref)
        if media.player(song)["preview"] is None:
            raise media.NoSuchFile(
                f"{song.job.name} has no preview picture (output.preview was off)"
            )
        handle, size = media.open_file(song, media.PREVIEW)
        with handle:
            self._send_file(handle, size, "image/png")

    # ------------------------------------------------------------ adding songs and links

    def _api_intake(self, scheduler: Any, body: dict[str, Any]) -> dict[str, Any]:
        return upload.limits(scheduler.settings)

    def _upload(self, api: ApiServer) -> dict[str, Any]:
        if self.headers.get("Transfer-Encoding"):
            raise HttpError(411, "send the file with a Content-Length (no chunked bodies)")
        if self._unread < 0 or self.headers.get("Content-Length") is None:
            raise HttpError(411, "send the file with a Content-Length (its size in bytes)")
        kind = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if kind != "application/octet-stream":
            raise HttpError(415, "send the file's bytes as Content-Type: application/octet-stream")
        query = self._query("name", "preset")
        name, preset = query.get("name", ""), query.get("preset") or None
        if not name:
            raise HttpError(400, "say the file's name: POST /api/uploads?name=NAME")
        settings = api.scheduler.settings
        path = upload.receive(CountedBody(self), self._unread, settings, name, preset)
        return {
            "file": path.relative_to(settings.paths.inbox).as_posix(),
            "bytes": path.stat().st_size,
            "preset": preset,
        }

    def _api_link(self, scheduler: Any, body: dict[str, Any]) -> dict[str, Any]:
        _only(body, "url", "name", "preset")
        url, name, preset = body.get("url"), body.get("name"), body.get("preset")
        if not isinstance(url, str) or not url:
            raise HttpError(400, 'send the link: {"url": "https://…"}')
        if not isinstance(name, (str, type(None))) or not isinstance(preset, (str, type(None))):
            raise HttpError(400, '"name" and "preset" must be strings')
        settings = scheduler.settings
        path = upload.write_link(settings, url, name or None, preset or None)
        return {
            "file": path.relative_to(settings.paths.inbox).as_posix(),
            "url": url.strip(),
            "preset": preset or None,
        }

    # ------------------------------------------------------------ the page and the stream

    def _stream(self, api: ApiServer) -> None:
        client = api.broadcaster.attach()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("X-Accel-Buffering", "no")
            self._common_headers()
            self.end_headers()
            written = time.monotonic()
            while True:
                frame = client.next(max(0.0, api.keepalive - (time.monotonic() - written)))
                if client.closed:
                    break
                if frame is None:
                    if time.monotonic() - written < api.keepalive:
                        continue
                    frame = b": keep-alive\n\n"
                self.wfile.write(frame)  # sendall with the socket timeout: a stalled reader
                written = time.monotonic()  # is dropped, never waited for
        except OSError as exc:
            log.debug("event stream to %s ended: %s", self.address_string(), exc)
        finally:
            api.broadcaster.detach(client)


def _route(method: str, path: str) -> tuple[str, dict[str, str]]:
    for pattern, methods in ROUTES:
        match = pattern.fullmatch(path)
        if match:
            if method not in methods:
                allowed = ", ".join(methods)
                raise HttpError(
                    405, f"{method} is not allowed on {path}; use {allowed}", {"Allow": allowed}
                )
            return methods[method], {k: unquote(v) for k, v in match.groupdict().items()}
    raise HttpError(404, f"no such endpoint: {path[:200]}")


def _only(body: dict[str, Any], *allowed: str) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise HttpError(400, f"unexpected field(s) in the request body: {', '.join(unknown)}")


def _integer(text: str, name: str, low: int, high: int) -> int:
    value = int(text) if re.fullmatch(r"-?[0-9]{1,9}", text) else None
    if value is None or not low <= value <= high:
        raise HttpError(400, f"{name} must be a whole number from {low} to {high}")
    return value


def _cursor(text: str) -> tuple[float, int]:
    """The `before` of GET /api/jobs: the `next` of the page before, as it was given."""
    match = CURSOR.fullmatch(text)
    if match is None:
        raise HttpError(400, "before must be the `next` of the page before, as it was given")
    return float(match[1]), int(match[2])


def _move_target(body: dict[str, Any], *extra: str) -> tuple[str | None, bool]:
    """(after, first) from {"after": JOB} or {"first": true}."""
    _only(body, "after", "first", *extra)
    first, after = body.get("first", False), body.get("after")
    if not isinstance(first, bool):
        raise HttpError(400, '"first" must be true or false')
    if first and after is not None:
        raise HttpError(400, 'send either "after" or "first", not both')
    if first:
        return None, True
    if not isinstance(after, str) or not after:
        raise HttpError(400, 'say where to move the job: {"after": JOB} or {"first": true}')
    return after, False
