"""HTTP plumbing under the API: a server (HTTP or HTTPS) that can drop every connection, and
a request handler whose answers are JSON (errors too), never cached, never framed, with the
body capped and read away before answering.

One connection, one request: every answer closes the connection (HTTP/1.0 semantics), so no
idle keep-alive connection holds a thread. The API's routes and security checks are in
`api.py`; this module knows nothing of the queue.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import socketserver
import ssl
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from stemdeck_watch.ui.web import media

log = logging.getLogger(__name__)

MAX_BODY = 64 * 1024
MAX_DRAIN = 1024 * 1024  # an unread body up to this size is read away before closing
IO_TIMEOUT = 10.0  # a client that neither sends nor reads for this long is dropped
CSP = "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".webmanifest": "application/manifest+json",
    ".woff2": "font/woff2",
    ".txt": "text/plain; charset=utf-8",
}
STATIC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class HttpError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


class LoopbackServer(ThreadingHTTPServer):
    """A threading server that can wake every connection it holds (stop must not wait on a
    stalled client), binds without a DNS lookup and keeps tracebacks of clients that hung up
    out of the terminal."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        api: Any,
        handler: type[BaseHTTPRequestHandler],
        tls: ssl.SSLContext | None = None,
    ):
        self.api = api  # what the handlers serve
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, handler)
        if tls is not None:
            # the handshake happens on the connection's own thread, at its first read (and
            # under its timeout), never in the accepting loop where one slow client would
            # hold up every other
            self.socket = tls.wrap_socket(
                self.socket, server_side=True, do_handshake_on_connect=False
            )

    def server_bind(self) -> None:
        # HTTPServer.server_bind would look up the host's FQDN: a DNS query at every start
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

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


class JsonHandler(BaseHTTPRequestHandler):
    """The answers every route gives: JSON, a file (with one HTTP range), a static page file.
    A subclass routes in `_handle`."""

    server: LoopbackServer
    timeout = IO_TIMEOUT
    static_dir = Path(".")  # where the static files come from (a subclass says)
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

    def _handle(self, method: str) -> None:
        """Route one request; a handler with no routes of its own has nothing to serve."""
        self.close_connection = True
        self._refuse(404, f"not found: {urlsplit(self.path).path[:200]}")

    # ------------------------------------------------------------ requests

    def _read_json(self) -> dict[str, Any]:
        if self.headers.get("Transfer-Encoding"):
            raise HttpError(411, "send the body with a Content-Length (no chunked bodies)")
        length = self._unread
        if length < 0:
            raise HttpError(400, "the Content-Length header is not a number")
        if length > MAX_BODY:
            raise HttpError(
                413, f"the request body has {length} bytes; at most {MAX_BODY} are accepted"
            )
        try:
            raw = self.rfile.read(length) if length else b""
        except OSError:
            raise HttpError(400, "the request body did not arrive") from None
        self._unread = 0
        if len(raw) < length:
            raise HttpError(400, "the request body ended early")
        if not raw:  # no body; one of spaces is not JSON
            return {}
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise HttpError(400, f"the request body is not valid JSON: {exc}") from None
        except RecursionError:  # nested deeper than the parser's stack allows
            raise HttpError(400, "the request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object")
        try:  # JSON's escapes can spell a lone surrogate, which no file or URL can hold
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise HttpError(
                400, "the request body holds text that is not valid Unicode (a lone surrogate)"
            ) from None
        return body

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

    # ------------------------------------------------------------ answers

    def _static(self, method: str, path: str) -> None:
        if method not in ("GET", "HEAD"):
            raise HttpError(405, f"{method} is not allowed on {path}", {"Allow": "GET, HEAD"})
        name = "index.html" if path == "/" else unquote(path[1:])
        file = self.static_dir / name
        content_type = CONTENT_TYPES.get(file.suffix.lower())
        if (
            not STATIC_NAME.fullmatch(name)
            or content_type is None
            or not file.is_file()
            or file.resolve().parent != self.static_dir
        ):
            raise HttpError(404, f"not found: {path[:200]}")
        self._send(200, file.read_bytes(), content_type)

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

    def _send_json(self, status: int, reply: Any) -> None:
        self._send(status, json.dumps(reply).encode(), "application/json")

    def _refuse(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        log.info(
            "refused %s %s: %d %s", self.command, urlsplit(self.path).path[:200], status, message
        )
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

    def _send(
        self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
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
        for name, value in (
            ("Cache-Control", "no-store"),
            ("X-Content-Type-Options", "nosniff"),
            # no address leaves for another site; and the page's own forms (sign in, sign
            # out) keep their Origin: under no-referrer a browser sends `Origin: null`
            ("Referrer-Policy", "same-origin"),
            ("X-Frame-Options", "DENY"),
            ("Content-Security-Policy", CSP),
            ("Cross-Origin-Resource-Policy", "same-origin"),
            ("Connection", "close"),
        ):
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
        log.debug(
            '%s "%s %s" %s',
            self.address_string(),
            self.command,
            urlsplit(self.path).path[:200],
            code,
        )

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


class CountedBody:
    """The request body as an upload reads it: what is read is no longer left to drain."""

    def __init__(self, handler: JsonHandler):
        self._handler = handler

    def read(self, size: int) -> bytes:
        data = self._handler.rfile.read(size)
        self._handler._unread -= len(data)
        if not data:
            self._handler._unread = 0  # the client went away: nothing more will come
        return data
