"""Peak memory of the service and of its worker against the length of the song.

What a user runs: one `stemdeck-watch run` process per song (tiny model, CPU, the default
output steps: stems, tags, beat grid, preview), started from a config file. Once its worker
holds the model, a synthetic song is renamed into the inbox; the parent samples `VmRSS` of
the `run` process and of its worker every 0.2 s through the whole job, and reads the kernel's
peak resident set (`VmHWM` in /proc/PID/status) of both once the input has reached
processed/ and before the service is stopped. Target: at 60 minutes each peak is at most
300 MB above its own 1-minute figure.

An earlier version of this benchmark ran the Service inside its own small script and took a
peak that never included the beat grid's whole-song tempogram; measuring the `run` process,
sampled through the whole job, is what a user's machine sees.

Speed: a 5-minute song, job wall time (queued -> done, from the registry) per minute of
audio, the current code against a copy of an earlier tree (`--before DIR`, e.g.
`git archive HEAD | tar -x -C /tmp/before`), runs interleaved, medians compared. Target: no
more than 5 % slower.

    python benchmarks/bench_memory.py [--minutes 1 10 30 60] [--speed-runs 3]
                                      [--before /tmp/before] [--before-minutes 1 5]

The parent never imports torch; 60 minutes of audio take ~10 minutes of CPU on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from harness import machine, parser as bench_parser, tiny_model, wait_quiet, write_results

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SR = 44100
PIECE_SECONDS = 60


def status_kb(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def descendants(pid: int) -> list[int]:
    """Live processes below `pid` (from /proc/*/stat): the worker runs in its own session,
    a child of the service."""
    table: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            table[int(entry)] = int(fields[1])
    found: list[int] = []
    frontier = {pid}
    while frontier:
        frontier = {p for p, parent in table.items() if parent in frontier} - set(found)
        found.extend(sorted(frontier))
    return found


def child_songs(folder: str, minutes: list[int]) -> None:
    """Write one 16-bit wav per length, piece by piece (a minute at a time), never whole."""
    import soundfile

    from stemdeck_watch.util.synth import song

    files = {
        m: soundfile.SoundFile(Path(folder) / f"song-{m:03d}min.wav", "w", SR, 2, subtype="PCM_16")
        for m in minutes
    }
    try:
        for i in range(max(minutes)):
            piece = song(PIECE_SECONDS, seed=i)
            for m, handle in files.items():
                if i < m:
                    handle.write(piece)
    finally:
        for handle in files.values():
            handle.close()


# -------------------------------------------------------------------------- the parent side


def write_config(root: Path, repo: Path) -> Path:
    import tomli_w

    config = {
        "folders": {n: str(root / n) for n in ("inbox", "outbox", "processed", "failed", "state")},
        "separation": {"model": "tiny", "model_repo": str(repo), "device": "cpu"},
        "watch": {"settle_seconds": 0.5},
    }
    path = root / "stemdeck.toml"
    path.write_text(tomli_w.dumps(config))
    return path


def registry_row(root: Path, query: str) -> Any:
    """One value from the service's registry, read-only (as `status` reads it)."""
    path = root / "state" / "registry.sqlite3"
    if not path.exists():
        return None
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5) as db:
            return db.execute(query).fetchone()
    except sqlite3.Error:
        return None


def wait(predicate: Any, proc: subprocess.Popen[bytes], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def run_one(song: Path, repo: Path, work: Path, pythonpath: str | None) -> dict[str, Any]:
    """One `stemdeck-watch run` of the tree at `pythonpath` (this one by default), one song."""
    root = Path(tempfile.mkdtemp(prefix="svc-", dir=work))
    config = write_config(root, repo)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    log = open(root / "service.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "stemdeck_watch", "run", "--no-tray", "--config", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=pythonpath or str(ROOT),
        start_new_session=True,
    )
    sampled = {"service": 0, "worker": 0}
    workers: set[int] = set()
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            rss = status_kb(proc.pid, "VmRSS")
            if rss:
                sampled["service"] = max(sampled["service"], rss)
            for child in descendants(proc.pid):
                workers.add(child)
                rss = status_kb(child, "VmRSS")
                if rss:
                    sampled["worker"] = max(sampled["worker"], rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    processed = root / "processed" / song.name
    try:
        wait(
            lambda: registry_row(root, "SELECT value FROM meta WHERE key IN ('worker', 'workers')"),
            proc,
            600,
            "the worker to load the model",
        )
        os.replace(song, root / "inbox" / song.name)
        row = wait(
            lambda: registry_row(
                root,
                "SELECT state, error, output, created_at, finished_at FROM jobs "
                "WHERE state IN ('done', 'failed', 'cancelled')",
            ),
            proc,
            4 * 3600,
            f"{song.name} to finish",
        )
        worker = max(workers) if workers else None
        peaks = {
            "service_hwm_kb": status_kb(proc.pid, "VmHWM"),
            "worker_hwm_kb": status_kb(worker, "VmHWM") if worker else None,
        }
    finally:
        stop.set()
        sampler.join()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        if processed.exists():  # hand the song back for the next run
            os.replace(processed, song)
    state, error, output, created, finished = row
    if state != "done":
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"{song.name} ended {state}: {error}")
    manifest = json.loads((Path(output) / "stemdeck.json").read_text())
    shutil.rmtree(root, ignore_errors=True)
    return {
        **peaks,
        "service_sampled_kb": sampled["service"],
        "worker_sampled_kb": sampled["worker"],
        "job_seconds": finished - created,
        "timings": manifest["timings"],
        "duration": manifest["input"]["duration"],
    }


def mb(kb: int | None) -> float:
    return (kb or 0) / 1024


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "memory", quiet=True, patience=300)
    parser.add_argument("--minutes", type=int, nargs="*", default=[1, 10, 30, 60])
    parser.add_argument("--speed-minutes", type=int, default=5)
    parser.add_argument("--speed-runs", type=int, default=3)
    parser.add_argument("--before", type=Path, help="an earlier source tree to compare speed")
    parser.add_argument(
        "--before-minutes",
        type=int,
        nargs="*",
        default=[],
        help="also measure the earlier tree's peaks at these lengths",
    )
    parser.add_argument("--work", type=Path, help="working folder (default: a temp folder)")
    parser.add_argument("--child-songs", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_songs:
        child_songs(args.child_songs[0], [int(m) for m in args.child_songs[1:]])
        return 0
    began = time.monotonic()
    work = args.work or Path(tempfile.mkdtemp(prefix="stemdeck-mem-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"machine": machine(), "memory": {}, "memory_before": {}, "speed": {}}
    try:
        repo = work / "models"
        tiny_model(repo)
        lengths = sorted(
            set(args.minutes)
            | set(args.before_minutes)
            | ({args.speed_minutes} if args.speed_runs else set())
        )
        songs = work / "songs"
        songs.mkdir(exist_ok=True)
        missing = [m for m in lengths if not (songs / f"song-{m:03d}min.wav").exists()]
        if missing:
            t = time.monotonic()
            subprocess.run(
                [sys.executable, __file__, "--child-songs", str(songs), *map(str, missing)],
                check=True,
            )
            print(f"wrote songs {missing} min in {time.monotonic() - t:.0f} s", file=sys.stderr)

        def song(minutes: int) -> Path:
            return songs / f"song-{minutes:03d}min.wav"

        for minutes in args.minutes:
            r = run_one(song(minutes), repo, work, None)
            results["memory"][minutes] = r
            print(
                f"{minutes:3d} min: service {mb(r['service_hwm_kb']):7.0f} MB, worker "
                f"{mb(r['worker_hwm_kb']):7.0f} MB, job {r['job_seconds']:.1f} s "
                f"({r['job_seconds'] / minutes:.2f} s/min)",
                file=sys.stderr,
                flush=True,
            )
        if args.before:
            for minutes in args.before_minutes:
                r = run_one(song(minutes), repo, work, str(args.before))
                results["memory_before"][minutes] = r
                print(
                    f"before {minutes:3d} min: service {mb(r['service_hwm_kb']):7.0f} MB, "
                    f"worker {mb(r['worker_hwm_kb']):7.0f} MB",
                    file=sys.stderr,
                    flush=True,
                )
            runs: dict[str, list[dict[str, Any]]] = {"now": [], "before": []}
            for n in range(args.speed_runs):
                for label, path in (("now", None), ("before", str(args.before))):
                    quiet = wait_quiet(args.quiet, args.patience)
                    r = run_one(song(args.speed_minutes), repo, work, path)
                    r["other_cores_before"] = quiet
                    runs[label].append(r)
                    print(
                        f"speed run {n + 1} {label}: {r['job_seconds']:.2f} s "
                        f"(separate {r['timings'].get('separate')} s)",
                        file=sys.stderr,
                        flush=True,
                    )
            results["speed"] = runs
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    results["total_seconds"] = time.monotonic() - began
    print(report(results, args))
    write_results(args.out, results)
    return 0


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    info = results["machine"]
    lines = [
        f"One song per fresh `stemdeck-watch run`, tiny model, CPU; {info['nproc']} cores "
        f"({info['cpu']}), Python {info['python']}, torch {info['torch']}"
    ]
    memory = results["memory"]
    if memory:
        lines += [
            "",
            "| song | service peak (VmHWM) | worker peak (VmHWM) | service sampled | "
            "worker sampled | job s | s per min of audio |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
    for minutes, r in sorted(memory.items()):
        lines.append(
            f"| {minutes} min | {mb(r['service_hwm_kb']):,.0f} MB | "
            f"{mb(r['worker_hwm_kb']):,.0f} MB | {mb(r['service_sampled_kb']):,.0f} MB"
            f" | {mb(r['worker_sampled_kb']):,.0f} MB | {r['job_seconds']:.1f} | "
            f"{r['job_seconds'] / minutes:.2f} |"
        )
    if 1 in memory and len(memory) > 1:
        longest = max(memory)
        for who in ("service", "worker"):
            grow = mb(memory[longest][f"{who}_hwm_kb"]) - mb(memory[1][f"{who}_hwm_kb"])
            lines.append(
                f"- {'PASS' if grow <= 300 else 'FAIL'}: {who} at {longest} min is "
                f"{grow:+.0f} MB over its 1-minute peak (target <= 300 MB)"
            )
    for minutes, r in sorted(results["memory_before"].items()):
        lines.append(
            f"- before: {minutes} min: service {mb(r['service_hwm_kb']):,.0f} MB, "
            f"worker {mb(r['worker_hwm_kb']):,.0f} MB"
        )
    speed = results["speed"]
    if speed and speed.get("now") and speed.get("before"):
        minutes = args.speed_minutes
        lines += [
            "",
            f"| {minutes}-minute song, {len(speed['now'])} runs each | wall s per "
            f"minute of audio, min | median | max | separate s (min) | write s (min) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        best, middle = {}, {}
        for label in ("now", "before"):
            runs = speed[label]
            walls = [r["job_seconds"] / minutes for r in runs]
            best[label], middle[label] = min(walls), statistics.median(walls)
            lines.append(
                f"| {label} | {min(walls):.2f} | {statistics.median(walls):.2f} | "
                f"{max(walls):.2f} | "
                f"{min(float(r['timings'].get('separate', 0)) for r in runs):.1f} | "
                f"{min(float(r['timings'].get('write', 0)) for r in runs):.2f} |"
            )
        change = best["now"] / best["before"] - 1
        lines.append(
            f"- {'PASS' if change <= 0.05 else 'FAIL'}: fastest run now/before = "
            f"{best['now'] / best['before']:.3f} ({change:+.1%}; target <= +5 %); "
            f"medians {middle['now'] / middle['before']:.3f}. The fastest run is the "
            f"one least disturbed by other processes on a shared machine."
        )
    lines.append(f"\ntotal benchmark time {results['total_seconds']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
