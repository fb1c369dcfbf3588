"""Control latency of the running service: cancel, the event stream, the queue API.

One real Service in this process (real watcher, registry, resident worker process, local API
on 127.0.0.1, port picked at start), the tiny model on the CPU, steered the way a person or a
client does: files deleted from the inbox, `stemdeck-watch cancel` (the CLI's main() in this
process, so the reading starts after Python's own start-up), HTTP with the token from the
discovery file, the event stream read on a raw socket. Five measures (numbered as in
the docs' benchmark table; they run in the order 1, 5 with 2, 4, 3 — the idle window last, once the registry
holds every finished job, so that a snapshot that changed with time alone would show):

(1) cancel of the RUNNING job: a 30 s song separating (worker progress seen, not just the stage
    set), then the input deleted (os.unlink) or `cancel JOB`; from the action until the worker
    process that was separating is gone (reaped: /proc/PID no longer exists) AND the job's
    state is `cancelled` (the JobChanged event). 20 trials each, alternating. p95 <= 0.5 s.
(2) cancel of a QUEUED job: the queue paused behind a long separation (the worker busy on both
    cores), batches of songs queued, each then deleted or cancelled with the CLI; from the
    action until the state is `cancelled`. 20 trials each. p95 <= 0.2 s.
(3) frames per minute while idle: every job over, nothing queued, 60 s with the stream open
    (and a second stream opened for the window); frames (`event:`/`data:`) after the one a new
    stream gets at once; keep-alive comments are counted apart and are not frames. Target 0.
(4) change -> frame: with a stream connected, 20 pause/start POSTs; from just before the POST
    until the frame showing the new pause state arrives. p95 <= 0.2 s.
(5) GET /api/queue while a song separates: 200 requests ~25 ms apart, each a fresh connection
    as the CLI makes; connect to body read. p95 <= 20 ms.

Also recorded: for every cancel, when the stream showed it. Other processes' CPU use is
measured (as in bench_throughput.py) and the script waits a bounded time for a quiet machine
before each measure; the machine may be shared. Raw numbers: benchmarks/results/control.json.

    python benchmarks/bench_control.py [--trials 20] [--idle 60] [--requests 200]
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import logging
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from harness import (
    cpu_snapshot,
    machine,
    other_cores,
    parser as bench_parser,
    summary,
    tiny_model,
    wait_quiet,
    write_results,
)
from support.helpers import child_pids  # noqa: F401  (bench_links imports it from here)

SONG_SECONDS = 30.0  # the songs that are cancelled while they separate
SHIFTS = 2  # [separation] shifts: ~4 s of separation per song on a quiet 2-core box
LONG_PRESET = "long"  # inbox/long/: shifts = 20, the song separating under (2) and (5)
POLL = 0.002  # how often the worker's /proc entry is looked at during a cancel
TARGETS = {"running": 0.5, "queued": 0.2, "frame": 0.2, "get": 0.020, "idle": 0}


def proc_state(pid: int) -> str:
    """ "alive", "exited" (its main thread is a zombie: the process is not reaped yet, or its
    other threads are still being torn down) or "gone" (reaped: the pid no longer exists)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "gone"
    return "exited" if state in ("Z", "X") else "alive"


def poll_until(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05
) -> Any:
    """For conditions no event announces (the queue empty): look every `interval` s. Never
    inside JobWatch's lock: the service may hold its scheduler lock while it publishes."""
    pace, deadline = threading.Event(), time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        pace.wait(interval)
    return value


