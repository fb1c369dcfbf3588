"""Link jobs with and without the prefetch: does the next download hide behind the separation?

Five link files (`.url`) pointing at a loopback HTTP server that this script starts
(127.0.0.1, port picked at start; nothing leaves the machine). Each serves a different 10 s
synthetic wav (the service skips a song it separated before with the same settings), throttled
so that one download takes about as long as one separation of such a clip with the tiny model
on the CPU (measured first, through the service, with plain files; at most 3 s, --max-download,
so that a busy machine does not stretch the runs). Every run starts a real Service in this
process (watcher, registry, resident worker process; the local API off), pauses the queue,
drops the five link files into the inbox (written aside, then renamed), waits until all five
are queued, then starts the queue. Two modes, alternated, 3 runs each:

  with     the service as shipped: while the worker separates a job, the Prefetcher downloads
           the next queued link.
  without  the same, with `stemdeck_watch.engine.prefetch.Prefetcher._consider` monkeypatched to a
           no-op for the run: nothing is prepared ahead, every link downloads when its job
           runs (the service itself is not edited).

Measured per run:
(a) total: from starting the queue (the five jobs queued while paused) to the last job DONE.
(b) worker idle between jobs: for consecutive jobs (in the order they separated), from job i's
    separation end (the JobSeparated event) to job i+1's separation start (its JobChanged to
    SEPARATING); the sum of these four gaps, and the idle fraction = that sum / (last
    separation end - first separation start). A gap always holds publishing job i and
    decoding job i+1; without the prefetch it also holds job i+1's whole download. The first
    download (before any separation) cannot be hidden in either mode and is not a gap.
    The floor for a gap is measured in the calibration: four plain files of the same clip,
    queued while paused, then started (nothing to download).

Target: idle close to zero with the prefetch, i.e. the download hidden: the median gap with
the prefetch exceeds the plain-file gap by at most 10 % of one download (GAP_SLACK).

Also checked and recorded: one worker process did all the separations (JobSeparated.worker_pid),
every link was fetched once (the server logs every request: yt-dlp's probe, which hangs up
after the headers, and one full transfer; a repeated download is a defect), how many downloads
were asked for before their job left the queue (prefetched: 4 of 5 expected with, 0 without),
and the `download` timing in each manifest (how long the job waited for its download once it
ran). Like the other benchmarks it measures other processes' CPU use
and waits a bounded time for a quiet machine before each run; medians over the runs; raw
numbers: benchmarks/results/links.json.

    python benchmarks/bench_links.py [--runs 3] [--jobs 5] [--seconds 10] [--download S]

Exit status 1 if a check fails or a child process is left behind.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from bench_control import child_pids
from harness import (
    cpu_snapshot,
    machine,
    median,
    other_cores,
    parser as bench_parser,
    tiny_model,
    wait_quiet,
    write_results,
)

STEMS = ("drums", "bass", "other", "vocals")
CHUNKS = 40  # a throttled body goes out in this many evenly paced pieces
RUN_TIMEOUT = 180.0  # seconds for one run's five jobs
GAP_SLACK = 0.10  # "idle close to zero": with the prefetch, a gap may exceed the plain-file
# gap by at most this share of one download


class MediaServer:
    """Serves registered bodies on 127.0.0.1, each GET paced to last `seconds`; logs every
    request (method, path, start, end, bytes sent, whether the body went out in full)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.bodies: dict[str, bytes] = {}
        self.release = threading.Event()  # set on close: ends throttled transfers at once
        self._lock = threading.Lock()
        self.log: list[dict[str, Any]] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                server.handle(self)

            def do_GET(self) -> None:
                server.handle(self)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="bench-media", daemon=True
        )
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    def handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        t0 = time.monotonic()
        path = h.path.lstrip("/").split("?")[0]
        row = {
            "method": h.command,
            "path": path,
            "start": t0,
            "end": None,
            "sent": 0,
            "complete": False,
        }
        with self._lock:
            self.log.append(row)
        body = self.bodies.get(path)
        if body is None:
            h.send_error(404)
            row["end"] = time.monotonic()
            return
        h.send_response(200)
        h.send_header("Content-Type", "audio/wav")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command == "HEAD":
            row["end"] = time.monotonic()
            return
        size = -(-len(body) // CHUNKS)
        try:
            for i in range(CHUNKS):
                # piece i goes out at i/(CHUNKS-1) of the time: the last byte at `seconds`
                if self.release.wait(
                    max(0.0, t0 + i * self.seconds / (CHUNKS - 1) - time.monotonic())
                ):
                    break
                piece = body[i * size : (i + 1) * size]
                h.wfile.write(piece)
                h.wfile.flush()
                row["sent"] += len(piece)
        except OSError:
            pass  # the client hung up (yt-dlp's first request only reads the headers)
        row["complete"] = row["sent"] == len(body)
        row["end"] = time.monotonic()

    def requests(self, since: float) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(r) for r in self.log if r["start"] >= since]

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


