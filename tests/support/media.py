"""Link files and a loopback media server for the link tests: real audio, a throttled and a
stalling download, errors and HTML, all on 127.0.0.1."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path


def url_file(folder: Path, name: str, url: str) -> Path:
    path = folder / name
    path.write_bytes(f"[InternetShortcut]\r\nURL={url}\r\nIconIndex=0\r\n".encode())
    return path


class MediaServer:
    """Serves real audio files, a throttled and a stalling download, errors and HTML."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.release = threading.Event()  # ends stalls and throttles when the test is over
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                server.requests.append(self.path)
                server.handle(self)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{path}"

    def handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        name = h.path.lstrip("/").split("?")[0]
        if name == "missing.wav":
            h.send_error(404)
            return
        if name == "to-file":
            h.send_response(302)
            h.send_header("Location", "file:///etc/passwd")
            h.end_headers()
            return
        if name == "page.html":
            body = b"<html><body><p>No media here.</p></body></html>"
            self._head(h, "text/html", len(body))
            h.wfile.write(body)
            return
        kind, _, file = name.partition("-")
        data = (
            (self.folder / (file or name)).read_bytes()
            if kind in ("slow", "stall", "octet")
            else (self.folder / name).read_bytes()
        )
        self._head(h, "application/octet-stream" if kind == "octet" else "audio/wav", len(data))
        if h.command == "HEAD":
            return
        try:
            if kind == "slow":  # ~64 KB per 0.1 s
                for i in range(0, len(data), 65536):
                    h.wfile.write(data[i : i + 65536])
                    h.wfile.flush()
                    if self.release.wait(0.1):
                        break
            elif kind == "stall":
                h.wfile.write(data[: len(data) // 3])
                h.wfile.flush()
                self.release.wait(60)
            else:
                h.wfile.write(data)
        except OSError:
            pass

    @staticmethod
    def _head(h: http.server.BaseHTTPRequestHandler, content_type: str, length: int) -> None:
        h.send_response(200)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(length))
        h.end_headers()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)
