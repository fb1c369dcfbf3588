"""The local HTTP API and its one event stream, on a loopback address only.

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
(`openapi.py`). The stream itself is `stream.py`.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import re
import socket
import socketserver
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from stemdeck_watch.core.config import ApiSettings
from stemdeck_watch.ui import discovery, media, openapi, upload
from stemdeck_watch.ui.pagecode import OneTimeCodes
from stemdeck_watch.ui.stream import KEEPALIVE, PROGRESS_INTERVAL, Broadcaster
from stemdeck_watch.core.errors import ConfigError, ControlError, JobNotFound
from stemdeck_watch.core.events import EventBus

log = logging.getLogger(__name__)

PAGE_DIR = Path(__file__).resolve().parent / "page"
MAX_BODY = 64 * 1024
MAX_DRAIN = 1024 * 1024      # an unread body up to this size is read away before closing
IO_TIMEOUT = 10.0            # a client that neither sends nor reads for this long is dropped
CSP = "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
    ".json": "application/json", ".svg": "image/svg+xml", ".png": "image/png",
    ".ico": "image/x-icon", ".webmanifest": "application/manifest+json", ".woff2": "font/woff2",
    ".txt": "text/plain; charset=utf-8",
}
STATIC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
JOB = r"/api/jobs/(?P<ref>[^/]+)"
ROUTES: list[tuple[re.Pattern[str], dict[str, str]]] = [
    (re.compile(pattern), methods) for pattern, methods in (
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
PAGE_LIMIT, MAX_PAGE_LIMIT = 100, 1000  # GET /api/jobs: jobs per page, by default and at most
CURSOR = re.compile(openapi.CURSOR)  # its `before`: a job's created_at and rowid


class HttpError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


class ApiServer:
    """The server, its broadcaster and the discovery file, started and stopped together."""

    def __init__(self, scheduler: Any, bus: EventBus, settings: ApiSettings, state_dir: Path, *,
                 keepalive: float = KEEPALIVE, progress_interval: float = PROGRESS_INTERVAL):
        host = "127.0.0.1" if settings.host == "localhost" else settings.host
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ConfigError(f"api.host = {settings.host!r} is not a loopback address; the "
                              f"API may only listen on 127.0.0.1, localhost or ::1")
        self.scheduler, self.host, self.state_dir = scheduler, host, state_dir
        self.keepalive = keepalive
        self._wanted_port = settings.port
        self.port = 0
        self.token = ""
        self.codes = OneTimeCodes()
        self.broadcaster = Broadcaster(self.snapshot, bus, progress_interval)
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self._published: discovery.Discovery | None = None

    @property
    def url(self) -> str:
        return discovery.base_url(self.host, self.port)

    def start(self) -> None:
        """Bind (OSError if the port is taken), serve, then write the discovery file."""
        self.token = discovery.new_token()
        self._httpd = _Server((self.host, self._wanted_port), self)
        self.port = self._httpd.server_address[1]
        self._allowed_hosts = {f"{name}:{self.port}" for name in ("127.0.0.1", "localhost",
                                                                  "[::1]")}
        self._allowed_origins = {f"http://{host}" for host in self._allowed_hosts}
        self.broadcaster.start()
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.2,),
                                        name="stemdeck-api", daemon=True)
        self._thread.start()
        self._published = discovery.publish(self.state_dir, self.host, self.port, os.getpid(),
                                            self.token)
        log.info("local API and queue page on %s (token in %s)", self.url,
                 self.state_dir / discovery.TOKEN_FILE)

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
        snap.setdefault("service", {"running": True, "pid": os.getpid()})
        return snap

    def host_allowed(self, host: str) -> bool:
        return host.strip().lower() in self._allowed_hosts

    def origin_allowed(self, origin: str) -> bool:
        return origin.strip().lower() in self._allowed_origins

    def token_ok(self, presented: str) -> bool:
        return bool(self.token) and hmac.compare_digest(presented.encode(), self.token.encode())


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], api: ApiServer):
        self.api = api
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind would look up the host's FQDN: a DNS query at every start
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that hung up mid-request: not worth a traceback on the terminal
        log.debug("connection from %s ended with an error", client_address, exc_info=True)

    def disconnect_all(self) -> None:
        """Wake every connection thread blocked on a socket (a stalled reader or writer)."""
        with self._open_lock:
            sockets = list(self._open)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(BaseHTTPRequestHandler):
    """One connection, one request: check, route, call the scheduler, answer JSON."""

    server: _Server
    timeout = IO_TIMEOUT
    _unread = 0  # declared body bytes not read yet; read away before answering

    def version_string(self) -> str:
        return "stemdeck-watch"

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_OPTIONS(self) -> None:
        self._handle("OPTIONS")  # a CORS preflight gets no CORS headers: refused

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
            if path != "/api" and not path.startswith("/api/"):
                return self._static(method, path)
            if path not in PUBLIC:
                self._authorize(api)
            name, params = _route(method, path)
            if name not in QUERIED and urlsplit(self.path).query:
                raise HttpError(400, f"unexpected query string: {path[:200]} takes no "
                                     f"parameters")
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
            raise HttpError(403, f"refused: Host {shown!r} is not this service's loopback "
                                 f"address (127.0.0.1:{api.port}, localhost:{api.port})")
        origins = self.headers.get_all("Origin") or []
        if len(origins) > 1 or (origins and not api.origin_allowed(origins[0])):
            raise HttpError(403, f"refused: requests from {origins[0][:100]!r} are not allowed; "
                                 f"only the queue page served here may call the API")

    def _authorize(self, api: ApiServer) -> None:
        challenge = {"WWW-Authenticate": 'Bearer realm="stemdeck-watch"'}
        header = self.headers.get("Authorization")
        if not header:
            raise HttpError(401, "missing token: send 'Authorization: Bearer <token>' with the "
                                 "token from api.token in the service's state folder", challenge)
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not api.token_ok(token.strip()):
            raise HttpError(401, "wrong token: the service makes a new one at every start; read "
                                 "api.token in its state folder again", challenge)

    def _read_json(self) -> dict[str, Any]:
        if self.headers.get("Transfer-Encoding"):
            raise HttpError(411, "send the body with a Content-Length (no chunked bodies)")
        length = self._unread
        if length < 0:
            raise HttpError(400, "the Content-Length header is not a number")
        if length > MAX_BODY:
            raise HttpError(413, f"the request body has {length} bytes; at most {MAX_BODY} "
                                 f"are accepted")
        try:
            raw = self.rfile.read(length) if length else b""
        except OSError:
            raise HttpError(400, "the request body did not arrive") from None
        self._unread = 0
        if len(raw) < length:
            raise HttpError(400, "the request body ended early")
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise HttpError(400, f"the request body is not valid JSON: {exc}") from None
        except RecursionError:  # nested deeper than the parser's stack allows
            raise HttpError(400, "the request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object")
        return body

    # ------------------------------------------------------------ actions

    def _api_queue(self, scheduler: Any, body: dict[str, Any]) -> dict[str, Any]:
        return self.server.api.snapshot()

    def _api_jobs(self, scheduler: Any, body: dict[str, Any]) -> dict[str, Any]:
        query = self._query("before", "limit")
        limit = _integer(query.get("limit", str(PAGE_LIMIT)), "limit", 1, MAX_PAGE_LIMIT)
        before = _cursor(query["before"]) if "before" in query else None
        jobs, after = scheduler.jobs_page(before, limit)
        return {"jobs": [job.to_status() for job in jobs],
                "next": f"{after[0]!r}_{after[1]}" if after else None}

    def _api_openapi(self, scheduler: Any, body: dict[str, Any]) -> dict[str, Any]:
        settings = scheduler.settings
        return openapi.document(self.server.api.url, settings.watch.extensions,
                                sorted(settings.presets))

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
            raise HttpError(403, "this page link was already used or has expired; open the "
                                 "page again with `stemdeck-watch open` or the tray")
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
            raise HttpError(400, 'say which job to move: {"job": ID, "after": ID} or '
                                 '{"job": ID, "first": true}')
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
        reply: dict[str, Any] = {"job": job.id, "order": order,
                                 "queued": [{"id": i, "name": names.get(i, i)} for i in order]}
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
            self._send_file(handle, size, media.AUDIO_TYPES.get(Path(name).suffix.lower(),
                                                                "application/octet-stream"))

    def _file_preview(self, api: ApiServer, ref: str) -> None:
        song = self._song(ref)
        if media.player(song)["preview"] is None:
            raise media.NoSuchFile(f"{song.job.name} has no preview picture (output.preview "
                                   f"was off)")
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
            raise HttpError(415, "send the file's bytes as Content-Type: "
                                 "application/octet-stream")
        query = self._query("name", "preset")
        name, preset = query.get("name", ""), query.get("preset") or None
        if not name:
            raise HttpError(400, "say the file's name: POST /api/uploads?name=NAME")
        settings = api.scheduler.settings
        path = upload.receive(_CountedBody(self), self._unread, settings, name, preset)
        return {"file": path.relative_to(settings.paths.inbox).as_posix(),
                "bytes": path.stat().st_size, "preset": preset}

    def _api_link(self, scheduler: Any, body: dict[str, Any]) -> dict[str, Any]:
        _only(body, "url", "name", "preset")
        url, name, preset = body.get("url"), body.get("name"), body.get("preset")
        if not isinstance(url, str) or not url:
            raise HttpError(400, 'send the link: {"url": "https://…"}')
        if not isinstance(name, (str, type(None))) or not isinstance(preset, (str, type(None))):
            raise HttpError(400, '"name" and "preset" must be strings')
        settings = scheduler.settings
        path = upload.write_link(settings, url, name or None, preset or None)
        return {"file": path.relative_to(settings.paths.inbox).as_posix(), "url": url.strip(),
                "preset": preset or None}

    def _send_file(self, handle: Any, size: int, content_type: str) -> None:
        """The file, or the one range of it the `Range` header asks for (206)."""
        try:
            span = media.byte_range(self.headers.get("Range"), size)
        except media.NotSatisfiable as exc:
            raise HttpError(416, str(exc), {"Content-Range": f"bytes */{exc.size}"}) from None
        first, last = span if span else (0, size - 1)
        self._drain()
        self.send_response(206 if span else 200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(last - first + 1))
        self.send_header("Accept-Ranges", "bytes")
        if span:
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self._common_headers()
        self.end_headers()
        log.debug("sent bytes %d-%d/%d of %s", first, last, size, urlsplit(self.path).path)
        if self.command != "HEAD":
            try:
                media.copy_range(handle, first, last - first + 1, self.wfile.write)
            except OSError as exc:  # the player seeked away and dropped the request
                log.debug("%s stopped reading a file: %s", self.address_string(), exc)

    def _query(self, *allowed: str) -> dict[str, str]:
        """The query string's parameters: only `allowed` ones, each at most once."""
        pairs = parse_qsl(urlsplit(self.path).query, keep_blank_values=True)
        names = [name for name, _ in pairs]
        unknown = sorted(set(names) - set(allowed))
        if unknown:
            raise HttpError(400, f"unexpected query parameter(s): {', '.join(unknown)[:200]}")
        if len(names) != len(set(names)):
            raise HttpError(400, "a query parameter is given more than once")
        return dict(pairs)

    # ------------------------------------------------------------ the page and the stream

    def _static(self, method: str, path: str) -> None:
        if method not in ("GET", "HEAD"):
            raise HttpError(405, f"{method} is not allowed on {path}", {"Allow": "GET, HEAD"})
        name = "index.html" if path == "/" else unquote(path[1:])
        file = PAGE_DIR / name
        content_type = CONTENT_TYPES.get(file.suffix.lower())
        if (not STATIC_NAME.fullmatch(name) or content_type is None or not file.is_file()
                or file.resolve().parent != PAGE_DIR):
            raise HttpError(404, f"not found: {path[:200]}")
        self._send(200, file.read_bytes(), content_type)

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

    # ------------------------------------------------------------ answers

    def _send_json(self, status: int, reply: Any) -> None:
        self._send(status, json.dumps(reply).encode(), "application/json")

    def _refuse(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        log.info("refused %s %s: %d %s", self.command, urlsplit(self.path).path[:200], status,
                 message)
        self._send(status, json.dumps({"error": message}).encode(), "application/json", headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Also for requests http.server could not parse: JSON, like every other answer."""
        self.close_connection = True
        self._unread = 0
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "error"
        self._send(code, json.dumps({"error": message or phrase}).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str,
              headers: dict[str, str] | None = None) -> None:
        self._drain()
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self._common_headers()
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except OSError as exc:
            log.debug("could not answer %s: %s", self.address_string(), exc)

    def _common_headers(self) -> None:
        for name, value in (("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff"),
                            ("Referrer-Policy", "no-referrer"), ("X-Frame-Options", "DENY"),
                            ("Content-Security-Policy", CSP),
                            ("Cross-Origin-Resource-Policy", "same-origin"),
                            ("Connection", "close")):
            self.send_header(name, value)

    def _drain(self) -> None:
        """Read away a body nobody read (a refused request): closing a socket with unread
        data resets the connection, and the client might lose our answer."""
        left, self._unread = self._unread, 0
        if not 0 < left <= MAX_DRAIN:
            return
        try:
            while left > 0 and (chunk := self.rfile.read(min(left, 65536))):
                left -= len(chunk)
        except OSError:
            pass

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        log.debug('%s "%s %s" %s', self.address_string(), self.command,
                  urlsplit(self.path).path[:200], code)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


class _CountedBody:
    """The request body as an upload reads it: what is read is no longer left to drain."""

    def __init__(self, handler: _Handler):
        self._handler = handler

    def read(self, size: int) -> bytes:
        data = self._handler.rfile.read(size)
        self._handler._unread -= len(data)
        if not data:
            self._handler._unread = 0  # the client went away: nothing more will come
        return data


def _route(method: str, path: str) -> tuple[str, dict[str, str]]:
    for pattern, methods in ROUTES:
        match = pattern.fullmatch(path)
        if match:
            if method not in methods:
                allowed = ", ".join(methods)
                raise HttpError(405, f"{method} is not allowed on {path}; use {allowed}",
                                {"Allow": allowed})
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