class Timeline:
    """When each job first reached each state, and every JobSeparated, by this process's
    monotonic clock at the moment the service announced it."""

    def __init__(self, bus: Any, expect: int):
        from stemdeck_watch.core.events import JobChanged, JobSeparated

        self.expect = expect
        self._cond = threading.Condition()
        self.reached: dict[str, dict[str, float]] = {}
        self.latest: dict[str, Any] = {}
        self.separated: dict[str, dict[str, Any]] = {}
        bus.subscribe(JobChanged, self._on_change)
        bus.subscribe(JobSeparated, self._on_separated)

    def _on_change(self, event: Any) -> None:
        now, job = time.monotonic(), event.job
        with self._cond:
            self.latest[job.id] = job
            self.reached.setdefault(job.id, {}).setdefault(job.state.value, now)
            self._cond.notify_all()

    def _on_separated(self, event: Any) -> None:
        now = time.monotonic()
        with self._cond:
            self.separated[event.job_id] = {
                "at": now,
                "worker_pid": event.worker_pid,
                "seconds": event.seconds,
            }
            self._cond.notify_all()

    def final(self) -> list[Any]:
        with self._cond:
            return [j for j in self.latest.values() if j.state.is_final]

    def wait_final(self, timeout: float) -> list[Any]:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: sum(j.state.is_final for j in self.latest.values()) >= self.expect, timeout
            )
            jobs = [j for j in self.latest.values() if j.state.is_final]
        if not ok:
            raise RuntimeError(
                f"timed out after {timeout:.0f} s: {len(jobs)} of {self.expect} jobs ended"
            )
        return jobs


def make_settings(root: Path, repo: Path, shifts: int) -> Any:
    from stemdeck_watch.core.config import default_toml, settings_from_dict

    data = default_toml()  # as tests/conftest.py config_data does
    data["folders"] = {
        n: str(root / n) for n in ("inbox", "outbox", "processed", "failed", "state")
    }
    data["separation"].update(model="tiny", model_repo=str(repo), device="cpu", shifts=shifts)
    data["watch"]["settle_seconds"] = 0.3
    data["api"]["enabled"] = False
    data["links"]["allow_private"] = True  # the media server listens on 127.0.0.1
    return settings_from_dict(data, source=root / "stemdeck.toml")


@contextlib.contextmanager
def running_service(settings: Any, expect: int) -> Iterator[tuple[Any, Timeline]]:
    from stemdeck_watch.core.events import EventBus
    from stemdeck_watch.service import Service

    bus = EventBus()
    timeline = Timeline(bus, expect)
    service = Service(settings, bus=bus)
    service.start()
    try:
        sep = settings.separation
        service.client.ensure_model(sep.model, str(settings.model_repo))  # warm-up over
        yield service, timeline
    finally:
        service.shutdown()


@contextlib.contextmanager
def prefetch_disabled(disabled: bool) -> Iterator[None]:
    """`without`: the Prefetcher never starts preparing a job (its _consider is a no-op);
    the dispatcher's claim then finds nothing and the pipeline downloads the link itself."""
    from stemdeck_watch.engine.prefetch import Prefetcher

    if not disabled:
        yield
        return
    original = Prefetcher._consider
    Prefetcher._consider = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        Prefetcher._consider = original  # type: ignore[method-assign]


def poll_until(predicate: Any, timeout: float, what: str) -> Any:
    """For conditions no event announces (the queue's length)."""
    pace, deadline = threading.Event(), time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        pace.wait(0.05)
    return value


