"""A loopback mirror of demucs's model hub, so no test downloads from the internet.

`build_mirror` lays a tiny model out as the hub does — `files.txt` (`root:` folder, then
`<signature>-<sha256 prefix>.th`), `<name>.yaml` naming the signature, and the file itself
under its root folder — with the real checksum of the tiny file. `ModelHub` serves such a
folder on 127.0.0.1 with HEAD and Range requests, and can hold a transfer at a byte until
`release()` (a gate: "the download is under way" without timing), cut the connection at a
byte once, serve damaged bytes, or send one byte now and then (`trickle`). It can also lie
as a broken or hostile server does: a HEAD that names a size of its choosing (`head_size`),
and a model file's body streamed without a length, `stream_size` bytes long or without end
(`endless`: until the client hangs up, the hub stops, or ENDLESS bytes, so that a client
without a limit fails a test instead of filling the disk). It records every request.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import re
import threading
import urllib.parse
from pathlib import Path
from typing import Any

CHUNK = 16 * 1024
ENDLESS = 64 * 1024 * 1024


def build_mirror(
    folder: Path,
    model_file: Path,
    name: str = "htdemucs",
    sig: str = "0a1b2c3d",
    root: str = "hybrid_transformer/",
) -> Path:
    """`folder` as the hub lays out `model_file` for the model `name`; returns the file."""
    data = model_file.read_bytes()
    served = folder / root / f"{sig}-{hashlib.sha256(data).hexdigest()[:8]}.th"
    served.parent.mkdir(parents=True, exist_ok=True)
    served.write_bytes(data)
    (folder / "files.txt").write_text(f"# a tiny untrained model\nroot: {root}\n{served.name}\n")
    (folder / f"{name}.yaml").write_text(f"models: ['{sig}']\n")
    return served


@dataclasses.dataclass
class Request:
    method: str
    path: str
    range: str | None
    sent: int = 0  # body bytes written


class ModelHub:
    def __init__(self, root: Path):
        self.root = root
        self.requests: list[Request] = []
        self.hold_at: int | None = None  # a model file's transfer waits at this byte
        self.cut_at: int | None = None  # ... or the connection closes there (once)
        self.damaged = False  # model files served with one byte changed
        self.head_size: int | None = None  # a HEAD's Content-Length for a model file
        self.stream_size: int | None = None  # a model file's GET: this many bytes, no length
        self.endless = False  # ... or bytes without end
        self.trickle: float | None = None  # a model file's body: one byte each this many s
        self._stopping = threading.Event()
        self.held = threading.Event()  # a transfer waits at hold_at
        self._release = threading.Event()
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                hub._serve(self, body=False)

            def do_GET(self) -> None:
                hub._serve(self, body=True)

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = False  # stop() waits for every handler
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self._thread = threading.Thread(target=self.server.serve_forever, name="model-hub")

    def __enter__(self) -> ModelHub:
        self._thread.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self._stopping.set()
        self.release()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()

    def release(self) -> None:
        """Let a held transfer go on (and no later one wait)."""
        self.hold_at = None
        self._release.set()

    def gets(self, suffix: str = ".th") -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith(suffix)]

    def _serve(self, handler: http.server.BaseHTTPRequestHandler, body: bool) -> None:
        path = urllib.parse.unquote(urllib.parse.urlsplit(handler.path).path).lstrip("/")
        record = Request(handler.command, path, handler.headers.get("Range"))
        self.requests.append(record)
        target = (self.root / path).resolve()
        if not target.is_file() or self.root.resolve() not in target.parents:
            handler.send_error(404)
            return
        data = target.read_bytes()
        model = target.suffix == ".th"
        if model and self.damaged:
            middle = len(data) // 2
            data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]
        if model and (self.endless or self.stream_size is not None) and body:
            handler.send_response(200)
            handler.end_headers()  # no length: the body ends when the connection does
            try:
                self._stream(handler, record, data)
            except OSError:  # the client hung up
                pass
            return
        if model and self.head_size is not None and not body:
            handler.send_response(200)
            handler.send_header("Content-Length", str(self.head_size))
            handler.end_headers()
            return
        start = 0
        match = re.fullmatch(r"bytes=(\d+)-", record.range or "")
        if match:
            start = int(match.group(1))
            if start >= len(data):
                handler.send_error(416)
                return
            handler.send_response(206)
            handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            handler.send_response(200)
        handler.send_header("Content-Length", str(len(data) - start))
        handler.send_header("Accept-Ranges", "bytes")
        handler.end_headers()
        if not body:
            return
        try:
            self._send(handler, record, data, start, model)
        except OSError:  # the client went away (Ctrl-C, a killed worker)
            pass

    def _stream(
        self, handler: http.server.BaseHTTPRequestHandler, record: Request, data: bytes
    ) -> None:
        """`data` over and over: `stream_size` bytes, or until the client or the hub stops."""
        block = (data * (CHUNK * 4 // len(data) + 1))[: CHUNK * 4]
        total = ENDLESS if self.endless else (self.stream_size or 0)
        while record.sent < total:
            if self._stopping.is_set():
                return
            size = min(len(block), total - record.sent)
            handler.wfile.write(block[:size])
            record.sent += size
        handler.wfile.flush()

    def _send(
        self,
        handler: http.server.BaseHTTPRequestHandler,
        record: Request,
        data: bytes,
        start: int,
        model: bool,
    ) -> None:
        position = start
        while position < len(data):
            end = min(position + CHUNK, len(data))
            if model and self.trickle is not None:
                if self._stopping.wait(self.trickle):
                    return
                end = position + 1
            for stop_at, action in ((self.hold_at, "hold"), (self.cut_at, "cut")):
                if model and stop_at is not None and position <= stop_at < end:
                    end = stop_at
                    if end > position:
                        handler.wfile.write(data[position:end])
                        record.sent += end - position
                        position = end
                    handler.wfile.flush()
                    if action == "cut":
                        self.cut_at = None
                        return
                    self.held.set()
                    self._release.wait(60)
                    break
            if end > position:
                handler.wfile.write(data[position:end])
                record.sent += end - position
                position = end
        handler.wfile.flush()
