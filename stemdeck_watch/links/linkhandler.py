"""yt-dlp's connection layer for a link: its urllib handler, with every connection and every
response through the link's guard (links/netguard.py).

Connections resolve, check and connect through the guard; responses (also redirects and
errors) are read through a counter with the guard's cap, compressed ones decoded with the
decoded size bounded too; a redirect to anything but http(s) ends the fetch. Only http and
https are handled: yt-dlp's ftp, data and file handlers are not there.
"""

from __future__ import annotations

import functools
import http.client
import io
import urllib.parse
import urllib.request
import urllib.response
import zlib
from typing import Any, Callable
from urllib.parse import urlsplit

from yt_dlp.networking._helper import add_accept_encoding_header
from yt_dlp.networking._urllib import HTTPHandler, ProxyHandler, RedirectHandler, UrllibRH

from stemdeck_watch.links.netguard import Guard, Stop

CHUNK = 1 << 16  # bytes per read when a whole response is asked for
ENCODINGS = ("gzip", "deflate")  # decoded here with a bound on the decoded size


class Bounded:
    """A response body read through the guard: counted against its cap, and every read
    checks for a stop (a read cut short by a shut-down socket then says why)."""

    def __init__(self, raw: http.client.HTTPResponse, guard: Guard):
        self._raw, self._guard = raw, guard
        self._cap, self._over = guard.cap
        self._count = 0
        guard.opened(self)

    @property
    def closed(self) -> bool:
        return self._raw.closed

    def read(self, amt: int | None = None) -> bytes:
        if amt is None or amt < 0:
            parts = []
            while chunk := self.read(CHUNK):
                parts.append(chunk)
            return b"".join(parts)
        self._guard.check()
        try:
            with self._guard.waiting():
                data = self._raw.read(amt)
        except Exception:
            self._guard.check()
            raise
        self._guard.check()
        self._count += len(data)
        if self._cap is not None and self._count > self._cap:
            raise self._guard.stop(self._over)
        return data

    def close(self) -> None:
        self._raw.close()


def _decoded(
    body: Bounded, encodings: list[str], cap: int | None, over: Stop, guard: Guard
) -> bytes:
    """A compressed body, decoded with the decoded size bounded by `cap` too."""
    data = body.read()
    for encoding in encodings:
        wbits = zlib.MAX_WBITS | 16 if encoding == "gzip" else -zlib.MAX_WBITS
        try:
            data = _inflate(data, wbits, cap)
        except zlib.error:
            if encoding != "deflate":
                raise
            data = _inflate(data, zlib.MAX_WBITS, cap)  # deflate sent with a zlib header
        if cap is not None and len(data) > cap:
            raise guard.stop(over)
    return data


def _inflate(data: bytes, wbits: int, cap: int | None) -> bytes:
    return zlib.decompressobj(wbits).decompress(data, (cap + 1) if cap is not None else 0)


class _GuardedHTTPHandler(HTTPHandler):
    def __init__(self, guard: Guard, **kwargs: Any):
        super().__init__(**kwargs)
        self._guard = guard

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        with self._guard.waiting():  # resolving, connecting, sending, the response's head
            return self.do_open(self._factory(http.client.HTTPConnection, req), req)

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        with self._guard.waiting():
            return self.do_open(
                self._factory(http.client.HTTPSConnection, req), req, context=self._context
            )

    def _factory(self, base: type, req: urllib.request.Request) -> Callable[..., Any]:
        """Connections that go through the guard. Through a proxy the target's own name is
        checked here (the proxy connects to it), and the proxy itself is the user's."""
        proxied = (
            req.has_proxy()
            or getattr(req, "_tunnel_host", None) is not None
            or req.has_header("Ytdl-socks-proxy")
        )
        if proxied:
            target = urlsplit(req.full_url)
            self._guard.check_host(
                target.hostname or "", target.port or (443 if target.scheme == "https" else 80)
            )
        conn_class = self._make_conn_class(base, req)
        guard = self._guard
        connect = functools.partial(guard.connect, checked=not proxied)
        source = self._source_address

        def make(*args: Any, **kwargs: Any) -> http.client.HTTPConnection:
            conn = conn_class(*args, **kwargs)
            conn._create_connection = connect
            if source is not None:
                conn.source_address = (source, 0)
            plain = conn.connect

            def connect_tracked() -> None:
                plain()
                guard.track(conn.sock)  # the TLS socket, or a SOCKS proxy's

            conn.connect = connect_tracked
            return conn

        return make

    def http_response(
        self, req: urllib.request.Request, resp: http.client.HTTPResponse
    ) -> urllib.response.addinfourl:
        """Every response, also redirects and errors, is read through the guard."""
        body = Bounded(resp, self._guard)
        encodings = [
            e.strip().lower()
            for e in reversed(resp.headers.get("Content-Encoding", "").split(","))
            if e.strip()
        ]
        source: Any = body
        if encodings and all(e in ENCODINGS for e in encodings):
            cap, over = self._guard.cap
            source = io.BytesIO(_decoded(body, encodings, cap, over, self._guard))
            body.close()
        wrapped = urllib.response.addinfourl(source, resp.headers, resp.url, resp.status)
        wrapped.msg = resp.msg  # type: ignore[attr-defined]  # urllib's handlers read it
        return wrapped

    https_response = http_response


class _GuardedRedirectHandler(RedirectHandler):
    """A redirect to anything but http(s) (a `file:` URL) ends the fetch, saying so."""

    def __init__(self, guard: Guard):
        super().__init__()
        self._guard = guard

    def http_error_302(
        self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any
    ) -> Any:
        target = headers.get("location") or headers.get("uri")
        if target:
            scheme = urlsplit(urllib.parse.urljoin(req.full_url, target)).scheme.lower()
            if scheme not in ("http", "https"):
                fp.close()
                raise self._guard.stop(Stop.SCHEME, scheme)
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


class GuardedRH(UrllibRH):
    """yt-dlp's urllib handler, for http(s) only, with every connection and response through
    the guard. The only handler a link's YoutubeDL has: no other library's connections."""

    _SUPPORTED_URL_SCHEMES = ("http", "https")
    RH_NAME = "stemdeck"

    def __init__(self, *, guard: Guard, **kwargs: Any):
        super().__init__(**{**kwargs, "enable_file_urls": False})
        self._guard = guard

    def _prepare_headers(self, _request: Any, headers: Any) -> None:
        add_accept_encoding_header(headers, list(ENCODINGS))

    def _create_instance(
        self, proxies: Any, cookiejar: Any, legacy_ssl_support: Any = None
    ) -> urllib.request.OpenerDirector:
        opener = urllib.request.OpenerDirector()
        for handler in (
            ProxyHandler(proxies),
            _GuardedHTTPHandler(
                self._guard,
                debuglevel=int(bool(self.verbose)),
                context=self._make_sslcontext(legacy_ssl_support=legacy_ssl_support),
                source_address=self.source_address,
            ),
            urllib.request.HTTPCookieProcessor(cookiejar),
            urllib.request.UnknownHandler(),
            urllib.request.HTTPDefaultErrorHandler(),
            urllib.request.HTTPErrorProcessor(),
            _GuardedRedirectHandler(self._guard),
        ):
            opener.add_handler(handler)
        opener.addheaders = []
        return opener