def check_outbox(settings: Any, count: int, what: str) -> None:
    outputs = [
        o for o in settings.paths.outbox.iterdir() if o.is_dir() and not o.name.startswith(".")
    ]
    if len(outputs) != count or any(
        sorted(p.stem for p in o.glob("*.wav")) != sorted(STEMS) for o in outputs
    ):
        raise RuntimeError(f"{what}: the outbox does not hold {count} folders of 4 stems")


def separation_gaps(
    order: list[str], reached: dict[str, dict[str, float]], separated: dict[str, dict[str, Any]]
) -> list[float]:
    """Job i's separation end (JobSeparated) to job i+1's separation start (SEPARATING)."""
    return [
        reached[order[i + 1]]["separating"] - separated[order[i]]["at"]
        for i in range(len(order) - 1)
    ]


def calibrate(work: Path, repo: Path, songs: list[Path], shifts: int) -> dict[str, Any]:
    """Clips of the same length as plain files, queued while paused, then started: the worker's own
    separation seconds (JobSeparated.seconds) and the gaps between separations when there is
    nothing to download (publish job i, decode job i+1) - the floor for the link runs."""
    settings = make_settings(work, repo, shifts)
    clips = len(songs)
    with running_service(settings, clips) as (service, timeline):
        service.scheduler.pause("user")
        drop = work / "drop"
        drop.mkdir()
        for song in songs:
            shutil.copyfile(song, drop / song.name)
            os.replace(drop / song.name, settings.paths.inbox / song.name)
        poll_until(lambda: len(service.queue.order()) == clips, 30, f"{clips} files queued")
        service.scheduler.start()
        jobs = timeline.wait_final(RUN_TIMEOUT)
        if any(j.state.value != "done" for j in jobs):
            raise RuntimeError(f"calibration failed: {[(j.name, j.error) for j in jobs]}")
        reached = {k: dict(v) for k, v in timeline.reached.items()}
        separated = {k: dict(v) for k, v in timeline.separated.items()}
    if len(separated) != clips:
        raise RuntimeError(f"calibration: {len(separated)} of {clips} clips were separated")
    order = sorted(separated, key=lambda j: reached[j]["separating"])
    seconds = [separated[j]["seconds"] for j in order]
    gaps = separation_gaps(order, reached, separated)
    return {
        "separate_seconds": seconds,
        "median": statistics.median(seconds),
        "file_gaps_s": gaps,
        "file_gap_median": statistics.median(gaps),
    }