class JobWatch:
    """Every job change the service announces, with the time it was announced."""

    def __init__(self, bus: Any):
        from stemdeck_watch.core.events import JobChanged

        self._cond = threading.Condition()
        self.latest: dict[str, Any] = {}  # job id -> Job
        self.by_name: dict[str, str] = {}  # song name -> its latest job id
        self.reached: dict[tuple[str, str], float] = {}  # (job id, state) -> first time
        bus.subscribe(JobChanged, self._on_change)

    def _on_change(self, event: Any) -> None:
        now, job = time.monotonic(), event.job
        with self._cond:
            self.latest[job.id] = job
            self.by_name[job.name] = job.id
            self.reached.setdefault((job.id, job.state.value), now)
            self._cond.notify_all()

    def job(self, name: str) -> Any:
        with self._cond:
            job_id = self.by_name.get(name)
            return self.latest.get(job_id) if job_id else None

    def wait(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        with self._cond:
            value = self._cond.wait_for(predicate, timeout)
        if not value:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        return value

    def when(self, job_id: str, state: str) -> float | None:
        with self._cond:
            return self.reached.get((job_id, state))


class Stream:
    """The event stream on a raw socket, read by its own thread: every frame and comment
    with the time it arrived (the main thread is busy sending requests meanwhile)."""

    def __init__(self, port: int, token: str):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(
            f"GET /api/queue/events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {token}\r\n\r\n".encode()
        )
        self.sock.settimeout(None)
        self._cond = threading.Condition()
        self.frames: list[tuple[float, dict[str, Any]]] = []
        self.comments: list[float] = []
        self.error: str | None = None
        self._thread = threading.Thread(target=self._read, name="bench-sse", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        buffer, header_done = b"", False
        try:
            while chunk := self.sock.recv(65536):
                now = time.monotonic()
                buffer += chunk
                if not header_done:
                    if b"\r\n\r\n" not in buffer:
                        continue
                    head, buffer = buffer.split(b"\r\n\r\n", 1)
                    if b" 200 " not in head.split(b"\r\n", 1)[0]:
                        raise RuntimeError(f"the stream was refused: {head[:200]!r}")
                    header_done = True
                while b"\n\n" in buffer:
                    block, buffer = buffer.split(b"\n\n", 1)
                    with self._cond:
                        if block.startswith(b":"):
                            self.comments.append(now)
                        else:
                            fields = dict(
                                line.split(": ", 1) for line in block.decode().split("\n")
                            )
                            self.frames.append((now, json.loads(fields["data"])))
                        self._cond.notify_all()
        except OSError:
            pass  # closed by us or by the service's shutdown
        except Exception as exc:  # a malformed frame is a finding, not a crash of the bench
            self.error = f"{type(exc).__name__}: {exc}"
        with self._cond:
            self._cond.notify_all()

    def wait_frame(
        self, since: float, predicate: Callable[[dict[str, Any]], bool], timeout: float
    ) -> float | None:
        """Arrival time of the first frame after `since` that satisfies `predicate`."""

        def found() -> float | None:
            return next((t for t, snap in self.frames if t >= since and predicate(snap)), None)

        with self._cond:
            return self._cond.wait_for(found, timeout)

    def counts(self) -> tuple[int, int]:
        with self._cond:
            return len(self.frames), len(self.comments)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(3)


def job_state_in(snap: dict[str, Any], job_id: str) -> str | None:
    return next((j["state"] for j in snap.get("jobs", []) if j["id"] == job_id), None)


class Bench:
    """The service, its API, a config file for the CLI, and the songs to drop."""

    def __init__(self, work: Path, repo: Path, song: Path):
        import tomli_w

        from stemdeck_watch.core.config import default_toml, settings_from_dict
        from stemdeck_watch.core.events import EventBus
        from stemdeck_watch.service import Service

        data = default_toml()  # as tests/conftest.py config_data does
        data["folders"] = {
            n: str(work / n) for n in ("inbox", "outbox", "processed", "failed", "state")
        }
        data["separation"].update(model="tiny", model_repo=str(repo), device="cpu", shifts=SHIFTS)
        data["watch"]["settle_seconds"] = 0.3
        data["api"].update(enabled=True, host="127.0.0.1", port=0)
        data["presets"] = {LONG_PRESET: {"shifts": 20}}
        work.mkdir(parents=True, exist_ok=True)
        self.config = work / "stemdeck.toml"
        self.config.write_text(tomli_w.dumps(data))
        self.settings = settings_from_dict(data, source=self.config)
        self.song, self.drop_dir = song, work / "drop"
        self.drop_dir.mkdir()
        self.bus = EventBus()
        self.watch = JobWatch(self.bus)
        self.service = Service(self.settings, bus=self.bus)
        self.service.start()
        if self.service.api is None:
            raise RuntimeError("the local API did not start")
        self.port, self.token = self.service.api.port, self.service.api.token
        self.inbox = self.settings.paths.inbox

    # ------------------------------------------------------------ steering

    def drop(self, name: str, folder: str | None = None) -> Path:
        """A complete copy of the song appears in the inbox at once (copied, then renamed)."""
        staged = self.drop_dir / f"{name}.wav"
        shutil.copyfile(self.song, staged)
        target = (self.inbox / folder if folder else self.inbox) / f"{name}.wav"
        os.replace(staged, target)
        return target

    def http(self, method: str, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=15)
        try:
            conn.request(
                method,
                path,
                body=b"{}" if method == "POST" else None,
                headers={
                    "Host": f"127.0.0.1:{self.port}",
                    "Authorization": f"Bearer {self.token}",
                    **({"Content-Type": "application/json"} if method == "POST" else {}),
                },
            )
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def post(self, path: str) -> Any:
        status, body = self.http("POST", path)
        if status != 200:
            raise RuntimeError(f"POST {path} answered {status}: {body[:300]!r}")
        return json.loads(body)

    def cli_cancel(self, job_id: str) -> None:
        from stemdeck_watch.cli.main import main as cli_main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main(["cancel", job_id, "--config", str(self.config)])
        if code != 0:
            raise RuntimeError(f"stemdeck-watch cancel {job_id} exited {code}: {err.getvalue()}")

    def separating(self, name: str, timeout: float = 180.0) -> Any:
        """Wait until `name` separates and the worker has reported progress of its own (the
        stage starts at DECODE_SHARE; anything above it came from the worker)."""
        from stemdeck_watch.engine.pipeline import DECODE_SHARE

        def ready() -> Any:
            job = self.watch.job(name)
            if job is not None and job.state.is_final:
                raise RuntimeError(
                    f"{name} ended ({job.state.value}: {job.error}) before it could be measured"
                )
            return (
                job
                if (
                    job is not None
                    and job.state.value == "separating"
                    and job.progress > DECODE_SHARE
                )
                else None
            )

        return self.watch.wait(ready, timeout, f"{name} to separate")

    def idle(self) -> bool:
        snap = self.service.scheduler.snapshot()
        return snap["running"] is None and not snap["queued"] and not snap["waiting"]

    def shutdown(self) -> None:
        self.service.shutdown()


def cancel_running(bench: Bench, stream: Stream, trials: int) -> list[dict[str, Any]]:
    """(1): alternating delete and CLI cancel of the separating job."""
    pace, rows = threading.Event(), []
    for i in range(2 * trials):
        how = ("delete", "cli")[i % 2]
        name = f"running-{how}-{i // 2:02d}"
        cpu0, w0 = cpu_snapshot(), time.monotonic()
        path = bench.drop(name)
        job = bench.separating(name)
        pid = bench.service.client.pid
        if pid is None or proc_state(pid) != "alive":
            raise RuntimeError(f"{name} separates but no worker process is alive")
        progress = job.progress
        t0 = time.monotonic()
        if how == "delete":
            os.unlink(path)
        else:
            bench.cli_cancel(job.id)
        returned = time.monotonic()
        exited = reaped = None
        while True:
            now = time.monotonic()
            state = proc_state(pid)
            if state != "alive" and exited is None:
                exited = now
            if state == "gone" and reaped is None:
                reaped = now
            cancelled = bench.watch.when(job.id, "cancelled")
            if (reaped is not None and cancelled is not None) or now - t0 > 10:
                break
            pace.wait(POLL)
        final = bench.watch.job(name)
        framed = stream.wait_frame(t0, lambda s, j=job.id: job_state_in(s, j) == "cancelled", 5)
        row = {
            "trial": name,
            "how": how,
            "job": job.id,
            "worker_pid": pid,
            "progress_at_action": progress,
            "final_state": final.state.value,
            "call_s": returned - t0,
            "exited_s": None if exited is None else exited - t0,
            "reaped_s": None if reaped is None else reaped - t0,
            "cancelled_s": None if cancelled is None else cancelled - t0,
            "frame_s": None if framed is None else framed - t0,
            "other_cores": other_cores(cpu0, time.monotonic() - w0),
        }
        row["seconds"] = (
            max(row["reaped_s"], row["cancelled_s"])
            if reaped is not None and cancelled is not None
            else None
        )
        rows.append(row)
        shown = "TIMEOUT" if row["seconds"] is None else f"{row['seconds'] * 1000:.0f} ms"
        print(
            f"  {name}: {shown} (worker gone {fmt_ms(row['reaped_s'])}, cancelled "
            f"{fmt_ms(row['cancelled_s'])}, frame {fmt_ms(row['frame_s'])}; other procs "
            f"{row['other_cores']:.2f} cores)",
            file=sys.stderr,
            flush=True,
        )
        poll_until(bench.idle, 60, "the queue to empty after the cancel")
    return rows


def queue_latency(bench: Bench, requests: int, spacing: float) -> list[dict[str, Any]]:
    """(5): GET /api/queue on a fixed schedule while the long song separates."""
    pace, rows = threading.Event(), []
    start = time.monotonic()
    for i in range(requests):
        pace.wait(max(0.0, start + i * spacing - time.monotonic()))
        t0 = time.monotonic()
        status, body = bench.http("GET", "/api/queue")
        seconds = time.monotonic() - t0
        if status != 200:
            raise RuntimeError(f"GET /api/queue answered {status}: {body[:300]!r}")
        snap = json.loads(body)
        running = snap["running"]
        rows.append(
            {
                "seconds": seconds,
                "bytes": len(body),
                "jobs": len(snap["jobs"]) + snap.get("older_jobs", 0),
                "separating": bool(running and running["state"] == "separating"),
            }
        )
    return rows


def cancel_queued(
    bench: Bench, stream: Stream, trials: int, long_id: str, batch: int = 10
) -> list[dict[str, Any]]:
    """(2): the queue paused (the long song goes on separating); batches of queued songs,
    each cancelled by deleting its file or with the CLI, alternating."""
    pace, rows = threading.Event(), []
    plan = [(("delete", "cli")[i % 2], i // 2) for i in range(2 * trials)]
    for first in range(0, len(plan), batch):
        names = {f"queued-{how}-{n:02d}": how for how, n in plan[first : first + batch]}
        paths = {name: bench.drop(name) for name in names}
        bench.watch.wait(
            lambda: all(
                (j := bench.watch.job(n)) is not None and j.state.value == "queued" for n in names
            ),
            60,
            f"{len(names)} songs to be queued",
        )
        for name, how in names.items():
            job = bench.watch.job(name)
            behind = bench.watch.latest[long_id].state.value == "separating"
            t0 = time.monotonic()
            if how == "delete":
                os.unlink(paths[name])
            else:
                bench.cli_cancel(job.id)
            returned = time.monotonic()
            bench.watch.wait(
                lambda j=job.id: bench.watch.when(j, "cancelled"), 10, f"{name} to be cancelled"
            )
            cancelled = bench.watch.when(job.id, "cancelled")
            framed = stream.wait_frame(t0, lambda s, j=job.id: job_state_in(s, j) == "cancelled", 5)
            rows.append(
                {
                    "trial": name,
                    "how": how,
                    "job": job.id,
                    "behind_separation": behind,
                    "call_s": returned - t0,
                    "seconds": cancelled - t0,
                    "frame_s": None if framed is None else framed - t0,
                }
            )
            pace.wait(0.05)  # fixed pacing between trials
    return rows


def change_to_frame(bench: Bench, stream: Stream, changes: int) -> list[dict[str, Any]]:
    """(4): pause/start POSTs, each until the frame showing the new pause state."""
    pace, rows = threading.Event(), []
    for i in range(changes):
        pace.wait(0.1)  # fixed pacing: the previous change's frame is out (settle 30 ms)
        action = ("pause", "start")[i % 2]
        want = action == "pause"
        t0 = time.monotonic()
        bench.post(f"/api/queue/{action}")
        returned = time.monotonic()
        framed = stream.wait_frame(t0, lambda s, w=want: s["paused"] is w, 5)
        rows.append(
            {
                "action": action,
                "post_s": returned - t0,
                "seconds": None if framed is None else framed - t0,
            }
        )
    return rows


def idle_frames(bench: Bench, stream: Stream, seconds: float) -> dict[str, Any]:
    """(3): frames and comments arriving on the open stream while nothing happens, and a
    second stream opened for the window (its first frame is the state as of now)."""
    if not bench.idle():
        raise RuntimeError("the service is not idle")
    fresh = Stream(bench.port, bench.token)
    try:
        fresh.wait_frame(0.0, lambda s: True, 10)
        frames0, comments0 = stream.counts()
        fresh0 = fresh.counts()
        sent0 = bench.service.api.broadcaster.frames_sent
        cpu0, t0 = cpu_snapshot(), time.monotonic()
        threading.Event().wait(seconds)  # the measurement window
        frames1, comments1 = stream.counts()
        fresh1 = fresh.counts()
        result = {
            "seconds": seconds,
            "frames": frames1 - frames0,
            "comments": comments1 - comments0,
            "fresh_stream_frames": fresh1[0] - fresh0[0],
            "fresh_stream_comments": fresh1[1] - fresh0[1],
            "broadcaster_frames": bench.service.api.broadcaster.frames_sent - sent0,
            "still_idle": bench.idle(),
            "other_cores": other_cores(cpu0, time.monotonic() - t0),
        }
    finally:
        fresh.close()
    result["frames_per_minute"] = result["frames"] * 60.0 / seconds
    return result


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def report(results: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    lines = [
        "| measure | n | median | p95 | min | max | target (p95) | |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    verdicts: dict[str, bool] = {}

    def row(label: str, values: list[float | None], target: float | None, key: str) -> None:
        missing = sum(v is None for v in values)
        got = [v for v in values if v is not None]
        if not got:
            lines.append(f"| {label} | 0 | | | | | | FAIL (nothing arrived) |")
            if key:
                verdicts[key] = False
            return
        s = summary(got)
        verdict = ""
        if target is not None:
            ok = missing == 0 and s["p95"] <= target
            verdicts[key] = ok
            verdict = "pass" if ok else "FAIL"
            if missing:
                verdict += f" ({missing} never arrived)"
        elif missing:
            verdict = f"{missing} never arrived"
        lines.append(
            f"| {label} | {s['n']} | {fmt_ms(s['median'])} | {fmt_ms(s['p95'])} | "
            f"{fmt_ms(s['min'])} | {fmt_ms(s['max'])} | "
            f"{'' if target is None else '≤ ' + fmt_ms(target)} | {verdict} |"
        )

    running = results["cancel_running"]
    for how, label in (("delete", "input deleted"), ("cli", "`cancel JOB` (CLI)")):
        trials = [r for r in running if r["how"] == how]
        row(
            f"(1) running job, {label} → worker gone + `cancelled`",
            [r["seconds"] for r in trials],
            TARGETS["running"],
            f"running_{how}",
        )
        row("    of which: worker reaped", [r["reaped_s"] for r in trials], None, "")
        row("    of which: state `cancelled`", [r["cancelled_s"] for r in trials], None, "")
        row("    the stream shows it", [r["frame_s"] for r in trials], None, "")
    queued = results["cancel_queued"]
    for how, label in (("delete", "input deleted"), ("cli", "`cancel JOB` (CLI)")):
        trials = [r for r in queued if r["how"] == how]
        row(
            f"(2) queued job, {label} → `cancelled`",
            [r["seconds"] for r in trials],
            TARGETS["queued"],
            f"queued_{how}",
        )
        row("    the stream shows it", [r["frame_s"] for r in trials], None, "")
    idle = results["idle"]
    ok = idle["frames"] == 0 and idle["fresh_stream_frames"] == 0 and idle["still_idle"]
    verdicts["idle"] = ok
    lines.append(
        f"| (3) stream frames per minute while idle ({idle['seconds']:.0f} s, 2 streams; "
        f"keep-alive comments apart: {idle['comments']}) | 1 | "
        f"{idle['frames_per_minute']:.1f} | | | | 0 | {'pass' if ok else 'FAIL'} |"
    )
    row(
        "(4) pause/start POST → frame with the change",
        [r["seconds"] for r in results["change_to_frame"]],
        TARGETS["frame"],
        "frame",
    )
    row(
        "    the POST's own round trip", [r["post_s"] for r in results["change_to_frame"]], None, ""
    )
    get = results["queue_get"]
    row(
        "(5) GET /api/queue while a song separates",
        [r["seconds"] for r in get],
        TARGETS["get"],
        "get",
    )
    notes = []
    late = [r["trial"] for r in running if r["final_state"] != "cancelled"]
    if late:
        notes.append(f"running trials that did not end cancelled: {late}")
    behind = sum(r["behind_separation"] for r in queued)
    notes.append(
        f"(2): {behind} of {len(queued)} queued cancels happened while the long song was separating"
    )
    sep = sum(r["separating"] for r in get)
    notes.append(
        f"(5): {sep} of {len(get)} requests answered while the song was separating; "
        f"{get[-1]['jobs']} jobs in the registry, {get[-1]['bytes']} bytes per answer"
    )
    loads = [r["other_cores"] for r in running]
    notes.append(
        f"other processes kept {statistics.median(loads):.2f} cores busy (median over "
        f"the running-cancel trials; max {max(loads):.2f}) and "
        f"{idle['other_cores']:.2f} during the idle window"
    )
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]), verdicts


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "control", quiet=True, patience=20)
    parser.add_argument("--trials", type=int, default=20, help="per way of cancelling")
    parser.add_argument("--changes", type=int, default=20, help="pause/start changes for (4)")
    parser.add_argument("--requests", type=int, default=200, help="GET /api/queue for (5)")
    parser.add_argument("--spacing", type=float, default=0.025, help="between GETs, s")
    parser.add_argument("--idle", type=float, default=60.0, help="idle window for (3), s")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from stemdeck_watch.util.synth import write_song

    began = time.monotonic()
    children_before = child_pids()
    work = Path(tempfile.mkdtemp(prefix="stemdeck-bench-control-"))
    results: dict[str, Any] = {}
    quiet: dict[str, Any] = {}
    bench = stream = None
    leaked: set[int] = set()

    def settle(measure: str) -> None:
        if args.quiet > 0:
            waited = time.monotonic()
            other = wait_quiet(args.quiet, args.patience)
            quiet[measure] = {"other_cores": other, "waited": time.monotonic() - waited}
        print(f"{measure} ...", file=sys.stderr, flush=True)

    try:
        repo = work / "models"
        tiny_model(repo)
        song = write_song(work / "songs" / "song.wav", SONG_SECONDS, seed=1)
        bench = Bench(work / "service", repo, song)
        settings = bench.settings
        bench.service.client.ensure_model("tiny", str(settings.model_repo))  # warm-up over
        stream = Stream(bench.port, bench.token)
        if stream.wait_frame(0.0, lambda s: True, 10) is None:
            raise RuntimeError("a new stream got no first frame within 10 s")

        settle("(1) cancel of the running job")
        results["cancel_running"] = cancel_running(bench, stream, args.trials)

        settle("(5) GET /api/queue while a song separates, (2) cancel of queued jobs")
        bench.drop("long", LONG_PRESET)
        long_job = bench.separating("long")
        results["queue_get"] = queue_latency(bench, args.requests, args.spacing)
        bench.post("/api/queue/pause")
        results["cancel_queued"] = cancel_queued(bench, stream, args.trials, long_job.id)
        long_state = bench.watch.job("long").state.value
        results["long_song_state_after"] = long_state
        if long_state != "separating":
            print(
                f"  note: the long song was {long_state} before the last queued cancel",
                file=sys.stderr,
            )
        if not bench.watch.job("long").state.is_final:
            bench.post(f"/api/jobs/{long_job.id}/cancel")
        bench.post("/api/queue/start")
        poll_until(bench.idle, 60, "the queue to empty")

        settle("(4) change -> frame")
        results["change_to_frame"] = change_to_frame(bench, stream, args.changes)

        settle(f"(3) idle stream for {args.idle:.0f} s")
        results["idle"] = idle_frames(bench, stream, args.idle)
        if stream.error:
            raise RuntimeError(f"the event stream broke: {stream.error}")
        assert "torch" not in sys.modules, "the benchmark's main process imported torch"
    finally:
        if stream is not None:
            stream.close()
        if bench is not None:
            bench.shutdown()
        deadline = time.monotonic() + 10
        while (leaked := child_pids() - children_before) and time.monotonic() < deadline:
            threading.Event().wait(0.1)
        shutil.rmtree(work, ignore_errors=True)
    if leaked:
        print(
            f"LEAK: child processes still running after shutdown: {sorted(leaked)}", file=sys.stderr
        )
    info = machine()
    table, verdicts = report(results)
    total = time.monotonic() - began
    print(
        f"Control latency: the tiny model on the CPU, {args.trials} trials per way of "
        f"cancelling; {info['nproc']} cores ({info['cpu']}), Python {info['python']}, "
        f"torch {info['torch']}, demucs {info['demucs']}\n"
    )
    print(table)
    print(f"\ntotal benchmark time {total:.0f} s; no processes left: {not leaked}")
    write_results(
        args.out,
        {
            "machine": info,
            "args": {k: v for k, v in vars(args).items() if k != "out"},
            "targets_s": TARGETS,
            "verdicts": verdicts,
            "quiet_before": quiet,
            "leaked_children": sorted(leaked),
            "total_seconds": total,
            "summaries": {
                key: summary([r["seconds"] for r in rows if r["seconds"] is not None])
                for key, rows in (
                    (
                        "running_delete",
                        [r for r in results["cancel_running"] if r["how"] == "delete"],
                    ),
                    ("running_cli", [r for r in results["cancel_running"] if r["how"] == "cli"]),
                    (
                        "queued_delete",
                        [r for r in results["cancel_queued"] if r["how"] == "delete"],
                    ),
                    ("queued_cli", [r for r in results["cancel_queued"] if r["how"] == "cli"]),
                    ("queue_get", results["queue_get"]),
                    ("change_to_frame", results["change_to_frame"]),
                )
            },
            **results,
        },
    )
    return 1 if leaked else 0


if __name__ == "__main__":
    raise SystemExit(main())
