"""The real service as the model-based seams test drives it (tests/test_model_based.py).

`stemdeck-watch run` runs as a process of its own, so the test can stop it cleanly or SIGKILL
it and start it again on the same folders; the test steers it through its local API (the
calls the CLI, the page and the tray make) and reads its registry straight from the SQLite file,
read-only, as a restart would find it. Links are served by a loopback HTTP server; the disk
rules use a small tmpfs for the outbox and the scratch folder (mounting needs root; elsewhere
they are left out).
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

from stemdeck_watch.ui.web import discovery
from stemdeck_watch.workers import zygote
from stemdeck_watch.store.registry import REGISTRY_FILE

from support.helpers import processes

STARTED = "stemdeck-watch is running"
RUNNING = ("downloading", "decoding", "separating", "publishing")
START_TIMEOUT = 180.0  # a loaded CI machine: the worker's torch import alone can take a minute
STOP_TIMEOUT = 120.0
GONE_TIMEOUT = 60.0
# no model is ever downloaded in an example (the owner's repo holds the tiny model): a load of
# a model a drop named fails at once with its name in the job's error, and nothing leaves
# this machine (a hub on a closed loopback port)
NO_DOWNLOADS = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}


# ---------------------------------------------------------------- the registry, read-only


@dataclasses.dataclass(frozen=True)
class JobRow:
    id: str
    name: str
    kind: str
    state: str
    source: str
    rel_path: str
    preset: str | None
    output: str | None
    error: str | None
    signature: tuple[int, int, int] | None
    sha256: str | None
    created_at: float
    faults: int = 0  # attempts the machine cut off (the worker died, stalled, out of memory)


@dataclasses.dataclass(frozen=True)
class RegistryView:
    """Every job, the queued order, the tombstones and the pause, from one read transaction."""

    jobs: dict[str, JobRow]
    order: list[str]
    tombstones: dict[str, tuple[int, int, int] | None]  # input path -> its signature
    waiting: frozenset[str]
    pause_reason: str

    def running(self) -> list[JobRow]:
        return [job for job in self.jobs.values() if job.state in RUNNING]

    def latest_for(self, source: str) -> JobRow | None:
        jobs = [job for job in self.jobs.values() if job.source == source]
        return max(jobs, key=lambda job: job.created_at) if jobs else None

    def ranking(self) -> list[str]:
        """The order jobs will run in: the one publishing was taken first, then the one at
        the worker, then the queue."""
        running = sorted(self.running(), key=lambda j: (j.state != "publishing", j.created_at))
        return [job.id for job in running] + [
            i for i in self.order if i not in {job.id for job in running}
        ]

    def names(self, ids: list[str]) -> list[str]:
        return [f"{self.jobs[i].rel_path}#{i[:6]}" if i in self.jobs else i for i in ids]


def read_registry(state: Path, timeout: float = 30.0) -> RegistryView:
    path = state / REGISTRY_FILE
    empty = RegistryView({}, [], {}, frozenset(), "")
    deadline = time.monotonic() + timeout
    while True:
        if not path.exists():
            return empty
        try:
            return _read(path)
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return empty
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"could not read the registry for {timeout:.0f} s: {exc}"
                ) from exc
            time.sleep(0.05)


def _read(path: Path) -> RegistryView:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10, isolation_level=None)
    try:
        db.execute("BEGIN")
        jobs = {}
        for row in db.execute(
            "SELECT id, name, kind, state, source, rel_path, preset, output, "
            "error, size, mtime_ns, inode, sha256, created_at, faults "
            "FROM jobs"
        ):
            jobs[row[0]] = JobRow(
                id=row[0],
                name=row[1],
                kind=row[2],
                state=row[3],
                source=row[4],
                rel_path=row[5],
                preset=row[6],
                output=row[7],
                error=row[8],
                signature=(row[9], row[10], row[11]) if row[9] is not None else None,
                sha256=row[12],
                created_at=row[13],
                faults=len(json.loads(row[14] or "[]")),
            )
        order = [
            r[0]
            for r in db.execute(
                "SELECT id FROM jobs WHERE state = 'queued' "
                "ORDER BY position IS NULL, position, created_at, rowid"
            )
        ]
        tombstones = {
            r[0]: (tuple(r[1:4]) if r[1] is not None else None)
            for r in db.execute(
                "SELECT path, size, mtime_ns, inode FROM tombstones WHERE kind = 'input'"
            )
        }
        waiting = frozenset(r[0] for r in db.execute("SELECT source FROM waiting"))
        pause = db.execute("SELECT value FROM meta WHERE key = 'pause_reason'").fetchone()
    finally:
        db.close()
    return RegistryView(
        jobs,
        order,
        tombstones,
        waiting,  # type: ignore[arg-type]
        (pause or [""])[0] or "",
    )


# ---------------------------------------------------------------- the service process


def descendants(pid: int) -> set[int]:
    table = processes()
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {
            p for p, (parent, state) in table.items() if parent in frontier and state != "Z"
        } - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    table = processes()
    return {p for p in pids if p in table and table[p][1] != "Z"}


class ServiceProcess:
    """`stemdeck-watch run` on one config, started again as often as the test likes; every
    life logs into its own file under `logs`."""

    def __init__(self, config: Path, state: Path, logs: Path):
        self.config, self.state, self.logs = config, state, logs
        logs.mkdir(parents=True, exist_ok=True)
        self.lives = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.tracked: set[int] = set()  # every process a life started (its worker)
        self._log: Any = None

    @property
    def log_path(self) -> Path:
        return self.logs / f"life-{self.lives:03d}.log"

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def start(self) -> None:
        self.lives += 1
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stemdeck_watch",
                "run",
                "--no-tray",
                "--config",
                str(self.config),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **NO_DOWNLOADS},
        )
        deadline = time.monotonic() + START_TIMEOUT
        while STARTED not in self.output():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the service exited ({self.proc.returncode}) before it started:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the service did not start within {START_TIMEOUT:.0f} s:\n{self.tail()}"
                )
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def worker_pid(self) -> int | None:
        """The separation worker this life started last, if it still runs."""
        started = re.findall(r"started separation worker (\d+)", self.output())
        return int(started[-1]) if started and alive({int(started[-1])}) else None

    def zygote_pid(self) -> int | None:
        """The zygote this life's workers are forked from, if one runs (Linux)."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        for pid, (parent, state) in processes().items():
            if parent != self.proc.pid or state == "Z":
                continue
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if zygote.__name__.encode() in command:
                return pid
        return None

    def _track(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.tracked |= descendants(self.proc.pid)
        self.tracked |= {
            int(p) for p in re.findall(r"started separation worker (\d+)", self.output())
        }

    def stop(self, between: Callable[[], None] | None = None) -> None:
        """A clean stop (SIGTERM, as the service's own signal handler takes it); `between`
        runs after the signal, before the wait for the service to end."""
        assert self.proc is not None
        self._track()
        self.proc.send_signal(signal.SIGTERM)
        if between is not None:
            between()
        try:
            code = self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the service did not stop within {STOP_TIMEOUT:.0f} s of SIGTERM:\n{self.tail()}"
            ) from None
        self._wait_gone()
        if code != 0:
            raise AssertionError(f"the service's clean stop exited {code}:\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL the service alone; its worker must go by itself."""
        assert self.proc is not None
        self._track()
        self.proc.kill()
        self.proc.wait()
        self._track()
        self._wait_gone()

    def _wait_gone(self) -> None:
        deadline = time.monotonic() + GONE_TIMEOUT
        while alive(self.tracked):
            if time.monotonic() > deadline:
                left = alive(self.tracked)
                self.force()
                raise AssertionError(
                    f"processes {sorted(left)} outlived the service by {GONE_TIMEOUT:.0f} s"
                )
            time.sleep(0.05)
        self.tracked.clear()
        if self._log is not None:
            self._log.close()
            self._log = None

    def force(self) -> None:
        """Whatever happened, leave nothing running: each process this object started."""
        if self.proc is not None:
            self._track()
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
        for pid in alive(self.tracked):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.tracked.clear()
        if self._log is not None:
            self._log.close()
            self._log = None

    def api(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        upload: bytes | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """One API request with this life's token; (status, reply). A refused request (4xx)
        is an answer like any other; the caller decides. `upload`: a file's bytes, sent as
        the page sends a dropped file."""
        assert self.proc is not None
        found = discovery.read(self.state)
        if found is None or found.pid != self.proc.pid:
            raise AssertionError(
                f"the running service (pid {self.proc.pid}) published no API "
                f"address in {self.state}:\n{self.tail()}"
            )
        data = json.dumps(body or {}).encode() if method == "POST" else None
        kind = "application/json"
        if upload is not None:
            data, kind = upload, "application/octet-stream"
        request = urllib.request.Request(
            found.url + path.lstrip("/"),
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {found.token}", "Content-Type": kind},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                return reply.status, json.loads(reply.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                text = json.loads(exc.read() or b"{}")
            except ValueError:
                text = {"error": "(not JSON)"}
            return exc.code, text


# ---------------------------------------------------------------- links: a loopback server


class MediaServer:
    """Serves the test's songs as `/c<N>.wav` on 127.0.0.1."""

    def __init__(self, songs: list[bytes]):
        self.songs = songs

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(handler) -> None:  # the server is `self` here
                match = re.fullmatch(r"/c(\d+)\.wav", handler.path.split("?")[0])
                if match is None or int(match.group(1)) >= len(self.songs):
                    handler.send_error(404)
                    return
                data = self.songs[int(match.group(1))]
                handler.send_response(200)
                handler.send_header("Content-Type", "audio/wav")
                handler.send_header("Content-Length", str(len(data)))
                handler.end_headers()
                if handler.command == "GET":
                    try:
                        handler.wfile.write(data)
                    except OSError:
                        pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="media-server", daemon=True
        )
        self.thread.start()

    def url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/c{index}.wav"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


# ---------------------------------------------------------------- a small disk


def _margin() -> int:
    from stemdeck_watch.engine import diskguard

    return int(getattr(diskguard, "MARGIN", 64 << 20))


class SmallDisk:
    """A tmpfs holding the outbox, with the state folder's scratch bound onto it: one small
    filesystem for both, as on a small SSD. `fill` leaves less free than the disk check's
    margin (every song is held back), `free` gives the room back."""

    SIZE = 96 << 20

    def __init__(self, volume: Path, scratch: Path):
        self.volume, self.scratch = volume, scratch
        self.filler = volume / "filler.bin"
        self.mounted: list[Path] = []
        volume.mkdir(parents=True, exist_ok=True)
        scratch.mkdir(parents=True, exist_ok=True)
        try:
            _mount(["-t", "tmpfs", "-o", f"size={self.SIZE}", "tmpfs", str(volume)])
            self.mounted.append(volume)
            (volume / "scratch").mkdir()
            _mount(["--bind", str(volume / "scratch"), str(scratch)])
            self.mounted.append(scratch)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def unavailable(probe: Path) -> str | None:
        """Why no small disk can be had here (None: it can)."""
        if os.geteuid() != 0:
            return "mounting a tmpfs needs root"
        probe.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            return f"could not mount a tmpfs: {done.stderr.strip()}"
        subprocess.run(["umount", str(probe)], check=False)
        return None

    def fill(self) -> None:
        st = os.statvfs(self.volume)
        free = st.f_bavail * st.f_frsize
        keep = max(0, _margin() - (8 << 20))
        if free > keep:
            with open(self.filler, "ab") as handle:
                os.posix_fallocate(handle.fileno(), 0, handle.tell() + free - keep)

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        for folder in reversed(self.mounted):
            if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(folder)], check=False)
        self.mounted.clear()


def _mount(args: list[str]) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise AssertionError(f"mount {' '.join(args)} failed: {done.stderr.strip()}")