def run_links(
    work: Path,
    repo: Path,
    server: MediaServer,
    songs: list[bytes],
    jobs: int,
    shifts: int,
    mode: str,
    tag: str,
    quiet: float,
    patience: float,
) -> dict[str, Any]:
    """One run: the five links queued while paused, then the queue started; see the module
    docstring for what is measured."""
    from stemdeck_watch.core.jobs import JobKind

    settings = make_settings(work, repo, shifts)
    paths = [f"{tag}/link{i}.wav" for i in range(jobs)]
    for path, body in zip(paths, songs):  # distinct songs: the service skips a song it
        server.bodies[path] = body  # has separated before with the same settings
    with (
        prefetch_disabled(mode == "without"),
        running_service(settings, jobs) as (service, timeline),
    ):
        service.scheduler.pause("user")
        drop = work / "drop"
        drop.mkdir()
        for i, path in enumerate(paths):  # written aside, then renamed in: complete at once
            staged = drop / f"link{i}.url"
            staged.write_bytes(f"[InternetShortcut]\r\nURL={server.url(path)}\r\n".encode())
            os.replace(staged, settings.paths.inbox / staged.name)
        poll_until(lambda: len(service.queue.order()) == jobs, 30, f"{jobs} links queued")
        queued = list(service.queue.order())
        waited = time.monotonic()
        other_before = wait_quiet(quiet, patience)
        waited = time.monotonic() - waited
        t0, cpu0 = time.monotonic(), cpu_snapshot()
        service.scheduler.start()
        final = timeline.wait_final(RUN_TIMEOUT)
        other = other_cores(cpu0, time.monotonic() - t0)
        reached = {k: dict(v) for k, v in timeline.reached.items()}
        separated = {k: dict(v) for k, v in timeline.separated.items()}
        kinds = {j.id: j.kind for j in final}
    failed = [f"{j.name}: {j.state.value} {j.error}" for j in final if j.state.value != "done"]
    if failed:
        raise RuntimeError(f"{mode} run {tag}: jobs did not finish: {failed}")
    if any(k is not JobKind.LINK for k in kinds.values()):
        raise RuntimeError(f"{mode} run {tag}: not every job was a link job: {kinds}")
    check_outbox(settings, jobs, f"{mode} run {tag}")
    missing = [j for j in queued if j not in separated or "separating" not in reached.get(j, {})]
    if missing:
        raise RuntimeError(f"{mode} run {tag}: no separation recorded for {missing}")

    total = max(reached[j]["done"] for j in queued) - t0
    order = sorted(queued, key=lambda j: reached[j]["separating"])
    starts = [reached[j]["separating"] for j in order]
    ends = [separated[j]["at"] for j in order]
    gaps = separation_gaps(order, reached, separated)
    span = ends[-1] - starts[0]
    busy_worker = sum(separated[j]["seconds"] for j in order)
    pids = sorted({separated[j]["worker_pid"] for j in order})

    # the server's view: which job's link was fetched when, and how often
    requests = server.requests(t0 - 60)
    manifests = {}
    for out in settings.paths.outbox.iterdir():
        if out.is_dir() and (out / "stemdeck.json").is_file():
            manifest = json.loads((out / "stemdeck.json").read_text())
            manifests[manifest["job_id"]] = manifest
    per_job = []
    for job_id in order:
        manifest = manifests[job_id]
        path = manifest["link"]["url"].split(f":{server.port}/", 1)[1]
        gets = [r for r in requests if r["path"] == path and r["method"] == "GET"]
        full = [r for r in gets if r["complete"]]
        downloading = reached[job_id]["downloading"]
        per_job.append(
            {
                "job": job_id,
                "path": path,
                # yt-dlp asks twice per download: a probe (headers only, then it hangs up) and
                # the download itself; more means the link was fetched again
                "get_requests": len(gets),
                "full_transfers": len(full),
                "gets": [
                    {
                        "start": r["start"] - t0,
                        "bytes": r["sent"],
                        "complete": r["complete"],
                        "seconds": None if r["end"] is None else r["end"] - r["start"],
                    }
                    for r in gets
                ],
                "downloading_at": downloading - t0,
                "separating_at": reached[job_id]["separating"] - t0,
                "separated_at": separated[job_id]["at"] - t0,
                "done_at": reached[job_id]["done"] - t0,
                # the Prefetcher asked for it while the job was still queued
                "prefetched": any(r["start"] < downloading for r in gets),
                # how long the job waited for its download once it ran (the manifest's timing)
                "download_wait_s": float(manifest.get("timings", {}).get("download", float("nan"))),
                "manifest_timings": manifest.get("timings", {}),
                "worker_separate_s": separated[job_id]["seconds"],
            }
        )
    repeated = [p["path"] for p in per_job if p["full_transfers"] != 1 or p["get_requests"] != 2]
    return {
        "mode": mode,
        "tag": tag,
        "total_s": total,
        "gaps_s": gaps,
        "idle_s": sum(gaps),
        "span_s": span,
        "idle_fraction": sum(gaps) / span if span > 0 else 0.0,
        "worker_busy_s": busy_worker,
        "worker_pids": pids,
        "first_separation_at": starts[0] - t0,
        "prefetched": sum(p["prefetched"] for p in per_job),
        "fetched_more_than_once": repeated,
        "jobs": per_job,
        "other_cores": other,
        "quiet_before": other_before,
        "waited_for_quiet": waited,
    }


def report(
    runs: list[dict[str, Any]], download: float, calibration: dict[str, Any], jobs: int
) -> tuple[str, dict[str, Any]]:
    floor = calibration["file_gap_median"]
    lines = [
        "| prefetch | total s, median (min–max) | total − separating, s | worker idle between jobs, s: sum of "
        f"{jobs - 1} gaps, median (min–max) | idle fraction | median gap − plain-file gap "
        f"| wait for the download once a job runs, jobs 2–{jobs}, median | links asked "
        "for ahead | links fetched again | other procs, cores |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    med: dict[str, dict[str, float]] = {}
    for mode in ("with", "without"):
        rows = [r for r in runs if r["mode"] == mode]
        if not rows:
            continue
        m = {
            k: median([r[k] for r in rows])
            for k in ("total_s", "idle_s", "idle_fraction", "first_separation_at", "other_cores")
        }
        # the total less the worker's own separation seconds: what the prefetch can shorten,
        # without the noise of separations that a shared machine slows down unevenly
        m["not_separating"] = median([r["total_s"] - r["worker_busy_s"] for r in rows])
        m["gap_median"] = median([g for r in rows for g in r["gaps_s"]])
        m["extra_gap"] = m["gap_median"] - floor
        m["download_wait"] = median([p["download_wait_s"] for r in rows for p in r["jobs"][1:]])
        med[mode] = m
        totals = [r["total_s"] for r in rows]
        idles = [r["idle_s"] for r in rows]
        label = "with (default)" if mode == "with" else "without (`_consider` no-op)"
        lines.append(
            f"| {label} | {m['total_s']:.2f} ({min(totals):.2f}–{max(totals):.2f}) | "
            f"{m['not_separating']:.2f} | "
            f"{m['idle_s']:.2f} ({min(idles):.2f}–{max(idles):.2f}) | "
            f"{100 * m['idle_fraction']:.1f} % | {m['extra_gap']:+.2f} s | "
            f"{m['download_wait']:.2f} s | "
            f"{'/'.join(str(r['prefetched']) for r in rows)} of {jobs} | "
            f"{'/'.join(str(len(r['fetched_more_than_once'])) for r in rows)} of {jobs} | "
            f"{m['other_cores']:.2f} |"
        )
    verdicts: dict[str, bool] = {}
    notes = [
        f"plain files (nothing to download, same clip, queued while paused): median gap "
        f"{1000 * floor:.0f} ms (publish one, decode the next) - the floor for a gap; "
        f"one separation {calibration['median']:.2f} s, one download {download:.2f} s"
    ]
    if "with" in med and "without" in med:
        w, wo = med["with"], med["without"]
        notes.append(
            f"saved by the prefetch (total − separating, medians): "
            f"{wo['not_separating'] - w['not_separating']:.2f} s; ideal: {jobs - 1} "
            f"downloads x {download:.2f} s = {(jobs - 1) * download:.2f} s; medians of "
            f"the totals differ by {wo['total_s'] - w['total_s']:.2f} s"
        )
        notes.append(
            f"median gap between jobs: {1000 * w['gap_median']:.0f} ms with, "
            f"{1000 * wo['gap_median']:.0f} ms without; the first separation starts "
            f"{w['first_separation_at']:.2f} s / {wo['first_separation_at']:.2f} s after "
            f"the start (the first download cannot be hidden)"
        )
        verdicts[
            f"with: the download adds at most {GAP_SLACK:.0%} of one download to the "
            f"median gap ({w['extra_gap']:+.2f} s <= {GAP_SLACK * download:.2f} s)"
        ] = w["extra_gap"] <= GAP_SLACK * download
        verdicts[
            f"the prefetch saves at least half of the {jobs - 1} hideable downloads "
            f"(total − separating: with <= without − {(jobs - 1) * download / 2:.2f} s)"
        ] = w["not_separating"] <= wo["not_separating"] - (jobs - 1) * download / 2
    verdicts["one worker process did every separation in each run"] = all(
        len(r["worker_pids"]) == 1 for r in runs
    )
    verdicts["every link fetched once (2 GETs: yt-dlp's probe + 1 full transfer)"] = not any(
        r["fetched_more_than_once"] for r in runs
    )
    verdicts[f"with: {jobs - 1} of {jobs} downloads started ahead in every run"] = all(
        r["prefetched"] == jobs - 1 for r in runs if r["mode"] == "with"
    )
    verdicts["without: no download started ahead"] = all(
        r["prefetched"] == 0 for r in runs if r["mode"] == "without"
    )
    lines += [""] + [f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in verdicts.items()]
    lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines), {"medians": med, "verdicts": verdicts}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "links", quiet=True, patience=20)
    parser.add_argument("--runs", type=int, default=3, help="per mode")
    parser.add_argument("--jobs", type=int, default=5, help="link files per run")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the clip")
    parser.add_argument("--shifts", type=int, default=1, help="[separation] shifts")
    parser.add_argument(
        "--download",
        type=float,
        default=None,
        metavar="S",
        help="seconds per download (default: the measured separation time, at most --max-download)",
    )
    parser.add_argument(
        "--max-download",
        type=float,
        default=3.0,
        metavar="S",
        help="cap on the measured default: on a busy machine separations slow "
        "down and the runs would grow with them",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from stemdeck_watch.util.synth import write_song

    import yt_dlp  # noqa: F401  -- imported once here, as in a service that has run a link

    began = time.monotonic()
    children_before = child_pids()
    work = Path(tempfile.mkdtemp(prefix="stemdeck-bench-links-"))
    server = None
    runs: list[dict[str, Any]] = []
    leaked: set[int] = set()
    try:
        repo = work / "models"
        tiny_model(repo)
        songs = [write_song(work / f"link{i}.wav", args.seconds, seed=i) for i in range(args.jobs)]
        files = [write_song(work / f"file{i}.wav", args.seconds, seed=100 + i) for i in range(4)]
        quiet = wait_quiet(args.quiet, args.patience)
        print("calibrating: separation time of the clip ...", file=sys.stderr, flush=True)
        calibration = calibrate(work / "calibrate", repo, files, args.shifts)
        calibration["quiet_before"] = quiet
        separate = calibration["median"]
        download = args.download if args.download is not None else min(separate, args.max_download)
        print(
            f"  one separation {separate:.2f} s; each download throttled to {download:.2f} s",
            file=sys.stderr,
            flush=True,
        )
        server = MediaServer(download)
        bodies = [song.read_bytes() for song in songs]
        for n in range(args.runs):
            for mode in ("with", "without") if n % 2 == 0 else ("without", "with"):
                tag = f"r{n}-{mode}"
                run = run_links(
                    work / tag,
                    repo,
                    server,
                    bodies,
                    args.jobs,
                    args.shifts,
                    mode,
                    tag,
                    args.quiet,
                    args.patience,
                )
                runs.append(run)
                print(
                    f"run {n + 1}/{args.runs} {mode:>7}: total {run['total_s']:.2f} s, idle "
                    f"{run['idle_s']:.2f} s ({100 * run['idle_fraction']:.1f} %), gaps "
                    f"{' '.join(f'{g:.2f}' for g in run['gaps_s'])}, prefetched "
                    f"{run['prefetched']}, other procs {run['other_cores']:.2f} cores "
                    f"(waited {run['waited_for_quiet']:.0f} s for quiet)",
                    file=sys.stderr,
                    flush=True,
                )
                shutil.rmtree(work / tag, ignore_errors=True)
        assert "torch" not in sys.modules, "the benchmark's main process imported torch"
    finally:
        if server is not None:
            server.close()
        deadline = time.monotonic() + 10
        while (leaked := child_pids() - children_before) and time.monotonic() < deadline:
            threading.Event().wait(0.1)
        shutil.rmtree(work, ignore_errors=True)
    if leaked:
        print(
            f"LEAK: child processes still running after shutdown: {sorted(leaked)}", file=sys.stderr
        )
    info = machine()
    info["yt_dlp"] = yt_dlp.version.__version__
    table, summary = report(runs, download, calibration, args.jobs)
    total = time.monotonic() - began
    print(
        f"Link jobs: {args.jobs} links x {args.seconds:g} s wav from a loopback server, each "
        f"download throttled to {download:.2f} s; one separation {separate:.2f} s (tiny model, "
        f"CPU, shifts {args.shifts}); {args.runs} runs per mode; {info['nproc']} cores "
        f"({info['cpu']}), Python {info['python']}, torch {info['torch']}, demucs "
        f"{info['demucs']}, yt-dlp {info['yt_dlp']}\n"
        f"`without`: stemdeck_watch.engine.prefetch.Prefetcher._consider monkeypatched to a no-op "
        f"for those runs (the service is not edited).\n"
    )
    print(table)
    print(f"\ntotal benchmark time {total:.0f} s; no processes left: {not leaked}")
    write_results(
        args.out,
        {
            "machine": info,
            "args": vars(args),
            "calibration": calibration,
            "download_seconds": download,
            "gap_slack": GAP_SLACK,
            **summary,
            "runs": runs,
            "leaked_children": sorted(leaked),
            "total_seconds": total,
        },
    )
    ok = all(summary["verdicts"].values()) and not leaked
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
